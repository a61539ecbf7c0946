"""Training configuration: TRL's GRPOConfig option names, loaded from YAML and command-line overrides.

Everything is validated before any model loads; an error names the option and what it accepts.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fastgrpo.data import DataConfig
from fastgrpo.distributed import DEVICES
from fastgrpo.grpo.losses import LOSS_TYPES, SCALE_REWARDS
from fastgrpo.models import DTYPES
from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.spec.controller import ControllerLimits
from fastgrpo.spec.draft_trainer import LR_SCHEDULERS, DraftTrainConfig

REPORT_TO = ("jsonl", "tensorboard")


SPECULATION_MODES = ("off", "static", "paper", "adaptive")


def _choice(*choices: Any) -> dict[str, Any]:
    return {"choices": choices}


@dataclass
class SpeculationConfig:
    """Speculative rollouts (lossless: they change how fast completions come, not what they are).

    ``mode``: ``off``; ``static`` (trees of a fixed shape: ``nodes`` verified tokens per row, the root included,
    ``top_k`` children per expanded node, ``depth`` levels; ``nodes: 1`` is plain decoding); ``paper`` (FastGRPO's
    rule: ``nodes = c_peak // active rows``, clamped by ``n_max``, ``k_max``, ``l_min``, ``l_max`` and ``alpha``);
    ``adaptive`` (the tree of the highest predicted goodput at every step, plain steps when no tree pays).
    ``c_peak``: the verification capacity in tokens, or ``auto`` to read this model's saved ``fastgrpo profile``
    (a short calibration of a few forwards when there is none). ``draft``: a directory saved by ``fastgrpo draft
    train`` (None: a fresh, untrained draft). ``draft_vocab_size``: a fresh draft gets a reduced vocabulary, the at
    most this many most frequent tokens of the first rollout's completions (that rollout runs plain, as a random
    draft could not speed it up), so that drafting and online draft learning do not pay for the full LM head."""

    mode: str = field(default="adaptive", metadata=_choice(*SPECULATION_MODES))
    draft: str | None = None
    draft_vocab_size: int | None = None
    nodes: int = 16
    top_k: int = 4
    depth: int = 5
    c_peak: int | str = "auto"
    n_max: int = 64
    k_max: int = 8
    l_min: int = 3
    l_max: int = 5
    alpha: float = 0.75

    def limits(self) -> ControllerLimits:
        """The constants of the paper's rule (and the adaptive controller's bounds)."""
        return ControllerLimits(self.n_max, self.k_max, self.l_min, self.l_max, self.alpha)

    def validate(self) -> None:
        if self.mode not in SPECULATION_MODES:
            raise ValueError(f"speculation.mode must be one of {list(SPECULATION_MODES)}, got {self.mode!r}")
        for name in ("nodes", "top_k", "depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"speculation.{name} must be >= 1, got {getattr(self, name)}")
        self.limits().validate("speculation.")
        if self.c_peak != "auto" and not (isinstance(self.c_peak, int) and self.c_peak >= 1):
            raise ValueError(f"speculation.c_peak must be 'auto' or an integer >= 1, got {self.c_peak!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 2:
            raise ValueError(f"speculation.draft_vocab_size must be >= 2, got {self.draft_vocab_size}")
        if self.draft_vocab_size is not None and self.draft is not None:
            raise ValueError(
                "speculation.draft_vocab_size applies to a fresh draft; the saved draft in speculation.draft "
                f"({self.draft}) keeps its own vocabulary"
            )
        if self.draft is not None and not Path(self.draft).is_dir():
            raise ValueError(f"speculation.draft: {self.draft} is not a directory with a saved draft")


@dataclass
class GRPOConfig:
    """All options of a training run. Names follow TRL's ``GRPOConfig`` wherever TRL has the same option.

    Each optimizer step samples ``per_device_train_batch_size * gradient_accumulation_steps`` completions,
    ``num_generations`` per prompt, and trains on them in ``gradient_accumulation_steps`` micro-batches.
    """

    # model
    model: str = "smollm2"
    dtype: str = field(default="float32", metadata=_choice(*DTYPES))
    # where it runs: `auto` is each process's GPU if there is one, else the CPU (several processes: torchrun)
    device: str = field(default="auto", metadata=_choice(*DEVICES))
    ddp_timeout: int = 1800  # seconds a collective waits for the other ranks before the job fails
    fsdp: bool = False  # several processes: shard the policy with FSDP2 instead of replicating it with DDP
    # data and rewards
    dataset: DataConfig = field(default_factory=DataConfig)
    reward_funcs: list[str] = field(default_factory=lambda: ["accuracy"])
    reward_weights: list[float] | None = None
    # generation
    num_generations: int = 8
    max_prompt_length: int = 512
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    draft_training: DraftTrainConfig = field(default_factory=DraftTrainConfig)
    # optimisation
    learning_rate: float = 1e-6
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 2
    max_steps: int = 20
    lr_scheduler_type: str = field(default="constant", metadata=_choice(*LR_SCHEDULERS))
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    max_grad_norm: float = 1.0
    bf16: bool = False  # autocast the training forward/backward to bfloat16 (weights stay in `dtype`)
    logprob_chunk_tokens: int = 1024
    # GRPO
    loss_type: str = field(default="dapo", metadata=_choice(*LOSS_TYPES))
    scale_rewards: str = field(default="group", metadata=_choice(*SCALE_REWARDS))
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    num_iterations: int = 1
    mask_truncated_completions: bool = False
    # LoRA through peft
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | None = None
    # outputs
    output_dir: str = "runs/default"
    seed: int = 42
    logging_steps: int = 1
    save_steps: int = 10
    save_total_limit: int | None = 2
    report_to: list[str] = field(default_factory=lambda: ["jsonl"])
    log_completions: bool = True
    num_completions_to_print: int = 2
    log_completions_steps: int = 5
    progress_bar: bool = True

    @property
    def generation_batch_size(self) -> int:
        """Completions per optimizer step."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def prompts_per_step(self) -> int:
        return self.generation_batch_size // self.num_generations

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop=tuple(self.stop),
        )

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option."""
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {list(choices)}, got {getattr(self, f.name)!r}")
        positive = (
            "num_generations max_prompt_length max_completion_length per_device_train_batch_size "
            "gradient_accumulation_steps max_steps num_iterations logging_steps save_steps logprob_chunk_tokens "
            "ddp_timeout"
        )
        for name in positive.split():
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (GRPO compares samples), got {self.num_generations}")
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"per_device_train_batch_size * gradient_accumulation_steps ({self.generation_batch_size}) must "
                f"be a multiple of num_generations ({self.num_generations})"
            )
        checks = [
            ("learning_rate", self.learning_rate > 0, "> 0"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= 0, ">= 0 (0 disables it)"),
            ("min_p", 0 <= self.min_p < 1, "in [0, 1)"),
            ("beta", self.beta >= 0, ">= 0"),
            ("epsilon", self.epsilon > 0, "> 0"),
            ("epsilon_high", self.epsilon_high is None or self.epsilon_high > 0, "> 0"),
            ("warmup_ratio", 0 <= self.warmup_ratio <= 1, "in [0, 1]"),
            ("max_grad_norm", self.max_grad_norm > 0, "> 0"),
            ("save_total_limit", self.save_total_limit is None or self.save_total_limit >= 1, ">= 1"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")
        if self.fsdp and self.use_peft:
            raise ValueError("fsdp: sharding a LoRA policy is not supported; LoRA adapters are small, use DDP")
        if not self.reward_funcs:
            raise ValueError("reward_funcs must name at least one reward function")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} entries but reward_funcs has {len(self.reward_funcs)}"
            )
        for target in self.report_to:
            if target not in REPORT_TO:
                raise ValueError(f"report_to entries must be among {list(REPORT_TO)}, got {target!r}")
        self.dataset.validate()
        self.speculation.validate()
        self.draft_training.validate()
        from fastgrpo.rewards import resolve_reward_funcs

        resolve_reward_funcs(self.reward_funcs)


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a field's type annotation, converting where YAML is loose (int for float)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(name, value, arg)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0])
    if origin is list:
        if isinstance(value, str | int | float):
            value = [value]
        if not isinstance(value, list):
            raise ValueError(f"{name} must be a list, got {value!r}")
        return [_coerce(f"{name}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-5 (no decimal point) as a string
            return float(value)
        except ValueError:
            pass
    if annotation in (int, float, str, bool) and not (
        isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    ):
        raise ValueError(f"{name} must be of type {annotation.__name__}, got {value!r}")
    return value


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a dict, refusing unknown keys and ill-typed values."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ValueError(f"unknown option {prefix}{key}{hint}")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ValueError(f"{prefix}{key} must be a mapping of options, got {value!r}")
            kwargs[key] = _build(hints[key], value, prefix=f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(prefix + key, value, hints[key])
    return cls(**kwargs)


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``--a.b value`` / ``--a.b=value`` pairs into a nested dict; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"expected an option like --learning_rate 1e-5, got {arg!r}")
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ValueError(f"option {arg} needs a value")
            key, raw = arg[2:], args[i + 1]
            i += 2
        node = out
        *parents, leaf = key.replace("-", "_").split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw) if raw != "" else ""
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in extra.items():
        merged[k] = _merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> GRPOConfig:
    """Read a YAML config (optional), apply ``--option value`` overrides, build and validate."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path} must hold a mapping of options")
    values = _merge(values, parse_overrides(overrides or []))
    config = _build(GRPOConfig, values)
    config.validate()
    return config


def config_to_dict(config: GRPOConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)
