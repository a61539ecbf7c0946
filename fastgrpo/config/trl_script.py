"""The keys of a config for TRL's ``trl grpo`` script (its ``ScriptArguments``, ``GRPOScriptArguments``,
``ModelConfig`` and ``DatasetMixtureConfig`` beside ``GRPOConfig``, in one YAML file or on the command line) as
fastgrpo's options: `read_script_options`."""

from __future__ import annotations

from typing import Any

from fastgrpo.config.trl_names import changes_nothing
from fastgrpo.config.yaml_loader import YAML11_BOOLEANS

_QUANTIZED = "quantized loading is not supported: the policy trains in the dtype it is loaded in (dtype)"
_LORA = "fastgrpo's LoRA is plain LoRA on lora_target_modules (lora_r, lora_alpha, lora_dropout)"

# Keys of TRL's script configs fastgrpo has no option for: accepted at these values, refused otherwise.
SCRIPT_AT_DEFAULT: dict[str, tuple[tuple[Any, ...], str]] = {
    "model_revision": (("main", None), "the model is read as it is: a local directory, or the hub's main revision"),
    "attn_implementation": (
        (None, "sdpa"),
        "fastgrpo decodes with its own attention over its KV cache and trains with SDPA's",
    ),
    "lora_target_parameters": ((None,), _LORA),
    "lora_modules_to_save": ((None,), _LORA),
    "lora_task_type": (("CAUSAL_LM",), _LORA),
    "use_rslora": ((False,), _LORA),
    "use_dora": ((False,), _LORA),
    "load_in_8bit": ((False,), _QUANTIZED),
    "load_in_4bit": ((False,), _QUANTIZED),
    "bnb_4bit_quant_type": (("nf4",), _QUANTIZED),
    "use_bnb_nested_quant": ((False,), _QUANTIZED),
    "bnb_4bit_quant_storage": ((None,), _QUANTIZED),
    "dataset_streaming": ((False,), "the dataset's rows are read whole"),
    "ignore_bias_buffers": ((False,), "fastgrpo's DDP wrapper broadcasts no buffers"),
    "datasets": (([],), "a mixture of datasets is not read: give dataset_name"),
    "streaming": ((False,), "the dataset's rows are read whole"),
    "test_split_size": ((None,), "no split of the training rows is held out: give eval_dataset"),
}

_DATASET_KEYS = ("dataset_name", "dataset_config", "dataset_train_split")
# the script's keys that hold text, read so from the command line too (``--dataset_config 1.0``)
_TEXT_KEYS = (*_DATASET_KEYS, "dataset_test_split", "model_name_or_path", "reward_model_name_or_path", "model_revision")
_TRUTH = {"true": True, "false": False, "y": True, "n": False, "1": True, "0": False}  # and YAML 1.1's words
_KEPT_TO_MERGE = ("dataset_test_split", "reward_model_name_or_path")  # read by `finish_script_options`


def read_script_options(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (one source's options by name: a file, or the command line) with TRL's script keys read as
    fastgrpo's options: ``model_name_or_path`` as ``model``; ``dataset_name`` (a local file or a hub id),
    ``dataset_config`` and ``dataset_train_split`` as ``dataset``'s ``name``, ``config`` and ``split``;
    `SCRIPT_AT_DEFAULT`'s keys dropped at the values that change nothing (read as the script reads them: ``no`` and
    ``0`` are false). ``dataset_test_split`` (``test`` where ``dataset_name`` is given) and
    ``reward_model_name_or_path`` stay for `finish_script_options`, once every source is merged. What would set one
    option twice in one source, or change the run otherwise, is refused, naming the key."""
    values = {k: _as_read(k, v) for k, v in values.items()}
    refused = [
        f"{key}: {SCRIPT_AT_DEFAULT[key][1]}"
        for key, value in values.items()
        if key in SCRIPT_AT_DEFAULT and not changes_nothing(value, SCRIPT_AT_DEFAULT[key][0])
    ]
    if refused:
        raise ValueError("\n".join(refused))
    out = {k: v for k, v in values.items() if k not in SCRIPT_AT_DEFAULT and k not in _DATASET_KEYS}
    if "model_name_or_path" in values:
        _one_option(values, "model_name_or_path", "model")
        out["model"] = out.pop("model_name_or_path")
    name = values.get("dataset_name")
    if name is not None:
        _one_option(values, "dataset_name", "dataset")
        config = {"config": values["dataset_config"]} if values.get("dataset_config") is not None else {}
        split = values.get("dataset_train_split", "train")
        out["dataset"] = {"name": name, **config, **({"split": split} if split != "train" else {})}
        out.setdefault("dataset_test_split", "test")
    elif any(values.get(key) is not None for key in _DATASET_KEYS[1:]):
        given = next(key for key in _DATASET_KEYS[1:] if values.get(key) is not None)
        raise ValueError(f"{given}: names a part of dataset_name's dataset, and no dataset_name is given")
    return out


def finish_script_options(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (every source merged, `read_script_options` read) with what the script sets from several keys:
    ``eval_dataset`` the ``dataset_test_split`` of ``dataset`` where ``eval_strategy`` is ``steps`` and no
    ``eval_dataset`` is given (as TRL's script passes it), and ``reward_model_name_or_path`` first among
    ``reward_funcs`` (only it where they are not given, as the script; its reward names are read by
    `fastgrpo.rewards.resolve_reward_funcs`)."""
    if not any(key in values for key in _KEPT_TO_MERGE):
        return values
    out = dict(values)
    split = out.pop("dataset_test_split", None)
    dataset = out.get("dataset")
    if split is not None and out.get("eval_strategy") == "steps" and "eval_dataset" not in out:
        if not isinstance(dataset, dict) or "name" not in dataset:
            raise ValueError("dataset_test_split: a split of dataset_name's dataset, and no dataset_name is given")
        config = {"config": dataset["config"]} if "config" in dataset else {}
        out["eval_dataset"] = {"name": dataset["name"], **config, "split": split}
    reward_model = out.pop("reward_model_name_or_path", None)
    if reward_model is not None:
        funcs = out.get("reward_funcs") or []
        out["reward_funcs"] = [reward_model, *([funcs] if isinstance(funcs, str) else funcs)]
    return out


def _as_read(key: str, value: Any) -> Any:
    """A script key's value as TRL's parser reads it: text keys as text, flags from ``no``, ``off``, ``0`` ..."""
    if key in _TEXT_KEYS and value is not None and not isinstance(value, str | dict | list):
        return str(value)
    accepted = SCRIPT_AT_DEFAULT.get(key, ((),))[0]
    if any(isinstance(ok, bool) for ok in accepted):
        if isinstance(value, str) and value.lower() in YAML11_BOOLEANS | _TRUTH:
            return (YAML11_BOOLEANS | _TRUTH)[value.lower()]
        if type(value) is int and value in (0, 1):
            return bool(value)
    return value


def _one_option(values: dict[str, Any], trl_key: str, key: str) -> None:
    if key in values:
        raise ValueError(f"{trl_key} and {key} set one option (TRL's script's key and fastgrpo's): give one of them")
