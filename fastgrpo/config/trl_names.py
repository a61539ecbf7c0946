"""TRL's names in fastgrpo's options: `TRL_ALIASES`, TRL's names of options fastgrpo names otherwise (taken by
`GRPOConfig`'s constructor and attributes, YAML and the command line), and `TRL_REFUSED`, TRL's options fastgrpo lacks:
accepted where their value changes nothing, refused otherwise with what fastgrpo does instead (`trl_refusal`)."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from fastgrpo.config.training_arguments import AT_DEFAULT, IGNORED, READ

logger = logging.getLogger(__name__)

# TRL's names of options that fastgrpo names otherwise: read from YAML, the command line and the constructor
TRL_ALIASES: dict[str, str] = {
    "vllm_importance_sampling_correction": "importance_sampling_correction",
    "vllm_importance_sampling_mode": "importance_sampling_mode",
    "vllm_importance_sampling_clip_min": "importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max": "importance_sampling_clip_max",
}


def _alias_property(name: str) -> property:
    def get(self: Any) -> Any:
        return getattr(self, name)

    def set_(self: Any, value: Any) -> None:
        setattr(self, name, value)

    return property(get, set_, doc=f"TRL's name of `{name}`.")


def _accept_aliases(init: Any) -> Any:
    """``GRPOConfig(vllm_importance_sampling_correction=True)`` as ``importance_sampling_correction=True``, and TRL's
    and ``TrainingArguments``' other options as `read_trl_options` reads them."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for alias, name in TRL_ALIASES.items():
            if alias in kwargs:
                if name in kwargs:
                    raise TypeError(f"{alias} and {name} are one option: give one of them")
                kwargs[name] = kwargs.pop(alias)
        defaults = {f.name: f.default for f in dataclasses.fields(type(self))}
        init(self, *args, **read_trl_options(kwargs, defaults))

    __init__.__doc__ = init.__doc__
    return __init__


def accept_trl_names(cls: type) -> None:
    """Let ``cls`` (`GRPOConfig`) take `TRL_ALIASES` as constructor arguments, and read and set them as attributes."""
    cls.__init__ = _accept_aliases(cls.__init__)  # type: ignore[method-assign]
    for alias, name in TRL_ALIASES.items():
        setattr(cls, alias, _alias_property(name))


_VLLM = (
    "a vLLM option: fastgrpo samples with its own lossless speculative engine on the policy's weights (speculation.*)"
)
_ENGINE = "fastgrpo samples with its own batched engine (speculation.*), not transformers' generate"
_SAMPLING = (
    "it changes the sampling distribution, which fastgrpo's speculative rollouts verify drafts against (temperature, "
    "top_p, top_k, min_p only): a penalty that follows each tree path is not implemented, so it is refused rather "
    "than made lossy"
)
_REF_SYNC = "the reference model stays the initial policy (TR-DPO's syncing is not implemented)"
_LOGS = "fastgrpo prints sample completions (log_completions) and writes metrics.jsonl and TensorBoard (report_to)"

# TRL's vLLM options: accepted at any value, with one line saying that fastgrpo's own engine generates.
VLLM_OPTIONS = (
    "use_vllm",
    "vllm_mode",
    "vllm_model_impl",
    "vllm_enable_sleep_mode",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_group_port",
    "vllm_gpu_memory_utilization",
    "vllm_max_model_length",
    "vllm_tensor_parallel_size",
)

# TRL 1.16 GRPOConfig options fastgrpo does not have: (the values that change nothing, and are accepted and ignored;
# why any other is refused, and what fastgrpo does instead).
TRL_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "vllm_structured_outputs_regex": ((None,), _SAMPLING),
    "use_transformers_continuous_batching": ((False,), _ENGINE),
    "transformers_continuous_batching_config": ((None, {}), _ENGINE),
    "use_transformers_paged": ((False,), _ENGINE),
    "cache_implementation": ((None,), _ENGINE),
    "repetition_penalty": ((1.0, 1), _SAMPLING),
    "generation_kwargs": ((None, {}), _SAMPLING),
    "sync_ref_model": ((False,), _REF_SYNC),
    "ref_model_mixup_alpha": ((), _REF_SYNC),
    "ref_model_sync_steps": ((), _REF_SYNC),
    "model_init_kwargs": (
        (None, {}),
        "fastgrpo loads the model itself from `model` (a directory, a hub id or smollm2) with `dtype`",
    ),
    "trust_remote_code": ((False,), "fastgrpo runs only transformers' own model code"),
    "router_aux_loss_coef": ((None,), "a mixture-of-experts load-balancing loss is not added"),
    "ds3_gather_for_generation": ((True,), "DeepSpeed is not used: fsdp: true shards the policy with FSDP2"),
    "pad_to_multiple_of": ((None, "auto"), "fastgrpo's rollouts and update pad to shapes of their own"),
    "log_multimodal": ((True, False), _LOGS),
    "log_unique_prompts": ((False,), _LOGS),
    "log_completions_hub_repo": ((None,), _LOGS),
    **AT_DEFAULT,
}


def changes_nothing(value: Any, accepted: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of the ``accepted`` values of an option fastgrpo lacks (of the same type: 0 is not
    False)."""
    return any(value == ok and type(value) is type(ok) for ok in accepted)


def trl_refusal(key: str, value: Any) -> str | None:
    """None when ``key`` is one of TRL's options that fastgrpo lacks and ``value`` changes nothing (it is ignored);
    the one line that refuses it otherwise (None too for a key TRL does not have)."""
    if key not in TRL_REFUSED:
        return None
    accepted, reason = TRL_REFUSED[key]
    if changes_nothing(value, accepted):
        return None
    return f"{key}: {reason}"


def steps_per_generation(generation_batch_size: Any, per_device: int) -> int:
    """TRL's ``generation_batch_size`` (the completions of one generation over every process of the job:
    ``WORLD_SIZE`` of them under torchrun) as ``steps_per_generation``, micro-batches of ``per_device``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not isinstance(generation_batch_size, int) or generation_batch_size % (per_device * world):
        raise ValueError(
            f"generation_batch_size ({generation_batch_size!r}) must be a multiple of per_device_train_batch_size x "
            f"processes ({per_device} x {world})"
        )
    return generation_batch_size // (per_device * world)


def read_trl_options(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``values`` (one source's options by name: a file, the command line or the constructor's keywords; its TRL
    aliases already renamed) as fastgrpo's options: ``TrainingArguments`` fields fastgrpo reads under its own names
    read so (`READ`), TRL's ``generation_batch_size`` (every process's completions of a generation) as
    ``steps_per_generation``, TRL's vLLM options dropped with one line logged (fastgrpo's own engine generates; the
    correction still applies to its sampler), the fields nothing reads dropped (`IGNORED`), and TRL's options
    fastgrpo lacks dropped where their value changes nothing (`trl_refusal`) and refused otherwise, every one at
    once, one line each. ``defaults``: the options' defaults."""
    out: dict[str, Any] = {}
    refused, vllm = [], []
    for key, value in values.items():
        if key in READ:
            for name, read in READ[key](value).items():
                if name != key and name in values:
                    raise ValueError(f"{key} and {name} set one option: give one of them")
                out[name] = read
        elif key == "generation_batch_size":
            if value is not None:
                if values.get("steps_per_generation") is not None:
                    raise ValueError("generation_batch_size and steps_per_generation set one option: give one of them")
                per_device = values.get("per_device_train_batch_size", defaults["per_device_train_batch_size"])
                out["steps_per_generation"] = steps_per_generation(value, per_device)
        elif key in VLLM_OPTIONS:
            vllm.append(key)
        elif key in TRL_REFUSED:
            line = trl_refusal(key, value)
            if line is not None:
                refused.append(line)
        elif key not in IGNORED:
            out[key] = value
    if refused:
        raise ValueError("\n".join(refused))
    if vllm:
        logger.warning(
            "%s: fastgrpo samples with its own lossless speculative engine on the policy's weights (speculation.*), "
            "not vLLM; the importance-sampling correction, where set, applies to its sampler",
            ", ".join(vllm),
        )
    return out
