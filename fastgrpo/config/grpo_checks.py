"""The checks of a training run's options: `GRPOChecks`, a base class of `GRPOConfig` (which holds the options),
refuses bad values and combinations (`validate`) and options set where the others leave them without effect
(`check_given`), each naming the option and what it accepts, before any model loads."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

from fastgrpo.fields import check_numbers, check_ranges
from fastgrpo.models import check_model_source

REPORT_TO = ("jsonl", "tensorboard")
# the options of one loss type only
LOSS_OPTIONS = {
    "sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
    "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
}


class GRPOChecks:
    """`validate` and `check_given` of `GRPOConfig`, over the options it holds."""

    def check_given(self, given: dict[str, Any]) -> None:
        """Refuse an option the user set (a key of ``given``) that the other options leave without effect, rather
        than ignore it: the importance-sampling correction's options with the correction off, ``delta`` with a loss
        that does not clip (cispo, sapo, vespo), sapo's and vespo's options with another loss, the tools' options
        without tools."""
        unused = []
        if not self.importance_sampling_correction:
            unused += [
                (key, "importance_sampling_correction is false (no correction is applied)")
                for key in ("importance_sampling_mode", "importance_sampling_clip_min", "importance_sampling_clip_max")
            ]
        if self.loss_type in ("cispo", "sapo", "vespo"):
            unused.append(("delta", f"loss_type {self.loss_type} (which does not clip the ratio)"))
        for loss, keys in LOSS_OPTIONS.items():
            if self.loss_type != loss:
                unused += [(key, f"loss_type {self.loss_type}") for key in keys]
        if not self.tools and not self.environment_factory:
            unused += [
                (key, "no tools and no environment_factory (nothing is called)")
                for key in ("max_tool_calling_iterations", "tool_timeout", "tool_workers", "strict_tool_calls")
            ]
        if not self.use_adaptive_entropy:
            unused += [
                (key, "use_adaptive_entropy false (entropy_coef is a fixed bonus)")
                for key in ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")
            ]
        if not self.rollout_processes:
            unused += [
                (key, "rollout_processes 0 (every process generates, then trains: nothing is asynchronous)")
                for key in ("max_staleness", "weight_sync_steps", "queue_maxsize", "heartbeat_stale_after_s")
            ]
        for key, why in unused:
            if given.get(key) is not None:
                raise ValueError(f"{key} has no effect with {why}: remove it")

    def _check_mask_range(self) -> None:
        """Refuse a masking correction whose range leaves out a ratio of 1: the ratio of a completion the policy
        sampled itself (the rollout engine samples with the policy's weights), so every completion would be masked
        and the update would train nothing."""
        if not self.importance_sampling_correction or not self.importance_sampling_mode.endswith("_mask"):
            return
        low, high = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        for name, value, outside in (
            ("clip_min", low, low is not None and low > 1),
            ("clip_max", high, high is not None and high < 1),
        ):
            if outside:
                raise ValueError(
                    f"importance_sampling_{name} {value} leaves out a ratio of 1, the ratio of every completion the "
                    f"policy samples itself: importance_sampling_mode {self.importance_sampling_mode} would mask them "
                    "all and train nothing; keep 1 inside [clip_min, clip_max]"
                )

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option."""
        if self.eval_strategy == "epoch":
            raise ValueError(
                "eval_strategy: epoch is not supported: fastgrpo counts optimizer steps, not epochs; use "
                "eval_strategy: steps with eval_steps"
            )
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {list(choices)}, got {getattr(self, f.name)!r}")
        check_numbers(self)
        check_ranges(self)
        if not self.output_dir.strip():
            raise ValueError("output_dir must name a directory, got an empty string")
        self.check_counts()
        self._check_mask_range()
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(
                f"entropy_coef_min ({self.entropy_coef_min}) must not be above entropy_coef_max "
                f"({self.entropy_coef_max})"
            )
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("warmup_steps and warmup_ratio both set the warmup: give one of them")
        sequence_weights = not self.importance_sampling_mode.startswith("token")
        if self.loss_type == "vespo" and self.importance_sampling_correction and sequence_weights:
            raise ValueError(
                f"importance_sampling_mode {self.importance_sampling_mode}: loss_type vespo takes the correction's "
                "token weights into its sequence weight; use token_truncate or token_mask (as TRL requires)"
            )
        if self.loss_type == "cispo" and self.epsilon_high is None:
            raise ValueError(
                "epsilon_high: loss_type cispo caps each token's weight at epsilon_high, which would default to "
                f"epsilon ({self.epsilon}); set it (ScaleRL uses 5.0)"
            )
        high_clip = 1 + (self.epsilon if self.epsilon_high is None else self.epsilon_high)
        if self.delta is not None and self.delta <= high_clip:
            raise ValueError(f"delta ({self.delta}) must be above 1 + epsilon_high ({high_clip:g}), or None")
        low, high = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError(
                f"importance_sampling_clip_min ({low}) must be below importance_sampling_clip_max ({high})"
            )
        if self.importance_sampling_mode.endswith("truncate") and low is None and high is None:
            raise ValueError(
                f"importance_sampling_mode {self.importance_sampling_mode} clamps the ratio: set "
                "importance_sampling_clip_min or importance_sampling_clip_max"
            )
        if self.max_inflight_tasks == 0:
            raise ValueError("max_inflight_tasks must be at least 1 completion decoding at once, or -1 (no bound)")
        self._check_asynchronous()
        if self.fsdp and self.use_peft:
            raise ValueError("fsdp: sharding a LoRA policy is not supported; LoRA adapters are small, use DDP")
        self._validate_eval()
        if not self.reward_funcs and not self.environment_factory:
            raise ValueError(
                "reward_funcs must name at least one reward function (or environment_factory an environment with "
                "get_reward)"
            )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} entries but reward_funcs has {len(self.reward_funcs)}"
            )
        for target in self.report_to:
            if target not in REPORT_TO:
                raise ValueError(f"report_to entries must be among {list(REPORT_TO)}, got {target!r}")
        if "tensorboard" in self.report_to and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("report_to: tensorboard needs the tensorboard package: pip install tensorboard")
        owned = {
            "add_generation_prompt": "fastgrpo adds the generation prompt to every prompt",
            "tokenize": "fastgrpo tokenizes the rendered prompts itself",
            "return_dict": "fastgrpo reads the rendered prompts' tokens itself",
            "tools": "give tools in the tools option, which also calls them",
            "conversation": "the conversation is each dataset row's prompt",
        }
        for key in sorted(set(self.chat_template_kwargs or {}) & owned.keys()):
            raise ValueError(f"chat_template_kwargs: {key} is fastgrpo's to set ({owned[key]}): remove it")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must not be empty, got {self.stop!r}")
        if Path(self.output_dir).exists() and not Path(self.output_dir).is_dir():
            raise ValueError(f"output_dir {self.output_dir} is a file, not a directory")
        if Path(self.output_dir).is_symlink() and not Path(self.output_dir).exists():
            target = os.readlink(self.output_dir)
            raise ValueError(
                f"output_dir {self.output_dir} is a link to {target}, which does not exist: create {target} first, "
                "or choose another output_dir"
            )
        if self.overwrite_output_dir:
            self._check_inputs_outside_output_dir()
        check_model_source(self.model)
        self.dataset.validate()
        if self.eval_dataset is not None:
            try:
                self.eval_dataset.validate()
            except ValueError as e:
                raise ValueError(f"eval_{e}") from None
        self.speculation.validate()
        self.draft_training.validate()
        from fastgrpo.rewards import resolve_reward_funcs

        resolve_reward_funcs(self.reward_funcs)

    def _check_asynchronous(self) -> None:
        """Rollout processes: weights sent often enough for the staleness bound, and a queue that holds an optimizer
        step's generations."""
        if not self.rollout_processes:
            return
        if self.weight_sync_steps > self.max_staleness + 1:
            raise ValueError(
                f"weight_sync_steps ({self.weight_sync_steps}) must be at most max_staleness + 1 "
                f"({self.max_staleness + 1}): the rollout processes would wait for weights rank 0 sends later"
            )
        step = self.generation_batch_size * self.generations_per_step
        if self.queue_maxsize < step:
            raise ValueError(
                f"queue_maxsize ({self.queue_maxsize}) must hold the {step} completions of the generations an "
                "optimizer step trains on"
            )

    def _check_inputs_outside_output_dir(self) -> None:
        """With ``overwrite_output_dir``, refuse a model, draft or dataset file inside ``output_dir`` (directly or
        through a link): overwriting deletes the run there, a checkpoint of it included."""
        out = Path(os.path.realpath(self.output_dir))
        inputs = {"model": self.model, "speculation.draft": self.speculation.draft, "dataset.name": self.dataset.name}
        for name, given in {**inputs, "dataset.path": self.dataset.path}.items():
            if given is None or not os.path.exists(given):
                continue
            if Path(os.path.realpath(given)).is_relative_to(out):
                raise ValueError(
                    f"overwrite_output_dir: {name} {given} is inside output_dir {self.output_dir}, whose run "
                    "overwriting deletes; copy it elsewhere first, or choose another output_dir"
                )

    def _validate_eval(self) -> None:
        if self.eval_steps is not None and self.eval_steps > 1 and self.eval_steps != int(self.eval_steps):
            raise ValueError(
                f"eval_steps must be an integer when above 1 (below 1: a share of max_steps), got {self.eval_steps}"
            )
        if self.evaluates and self.eval_dataset is None:
            raise ValueError(
                "eval_strategy: steps evaluates on eval_dataset, which is not set: give eval_dataset (a mapping of "
                "dataset.* options, e.g. {name: arithmetic, split: test}) or eval_strategy: no"
            )
        if self.eval_dataset is not None and not self.evaluates:
            raise ValueError(
                "eval_dataset is set but eval_strategy is no: set eval_strategy: steps (and eval_steps) to evaluate on "
                "it during training, or remove eval_dataset"
            )
