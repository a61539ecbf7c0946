"""TRL's `GRPOTrainer` constructor for fastgrpo's trainer: ``GRPOTrainer(model=..., reward_funcs=...,
args=GRPOConfig(...), train_dataset=..., ...)`` as TRL 1.16 takes it, turned into fastgrpo's own arguments (a config,
the loaded model and tokenizer where given, the dataset's rows) before anything loads."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback, TrainerState

from fastgrpo import distributed
from fastgrpo.config import GRPOConfig
from fastgrpo.data import DataConfig
from fastgrpo.data.prompts import prompt_problem
from fastgrpo.data.records import ConversationalRow
from fastgrpo.grpo.checkpoint import latest_checkpoint
from fastgrpo.grpo.run_dir import CHECKPOINT_RE
from fastgrpo.report import read_metrics

# TRL's arguments whose work fastgrpo's trainer does otherwise: refused when given, with what to use instead.
NOT_TAKEN = {
    "optimizers": "the optimizer comes from the config (optim, learning_rate, adam_*, weight_decay, lr_scheduler_type)",
    "rollout_func": "fastgrpo's own engine generates; its rollout_func is for TRL's trainer "
    "(fastgrpo.integrations.trl.SpeculativeRollout)",
    "reward_processing_classes": "a reward model is scored with the tokenizer saved in its directory",
}
LORA_FIELDS = {"r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}
# peft settings fastgrpo's LoRA has only at these values (peft's defaults).
LORA_DEFAULTS = {
    "bias": "none",
    "use_dora": False,
    "use_rslora": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "init_lora_weights": True,
    "exclude_modules": None,
    "layers_to_transform": None,
}


class TrlRow(ConversationalRow):
    """A dataset row handed to TRL's form, read by TRL's conventions: its prompt as given (a string encoded as it is,
    messages through the chat template), and where the prompt is messages (a conversational row), each completion
    handed to the reward functions as TRL hands it: ``[{"role": "assistant", "content": text}]``."""


def reward_completion(row: dict[str, Any], text: str) -> str | list[dict[str, str]]:
    """``text``, a completion of ``row``, as the reward functions get it: a message list for a row whose prompt was
    given as messages (`ConversationalRow`, `TrlRow`), else the text (fastgrpo's own rows, whose prompts it builds as
    messages from text, get text)."""
    if isinstance(row, ConversationalRow) and isinstance(row["prompt"], list):
        return [{"role": "assistant", "content": text}]
    return text


class FastgrpoArguments(NamedTuple):
    """What fastgrpo's trainer takes: the config, a loaded policy and tokenizer (None: loaded from ``config.model``),
    the training and evaluation rows (None: read from ``config.dataset`` and ``config.eval_dataset``), and TRL's
    ``callbacks`` (`fastgrpo.grpo.trl_callbacks`)."""

    config: GRPOConfig
    model: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase | None
    dataset: list[dict[str, Any]] | None
    eval_dataset: list[dict[str, Any]] | None
    callbacks: list[Any]


def trl_call(
    config: Any, model: Any, tokenizer: Any, dataset: Any, resume: Any, eval_dataset: Any, keywords: dict[str, Any]
) -> FastgrpoArguments:
    """`from_trl` of a `fastgrpo.grpo.trainer.GRPOTrainer` call in TRL's form: its first four parameters hold TRL's
    ``model, reward_funcs, args, train_dataset`` when given by position (the model where the config goes), TRL's
    ``model=`` keyword lands in ``model``, ``eval_dataset=`` in ``eval_dataset``, the other keywords in ``keywords``.
    A fifth argument by position (``resume`` there, TRL's ``eval_dataset``) is refused: TRL's later arguments go by
    keyword."""
    if not isinstance(resume, bool):
        raise TypeError("GRPOTrainer in TRL's form: give eval_dataset and the arguments after it by keyword")
    if config is None:
        if tokenizer is not None or dataset is not None:
            raise TypeError("GRPOTrainer(model=...) in TRL's form takes processing_class= and train_dataset=")
        given = {"model": model}
    else:
        names = ("model", "reward_funcs", "args", "train_dataset")
        given = dict(zip(names, (config, model, tokenizer, dataset), strict=True))
    for name, value in {**given, "eval_dataset": eval_dataset}.items():
        if value is not None:
            if name in keywords:
                raise TypeError(f"GRPOTrainer() got multiple values for argument {name!r}")
            keywords[name] = value
    return from_trl(**keywords)


def from_trl(
    model: str | PreTrainedModel,
    reward_funcs: Any,
    args: GRPOConfig | None = None,
    train_dataset: Iterable[dict[str, Any]] | None = None,
    eval_dataset: Iterable[dict[str, Any]] | None = None,
    processing_class: PreTrainedTokenizerBase | None = None,
    peft_config: Any = None,
    tools: list[Callable[..., Any]] | None = None,
    environment_factory: Callable[[], Any] | None = None,
    callbacks: list[Any] | None = None,
    **not_taken: Any,
) -> FastgrpoArguments:
    """fastgrpo's trainer arguments from TRL's: ``model`` an id, a path or a `PreTrainedModel`; ``reward_funcs`` one
    or a list (callables, names, reward-model paths or models); ``args`` fastgrpo's `GRPOConfig` (copied, not changed;
    None: the defaults); ``train_dataset``/``eval_dataset`` a `datasets.Dataset`, an ``IterableDataset`` (read
    whole) or rows, each with a ``prompt`` column (a string, encoded as it is, or chat messages, through the chat
    template) and the columns the reward functions take; ``processing_class`` the tokenizer; ``peft_config`` a peft
    `LoraConfig`; ``tools``, ``environment_factory`` and ``callbacks`` (transformers' ``TrainerCallback`` instances or
    classes) as TRL takes them."""
    for name, value in not_taken.items():
        if name not in NOT_TAKEN:
            raise TypeError(f"GRPOTrainer() got an unexpected keyword argument {name!r}")
        if value not in (None, (None, None), []):
            raise ValueError(f"{name}: not taken by fastgrpo's GRPOTrainer: {NOT_TAKEN[name]}")
    if args is not None and not isinstance(args, GRPOConfig):
        kind = f"{type(args).__module__}.{type(args).__qualname__}"
        raise TypeError(f"args: got a {kind}; give fastgrpo's GRPOConfig (from fastgrpo import GRPOConfig)")
    config = dataclasses.replace(args) if args is not None else GRPOConfig()
    loaded = None
    if isinstance(model, PreTrainedModel):
        if not model.name_or_path and processing_class is None:
            raise ValueError(
                "model: a model built in memory has no directory to read a tokenizer from: give processing_class"
            )
        loaded = model
        config.model = model.name_or_path or config.model
    elif isinstance(model, str) and model.strip():
        config.model = model
    else:
        raise TypeError(f"model: a model id, a directory or a PreTrainedModel, got {type(model).__name__}")
    config.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if tools is not None:
        config.tools = list(tools)
    if environment_factory is not None:
        config.environment_factory = environment_factory
    if peft_config is not None:
        apply_lora(config, peft_config)
    rows = None if train_dataset is None else dataset_rows(train_dataset, "train_dataset")
    eval_rows = None
    if eval_dataset is not None and config.evaluates:  # as TRL: evaluated during training with eval_strategy steps
        eval_rows = dataset_rows(eval_dataset, "eval_dataset")
        config.eval_dataset = config.eval_dataset or DataConfig(name="eval_dataset")  # rows given: nothing is read
    for index, callback in enumerate(callbacks or []):
        kind = callback if isinstance(callback, type) else type(callback)
        if not issubclass(kind, TrainerCallback):
            raise TypeError(f"callbacks[{index}]: a transformers TrainerCallback (or its class), got {kind.__name__}")
    return FastgrpoArguments(config, loaded, processing_class, rows, eval_rows, list(callbacks or []))


def apply_lora(config: GRPOConfig, peft_config: Any) -> None:
    """``config``'s LoRA options from a peft `LoraConfig` (rank, alpha, dropout, target modules); a setting fastgrpo's
    LoRA does not have (any of `LORA_DEFAULTS` away from peft's default, or no target modules) is refused, named."""
    if type(peft_config).__name__ != "LoraConfig":
        raise ValueError(f"peft_config: a peft LoraConfig, got {type(peft_config).__name__}")
    for field, default in LORA_DEFAULTS.items():
        if getattr(peft_config, field, default) != default:
            value = getattr(peft_config, field)
            raise ValueError(f"peft_config.{field}={value!r}: fastgrpo's LoRA takes {default!r} only")
    config.use_peft = True
    for field, option in LORA_FIELDS.items():
        setattr(config, option, getattr(peft_config, field))
    targets = peft_config.target_modules
    if targets is None:  # peft then picks per model type; fastgrpo's None is every linear layer
        raise ValueError(
            "peft_config.target_modules is None (peft's choice per model type): name the modules, or 'all-linear'"
        )
    all_linear = targets == "all-linear"
    # peft keeps a list as a set: sorted, so that the config (and the saved config.yaml) does not depend on hashing
    config.lora_target_modules = None if all_linear else ([targets] if isinstance(targets, str) else sorted(targets))


def dataset_rows(dataset: Iterable[dict[str, Any]], option: str) -> list[dict[str, Any]]:
    """The rows of ``dataset`` as dicts, each with a usable ``prompt`` (checked here, naming the row)."""
    if isinstance(dataset, (str, bytes)) or not isinstance(dataset, Iterable):
        raise TypeError(f"{option}: a datasets.Dataset or a list of rows, got {type(dataset).__name__}")
    rows = []
    for index, row in enumerate(dataset):
        if not isinstance(row, dict):
            raise ValueError(f"{option} row {index}: expected a dict of columns, got {type(row).__name__}")
        if "prompt" not in row:
            raise ValueError(f"{option} row {index}: no 'prompt' column (columns: {', '.join(row) or 'none'})")
        problem = prompt_problem(row["prompt"])
        if problem is not None:
            raise ValueError(f"{option} row {index}: prompt {problem}")
        rows.append(TrlRow(row))
    if not rows:
        raise ValueError(f"{option} has no rows")
    return rows


def train_summary(history: list[dict[str, Any]], seconds: float, completions_per_step: int) -> dict[str, Any] | None:
    """The record TRL's ``train()`` ends ``log_history`` with, of the steps of ``history`` run in ``seconds``:
    ``train_runtime``, ``train_samples_per_second`` (completions), ``train_steps_per_second``, ``total_flos`` (0, as
    TRL's GRPO logs it), ``train_loss`` (the mean step loss), ``epoch`` and ``step`` (None for no step)."""
    if not history:
        return None
    steps, seconds = len(history), max(seconds, 1e-9)
    return {  # rounded as TRL rounds them
        "train_runtime": round(seconds, 4),
        "train_samples_per_second": round(steps * completions_per_step / seconds, 3),
        "train_steps_per_second": round(steps / seconds, 3),
        "total_flos": 0.0,
        "train_loss": sum(m["loss"] for m in history) / steps,
        "epoch": history[-1]["epoch"],
        "step": history[-1]["step"],
    }


class TrlTrainerMethods:
    """TRL's `Trainer` attributes a GRPO script reads, on fastgrpo's trainer: `state` (read from the run's
    ``metrics.jsonl``, so a resumed run's history is whole, and ended as TRL's by the last `train` call's
    `train_summary`), `save_model`, and what ``train(resume_from_checkpoint=...)`` resumes with."""

    summary: dict[str, Any] | None = None  # `train_summary` of the last `train` call
    events: Any  # the trainer's `fastgrpo.grpo.trl_callbacks.TrlCallbacks`
    given: FastgrpoArguments  # what the trainer was built from
    trl_form: bool  # whether it was called in TRL's form
    resumed_from: Path | None  # the checkpoint it resumed from
    _build: Callable[..., None]  # the trainer's: builds it from `given`
    lock: Any  # the output directory's `DirectoryLock` (rank 0's)
    tools: Any  # the run's tools (None: none)
    config: GRPOConfig
    output_dir: Path
    dist: Any  # the trainer's `fastgrpo.distributed.DistInfo`
    update: Any  # its `PolicyUpdate`
    write_policy: Callable[[Path, dict[str, Any] | None], None]  # the trainer's: the policy and its tokenizer

    @property
    def state(self) -> TrainerState:
        """transformers' `TrainerState` as TRL's ``trainer.state`` holds it after ``train()``: ``log_history``, one
        dict of metrics per logged step (``logging_steps``, and every evaluation), each with its ``step``, then the
        last ``train()``'s `train_summary`; ``global_step``, ``epoch``, ``max_steps``."""
        path = self.output_dir / "metrics.jsonl"
        history = read_metrics(self.output_dir) if path.is_file() and path.stat().st_size else []
        last = history[-1] if history else {"step": 0, "epoch": 0.0}
        logged = history + ([self.summary] if self.summary is not None else [])
        return TrainerState(
            epoch=last.get("epoch", 0.0),
            global_step=int(last["step"]),
            max_steps=self.config.max_steps,
            log_history=logged,
        )

    def resume_checkpoint(self, resume_from_checkpoint: bool | str | Path) -> Path:
        """The checkpoint ``train(resume_from_checkpoint=...)`` continues from (resolved): the newest of the run in
        ``output_dir``, which a path given must name (fastgrpo continues a run from its newest checkpoint, with its
        optimizer, schedule, drafters and random state)."""
        latest = latest_checkpoint(self.output_dir)
        if latest is None:
            raise FileNotFoundError(f"resume_from_checkpoint: no checkpoint of the run in output_dir {self.output_dir}")
        asked = resume_from_checkpoint
        if asked is not True and (not isinstance(asked, str | Path) or Path(asked).resolve() != latest.resolve()):
            raise ValueError(
                f"resume_from_checkpoint: {asked!r} is not True nor the newest checkpoint of the run in output_dir "
                f"{self.output_dir} ({latest}): fastgrpo continues a run from its newest checkpoint"
            )
        return latest.resolve()

    def _rebuild_resumed(self, latest: Path) -> None:
        """Build this trainer again from what it was given, resuming the run in ``output_dir`` from its newest
        checkpoint ``latest`` (`resume_checkpoint`); its callbacks and its output directory's lock stay. Refused
        before anything is undone where the run has no step left or a model given in memory was wrapped in place
        (LoRA, FSDP2)."""
        given, events, lock, trl_form = self.given, self.events, self.lock, self.trl_form
        step = int(CHECKPOINT_RE.match(latest.name).group(1))  # type: ignore[union-attr]
        if step >= self.config.max_steps:
            raise ValueError(
                f"resume_from_checkpoint: the run in output_dir {self.output_dir} has trained its max_steps "
                f"({step}): raise max_steps to train on"
            )
        if given.model is not None and (self.config.use_peft or self.config.fsdp):
            raise ValueError(
                "resume_from_checkpoint: the model given in memory was wrapped in place (LoRA or FSDP2) and cannot be "
                "built again: give the model by its id or directory"
            )
        if self.update is not None and self.update.masters is not None:
            self.update.masters.close()  # its gradient hooks are on the parameters of a model given in memory
        if self.tools is not None:
            self.tools.close()
        events.unbind()
        vars(self).clear()  # the model, caches and optimizer state go before the checkpoint's load
        self.trl_form = trl_form
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            self._build(given, True, events, lock)
        except (ValueError, FileNotFoundError) as e:
            if lock is not None:
                lock.release()
            raise type(e)(str(e).replace("--resume", "resume_from_checkpoint")) from e
        except BaseException:
            if lock is not None:
                lock.release()
            raise

    def add_callback(self, callback: Any) -> None:
        """Add a ``TrainerCallback`` (an instance, or a class to make one of), as TRL's ``Trainer`` does."""
        self.events.handler.add_callback(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove a callback (an instance, or the first of a class) and return it."""
        return self.events.handler.pop_callback(callback)

    def remove_callback(self, callback: Any) -> None:
        """Remove a callback (an instance, or the first of a class)."""
        self.events.handler.remove_callback(callback)

    def save_model(self, output_dir: str | Path | None = None) -> None:
        """Write the policy (its full weights under FSDP2; the adapter with LoRA) and tokenizer to ``output_dir``
        (default: the run's ``output_dir``) in transformers' format, as TRL's ``save_model``; every training process
        takes part (a rollout process writes nothing)."""
        if self.dist.rollout:  # a rollout process holds weights rank 0 sent: nothing of its own to write
            return
        path = Path(output_dir) if output_dir is not None else self.output_dir
        weights, _, _ = self.update.full_state()
        if self.dist.is_main:
            self.write_policy(path, weights)
        distributed.barrier()
