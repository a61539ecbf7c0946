"""Speculative rollouts and online draft learning inside TRL's ``GRPOTrainer``.

Two objects are added to an existing TRL script::

    from fastgrpo.integrations.trl import DraftCallback, SpeculativeRollout

    rollout = SpeculativeRollout()                      # or SpeculativeRollout(draft="drafts/my-draft")
    trainer = GRPOTrainer(..., rollout_func=rollout, callbacks=[DraftCallback(rollout)])

`SpeculativeRollout` is TRL's ``rollout_func``: it runs fastgrpo's lossless speculative engine (with its concurrency
controller and drafters) on the trainer's current model and captures the target hidden states of every rollout.
`DraftCallback` has the drafters learn from them after each optimizer step (the policy is not touched: the draft's
loss reaches none of its weights), saves the drafters into every TRL checkpoint (``checkpoint-N/draft``, as
fastgrpo's own trainer does) and restores them when TRL resumes.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import torch
from packaging.version import Version

from fastgrpo.config import DraftTrainConfig, SpeculationConfig
from fastgrpo.models import encode_prompts, eos_token_ids
from fastgrpo.rollout.compiled import compile_backend
from fastgrpo.rollout.drafter import Drafter
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.sequence import GenerationOutput
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.registry import check_draft_training, check_speculation
from fastgrpo.training_rollouts import TrainingRollouts

TESTED_TRL = (Version("1.14.0"), Version("1.17.0"))  # the rollout_func hook as of these versions: [low, high)


def check_trl_version() -> None:
    """Raise ImportError unless the installed TRL is one this integration was tested with."""
    try:
        import trl
    except ImportError as e:
        raise ImportError("fastgrpo.integrations.trl needs TRL: pip install 'fastgrpo[trl]'") from e
    low, high = TESTED_TRL
    if not low <= Version(trl.__version__) < high:
        raise ImportError(
            f"fastgrpo.integrations.trl is tested with trl>={low},<{high} (its experimental rollout_func hook), "
            f"found trl {trl.__version__}: pip install 'trl>={low},<{high}'"
        )


check_trl_version()

from transformers import TrainerCallback  # noqa: E402  (after the version check, which names the fix)


def _groups(prompts: list[Any]) -> int:
    """How many times each prompt is repeated in a row (TRL passes every prompt ``num_generations`` times)."""
    run = 1
    while run < len(prompts) and prompts[run] == prompts[0]:
        run += 1
    if len(prompts) % run or any(prompts[i] != prompts[i - i % run] for i in range(len(prompts))):
        return 1
    return run


class SpeculativeRollout:
    """TRL ``rollout_func``: ``(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs"}``.

    Args:
        draft: a saved draft directory (``fastgrpo draft train``, or a checkpoint's ``draft`` directory, of this
            integration or of fastgrpo's trainer, whose drafters' whole state it restores; default
            ``speculation.draft``), or None for a fresh draft that online learning trains from scratch (over the full
            vocabulary, or with ``speculation.draft_vocab_size`` over the most frequent tokens of the first rollout).
        speculation: the controller (default: the adaptive one, with a short calibration when this model has
            no saved profile).
        draft_training: online draft-learning options (`DraftCallback` runs them; ``online=False`` freezes the
            draft).
        max_prompt_length: keep the last this many prompt tokens (None: whole prompts).
        compile: run the decoding step compiled by ``torch.compile``: ``auto`` (on a GPU only), ``on`` or ``off``.
    """

    def __init__(
        self,
        draft: str | Path | None = None,
        speculation: SpeculationConfig | None = None,
        draft_training: DraftTrainConfig | None = None,
        max_prompt_length: int | None = None,
        compile: str = "auto",
    ):
        compile_backend(compile, torch.device("cpu"))  # checks the choice before any work
        self.compile = compile
        self.speculation = speculation or SpeculationConfig()
        if draft is not None:  # the saved draft given here stands for speculation.draft, and is checked as it is
            self.speculation = dataclasses.replace(self.speculation, draft=str(draft))
        self.speculation.validate()
        check_speculation(self.speculation)
        if self.speculation.mode == "off":
            raise ValueError("SpeculativeRollout: speculation.mode 'off' leaves nothing to do; use TRL's generation")
        self.draft_training = draft_training or DraftTrainConfig()
        self.draft_training.validate()
        check_draft_training(self.speculation, self.draft_training)
        self.max_prompt_length = max_prompt_length or sys.maxsize
        self.rollouts: TrainingRollouts | None = None  # built on the first call, on the trainer's model
        self.trainer: Any = None
        self.resume_from: Path | None = None  # a TRL checkpoint whose draft replaces `draft` (set by DraftCallback)

    @property
    def engine(self) -> RolloutEngine | None:
        """The rollout engine (None before the first rollout)."""
        return None if self.rollouts is None else self.rollouts.engine

    def drafter(self, name: str) -> Drafter | None:
        """The drafter called ``name`` (None before the first rollout, and while it waits to be built, as a fresh
        EAGLE head with ``draft_vocab_size`` until the first rollout ended)."""
        return None if self.rollouts is None else self.rollouts.drafter(name)

    # -- TRL's hook -----------------------------------------------------------------------------------------
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        self.trainer = trainer
        rollouts = self._rollouts(trainer)
        n = _groups(prompts)
        prompt_ids = encode_prompts(trainer.processing_class, prompts[::n], self.max_prompt_length)
        accelerator = trainer.accelerator
        out = rollouts.generate(
            prompt_ids,
            self._sampling_params(trainer),
            n,
            trainer.state.global_step,
            accelerator.process_index,
            accelerator.num_processes,
        )
        self._log(trainer, out)
        # the KV caches stay for the next rollout (`TrainingRollouts.reserve`); the captured hidden states stay until
        # the draft learns from them after the optimizer step (DraftCallback.on_step_end)
        return {
            "prompt_ids": [p for p in prompt_ids for _ in range(n)],
            "completion_ids": out.completion_ids,
            "logprobs": out.logprobs,
        }

    def _rollouts(self, trainer: Any) -> TrainingRollouts:
        """Built on the first call, on the trainer's model (unwrapped from DDP; the same module TRL trains), from the
        saved draft given (or a fresh one), then restored from the checkpoint TRL resumes from."""
        if self.rollouts is not None:
            return self.rollouts
        self._check_supported(trainer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        self.rollouts = TrainingRollouts(
            model,
            trainer.processing_class,
            eos_token_ids(model, trainer.processing_class),
            self.speculation,
            self.draft_training,
            model.config.name_or_path or model.config.model_type,
            trainer.args.seed,
            compile_backend(self.compile, next(model.parameters()).device),
            self.speculation.draft,
        )
        if self.resume_from is not None:
            self.rollouts.restore(self.resume_from)
        args = trainer.args
        rows = args.per_device_train_batch_size * args.steps_per_generation
        prompt = self.max_prompt_length if self.max_prompt_length < sys.maxsize else 0  # 0: sized by the prompts met
        self.rollouts.reserve(rows, prompt, args.max_completion_length)
        return self.rollouts

    @staticmethod
    def _check_supported(trainer: Any) -> None:
        args = trainer.args
        unsupported = {
            "repetition_penalty": args.repetition_penalty != 1.0,
            "generation_kwargs": bool(args.generation_kwargs),
            "chat_template_kwargs": bool(getattr(args, "chat_template_kwargs", None)),
            "use_vllm": args.use_vllm,
        }
        if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None) is not None:
            raise ValueError(
                "SpeculativeRollout does not serve tools or environment_factory: TRL runs its own tool loop after "
                "rollout_func, re-feeding every conversation to its own generate; fastgrpo's GRPOTrainer runs them "
                "in its engine (the tools and environment_factory options)"
            )
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise ValueError(f"SpeculativeRollout does not support these GRPOConfig/GRPOTrainer options: {bad}")

    @staticmethod
    def _sampling_params(trainer: Any) -> SamplingParams:
        args = trainer.args
        return SamplingParams(
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k or 0,
            min_p=args.min_p or 0.0,
        )

    @staticmethod
    def _log(trainer: Any, out: GenerationOutput) -> None:
        """Add the rollout's figures to the metrics TRL logs at its next logging step (a rollout of plain steps only
        has no tree acceptance to average in)."""
        metrics = trainer._metrics["train"]
        for key, value in out.stats.metrics().items():
            if not math.isnan(value):
                metrics[key].append(value)

    # -- online draft learning --------------------------------------------------------------------------------
    def update_draft(self) -> dict[str, float]:
        """The drafters learn from the rollouts since the last update (`TrainingRollouts.learn`); returns their
        metrics."""
        return {} if self.rollouts is None else self.rollouts.learn()

    def save_draft(self, checkpoint: Path) -> None:
        """Write the drafters' state into ``checkpoint/draft`` (`TrainingRollouts.save`)."""
        if self.rollouts is not None:
            self.rollouts.save(checkpoint)


class DraftCallback(TrainerCallback):
    """Runs `SpeculativeRollout.update_draft` after every optimizer step, saves the drafters into each checkpoint
    (``checkpoint-N/draft``) and restores them when training resumes from a checkpoint."""

    def __init__(self, rollout: SpeculativeRollout):
        self.rollout = rollout

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step > 0:  # TRL restored its state from checkpoint-{global_step}: take that draft too
            self.rollout.resume_from = Path(args.output_dir) / f"checkpoint-{state.global_step}"

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        metrics = self.rollout.update_draft()
        if metrics and self.rollout.trainer is not None:
            for key, value in metrics.items():
                self.rollout.trainer._metrics["train"][key].append(value)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.rollout.save_draft(Path(args.output_dir) / f"checkpoint-{state.global_step}")
