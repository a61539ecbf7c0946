"""Training configuration: TRL's GRPOConfig option names, loaded from YAML and command-line overrides.

Everything is validated before any model loads; an error names the option and what it accepts.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fastgrpo.data import DataConfig
from fastgrpo.distributed import DEVICES
from fastgrpo.fields import option
from fastgrpo.grpo.losses import LOSS_TYPES, SCALE_REWARDS
from fastgrpo.models import DTYPES, check_model_source
from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.spec.controller import ControllerLimits
from fastgrpo.spec.draft import DRAFT_CONFIG
from fastgrpo.spec.draft_trainer import LR_SCHEDULERS, DraftTrainConfig

REPORT_TO = ("jsonl", "tensorboard")


class YAMLLoader(yaml.SafeLoader):
    """YAML with the booleans of YAML 1.2: only true and false (any case). YAML 1.1 also reads on, off, yes and no
    as booleans, which would turn ``speculation.mode: off`` into False."""


YAML11_BOOLEANS = {"yes": True, "on": True, "no": False, "off": False}  # still read so for boolean options
YAMLLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


SPECULATION_MODES = ("off", "static", "paper", "adaptive")


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

    mode: str = option(
        "adaptive",
        help="`off` (plain decoding), `static` (one tree shape), `paper` (FastGRPO's rule from c_peak and the active "
        "rows) or `adaptive` (the tree of the highest predicted goodput at every step, plain steps when none pays)",
        choices=SPECULATION_MODES,
    )
    draft: str | None = option(None, help="a directory saved by `fastgrpo draft train` (None: a fresh draft)")
    draft_vocab_size: int | None = option(
        None,
        help="a fresh draft's reduced vocabulary: the most frequent tokens of the first rollout, which runs plain",
    )
    nodes: int = option(16, help="`static`: verified tokens per row, the root included (1: plain decoding)")
    top_k: int = option(4, help="`static`: children per expanded node")
    depth: int = option(5, help="`static`: tree levels")
    c_peak: int | str = option(
        "auto", help="verification capacity in tokens, or `auto`: the saved `fastgrpo profile` or a short calibration"
    )
    n_max: int = option(64, help="most verified tokens per row (`paper`, `adaptive`)")
    k_max: int = option(8, help="most children per node (`paper`, `adaptive`)")
    l_min: int = option(3, help="fewest tree levels (`paper`, `adaptive`)")
    l_max: int = option(5, help="most tree levels (`paper`, `adaptive`)")
    alpha: float = option(0.75, help="expected acceptance in the paper's depth rule")

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
        if self.draft is not None and not (Path(self.draft) / DRAFT_CONFIG).is_file():
            raise ValueError(
                f"speculation.draft: {self.draft} is not a directory saved by fastgrpo draft train (no {DRAFT_CONFIG})"
            )


@dataclass
class GRPOConfig:
    """All options of a training run. Names follow TRL's ``GRPOConfig`` wherever TRL has the same option.

    Each optimizer step samples ``per_device_train_batch_size * gradient_accumulation_steps`` completions,
    ``num_generations`` per prompt, and trains on them in ``gradient_accumulation_steps`` micro-batches.
    """

    # model
    model: str = option("smollm2", help="a local Hugging Face directory, a hub id, or `smollm2` (the embedded default)")
    dtype: str = option("float32", help="the policy's weights", choices=tuple(DTYPES))
    device: str = option("auto", help="`auto`: each process's GPU if there is one, else the CPU", choices=DEVICES)
    ddp_timeout: int = option(1800, help="seconds a collective waits for the other processes before the job fails")
    fsdp: bool = option(False, help="several processes: shard the policy with FSDP2 instead of replicating it (DDP)")
    # data and rewards
    dataset: DataConfig = option(default_factory=DataConfig, help="where the prompts come from (`dataset.*`)")
    reward_funcs: list[str] = option(
        default_factory=lambda: ["accuracy"],
        help="built-in names (`accuracy`, `gsm8k_strict`, `math_accuracy`, `format`) or `module:function`",
    )
    reward_weights: list[float] | None = option(None, help="one weight per reward function (None: all 1)")
    # generation
    num_generations: int = option(8, help="completions sampled per prompt (the group)")
    max_prompt_length: int = option(512, help="longer prompts keep their last tokens")
    max_completion_length: int = option(256, help="new tokens per completion at most")
    temperature: float = option(1.0, help="sampling temperature (0: greedy)")
    top_p: float = option(1.0, help="nucleus sampling mass")
    top_k: int = option(0, help="sample among the k most likely tokens (0: all)")
    min_p: float = option(0.0, help="drop tokens below this share of the most likely one's probability")
    stop: list[str] = option(default_factory=list, help="strings that end a completion")
    speculation: SpeculationConfig = option(
        default_factory=SpeculationConfig, help="speculative rollouts (`speculation.*`)"
    )
    draft_training: DraftTrainConfig = option(
        default_factory=DraftTrainConfig, help="online and offline draft learning (`draft_training.*`)"
    )
    # optimisation
    learning_rate: float = option(1e-6, help="AdamW learning rate of the policy")
    per_device_train_batch_size: int = option(8, help="completions per micro-batch on each process")
    gradient_accumulation_steps: int = option(
        2, help="micro-batches per optimizer step; a step samples this times per_device_train_batch_size completions"
    )
    max_steps: int = option(20, help="optimizer steps of the run")
    lr_scheduler_type: str = option("constant", help="transformers' learning-rate schedule", choices=LR_SCHEDULERS)
    warmup_ratio: float = option(0.0, help="share of the steps spent warming the learning rate up")
    weight_decay: float = option(0.0, help="AdamW weight decay")
    adam_beta1: float = option(0.9, help="AdamW beta1")
    adam_beta2: float = option(0.999, help="AdamW beta2")
    max_grad_norm: float = option(1.0, help="gradient clipping")
    bf16: bool = option(
        False, help="bfloat16 autocast for the policy update (fast on GPUs and CPUs with AMX or avx512_bf16 only)"
    )
    logprob_chunk_tokens: int = option(1024, help="completion tokens per chunk of the LM head in the policy update")
    # GRPO
    loss_type: str = option("dapo", help="how token losses are averaged, as in TRL", choices=LOSS_TYPES)
    scale_rewards: str = option(
        "group", help="divide advantages by the group's or the batch's reward std, or not", choices=SCALE_REWARDS
    )
    beta: float = option(0.0, help="KL coefficient (k3 estimator); > 0 loads a reference model")
    epsilon: float = option(0.2, help="lower clipping range of the ratio")
    epsilon_high: float | None = option(None, help="upper clipping range (None: epsilon)")
    num_iterations: int = option(1, help="policy updates per rollout")
    mask_truncated_completions: bool = option(False, help="train on no token of a completion cut by the length limit")
    # LoRA through peft
    use_peft: bool = option(False, help="train LoRA adapters instead of the whole policy")
    lora_r: int = option(16, help="LoRA rank")
    lora_alpha: int = option(32, help="LoRA scale numerator")
    lora_dropout: float = option(0.05, help="LoRA dropout")
    lora_target_modules: list[str] | None = option(None, help="modules to adapt (None: all linear layers)")
    # outputs
    output_dir: str = option("runs/default", help="config, metrics and checkpoints of the run")
    overwrite_output_dir: bool = option(
        False,
        help="start a new run in an output_dir that holds another one, deleting that run's metrics and checkpoints",
    )
    seed: int = option(42, help="seeds data order, sampling and initialisation")
    logging_steps: int = option(1, help="write metrics every this many steps")
    save_steps: int = option(10, help="write a checkpoint every this many steps (and at the last)")
    save_total_limit: int | None = option(2, help="keep this many checkpoints, removing the oldest (None: all)")
    save_only_model: bool = option(
        False,
        help="checkpoints hold the policy (and draft) only, not the optimizer state: a third of the disk, "
        "but --resume cannot continue from them",
    )
    report_to: list[str] = option(
        default_factory=lambda: ["jsonl"], help="`jsonl` (metrics.jsonl) and/or `tensorboard`"
    )
    log_completions: bool = option(True, help="print a few sample completions every log_completions_steps")
    num_completions_to_print: int = option(2, help="sample completions printed each time")
    log_completions_steps: int = option(5, help="steps between printed samples")
    progress_bar: bool = option(True, help="show a progress bar")

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
        _check_finite(self)
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
        if "tensorboard" in self.report_to and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("report_to: tensorboard needs the tensorboard package: pip install tensorboard")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must not be empty, got {self.stop!r}")
        if Path(self.output_dir).exists() and not Path(self.output_dir).is_dir():
            raise ValueError(f"output_dir {self.output_dir} is a file, not a directory")
        check_model_source(self.model)
        self.dataset.validate()
        self.speculation.validate()
        self.draft_training.validate()
        from fastgrpo.rewards import resolve_reward_funcs

        resolve_reward_funcs(self.reward_funcs)


def _check_finite(config: Any, prefix: str = "") -> None:
    """Raise ``ValueError`` naming the first float option (nested ones too) that is infinite or NaN."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            _check_finite(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{prefix}{f.name} must be a finite number, got {value}")


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
    if annotation is bool and isinstance(value, str) and value.lower() in YAML11_BOOLEANS:
        return YAML11_BOOLEANS[value.lower()]
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
        try:
            node[leaf] = yaml.load(raw, Loader=YAMLLoader) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ValueError(f"--{key}: {raw!r} is not a YAML value ({getattr(e, 'problem', e)})") from None
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
        try:
            values = yaml.load(path.read_text(), Loader=YAMLLoader) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ValueError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path} must hold a mapping of options")
    values = _merge(values, parse_overrides(overrides or []))
    config = _build(GRPOConfig, values)
    config.validate()
    return config


def config_to_dict(config: GRPOConfig) -> dict[str, Any]:
    """The options as plain data (what ``config.yaml`` holds); a reward function given as a callable is written as
    ``module:name``."""
    values = dataclasses.asdict(config)
    values["reward_funcs"] = [
        f if isinstance(f, str) else f"{getattr(f, '__module__', '?')}:{getattr(f, '__qualname__', type(f).__name__)}"
        for f in config.reward_funcs
    ]
    return values


def yaml_value(value: Any) -> str:
    """``value`` as one line of YAML (``null``, ``false``, ``[accuracy]``)."""
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def option_rows(cls: type = GRPOConfig, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """``(name, type, default, help)`` of every option in declaration order, nested ones dotted
    (``dataset.name``)."""
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            rows += option_rows(type(default), f"{prefix}{f.name}.")
            continue
        help_ = f.metadata["help"]
        if "choices" in f.metadata:
            help_ += " (" + ", ".join(f"`{c}`" for c in f.metadata["choices"]) + ")"
        rows.append((prefix + f.name, str(f.type), default, help_))
    return rows


def options_markdown() -> str:
    """The option reference, ``docs/options.md``: ``python -m fastgrpo.config > docs/options.md`` writes it."""
    lines = [
        "# Options",
        "",
        "Every option of `fastgrpo train` (and of `eval` and `draft train`, which read the same config), as a YAML key",
        "(nested ones as mappings: `dataset: {name: gsm8k}`) or on the command line (`--learning_rate 1e-5`,",
        "`--dataset.name gsm8k`); the command line wins. Names follow TRL's `GRPOConfig` where TRL has the option.",
        "This page is generated from `fastgrpo/config.py` by `python -m fastgrpo.config > docs/options.md`.",
        "",
        "| option | type | default | what it does |",
        "|---|---|---|---|",
    ]
    for name, type_, default, help_ in option_rows():
        lines.append(f"| `{name}` | `{type_.replace(' | ', ' or ')}` | `{yaml_value(default)}` | {help_} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(options_markdown(), end="")
