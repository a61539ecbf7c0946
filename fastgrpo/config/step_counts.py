"""How a training run counts, as TRL counts: `StepCounts`, a base class of `GRPOConfig`, turns its options into
completions per generation, optimizer steps per generation, the run's optimizer steps and the steps between
warmup, evaluations and saves.

A generation samples ``generation_batch_size`` completions on each process (``per_device_train_batch_size x
steps_per_generation``) and trains on them in ``num_iterations`` passes; each pass is ``steps_per_generation /
gradient_accumulation_steps`` optimizer steps (its windows), each on ``per_device_train_batch_size x
gradient_accumulation_steps`` completions of its own; with ``steps_per_generation`` below
``gradient_accumulation_steps`` an optimizer step trains on several generations. ``max_steps``, ``save_steps``,
``logging_steps`` and ``eval_steps`` count optimizer steps."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


class StepCounts:
    """The counts of `GRPOConfig` (whose fields these read)."""

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int | None
    num_generations: int
    num_iterations: int
    max_steps: int
    num_train_epochs: float
    warmup_steps: float
    warmup_ratio: float
    eval_steps: float | None
    logging_steps: int
    eval_strategy: str

    @property
    def micro_batches_per_generation(self) -> int:
        """``steps_per_generation`` as TRL reads it: micro-batches of ``per_device_train_batch_size`` completions a
        generation holds on each process (None: ``gradient_accumulation_steps``, one optimizer step's)."""
        return self.steps_per_generation or self.gradient_accumulation_steps

    @property
    def generation_batch_size(self) -> int:
        """Completions sampled together on each process: one generation."""
        return self.per_device_train_batch_size * self.micro_batches_per_generation

    @property
    def rows_at_once(self) -> int:
        """Completions a process's rollout decodes at once (``max_inflight_tasks``; -1: a whole generation's)."""
        rows = self.generation_batch_size
        return rows if self.max_inflight_tasks == -1 else min(rows, self.max_inflight_tasks)

    @property
    def rollout_rows(self) -> int:
        """Completions a process's rollouts decode at once at most: `rows_at_once`, or an evaluation's (whole groups)
        when more; its KV caches are made for them."""
        if not self.evaluates:
            return self.rows_at_once
        generations = self.num_generations_eval or self.num_generations
        return max(self.rows_at_once, generations * max(1, self.per_device_eval_batch_size // generations))

    @property
    def prompts_per_generation(self) -> int:
        return self.generation_batch_size // self.num_generations

    @property
    def generations_per_step(self) -> int:
        """Generations each optimizer step trains on: more than one where ``steps_per_generation`` is below
        ``gradient_accumulation_steps`` (each scored as a batch of its own, as TRL scores them)."""
        return max(self.gradient_accumulation_steps // self.micro_batches_per_generation, 1)

    @property
    def windows_per_generation(self) -> int:
        """The disjoint parts of a generation, each the completions of one optimizer step (1 where a step trains on
        one generation or more)."""
        return max(self.micro_batches_per_generation // self.gradient_accumulation_steps, 1)

    @property
    def steps_per_generation_pass(self) -> int:
        """Optimizer steps trained on each generation: its windows, ``num_iterations`` times over."""
        return self.windows_per_generation * self.num_iterations

    def first_generation(self, step: int) -> int:
        """The first generation (0-based) optimizer step ``step`` (0-based) trains on: the one made at the start of
        its pass, or the first of those it trains together."""
        return step // self.steps_per_generation_pass * self.generations_per_step

    def made_at(self, generation: int) -> int:
        """The optimizer step (0-based) generation ``generation`` (0-based) is made before and first trained at."""
        return generation // self.generations_per_step * self.steps_per_generation_pass

    def epoch(self, steps: int, generations_per_epoch: int) -> float:
        """TRL's ``epoch`` after ``steps`` optimizer steps: the micro-batches trained over those of an epoch
        (``generations_per_epoch`` generations, each trained ``num_iterations`` times)."""
        micro_batches = generations_per_epoch * self.num_iterations * self.micro_batches_per_generation
        return steps * self.gradient_accumulation_steps / micro_batches

    def with_total_steps(self, generations_per_epoch: int) -> Any:
        """This config with ``max_steps`` set where it is -1 (TRL's default): ``num_train_epochs`` epochs of
        ``generations_per_epoch`` generations (the dataset's rows over a generation's prompts of every process),
        counted and rounded up as transformers counts them; itself otherwise."""
        if self.max_steps > 0:
            return self
        micro_batches = generations_per_epoch * self.num_iterations * self.micro_batches_per_generation
        per_epoch = max(math.ceil(micro_batches / self.gradient_accumulation_steps), 1)
        return dataclasses.replace(self, max_steps=max(math.ceil(self.num_train_epochs * per_epoch), 1))

    def for_shares(self, shares: int) -> Any:
        """This config as a rollout process reads it that makes each generation for ``shares`` training processes, a
        share each (`fastgrpo.grpo.rollout_process`): one process of ``shares`` times their batch and queue."""
        if shares == 1:
            return self
        per_device, queue = self.per_device_train_batch_size * shares, self.queue_maxsize * shares
        return dataclasses.replace(self, per_device_train_batch_size=per_device, queue_maxsize=queue)

    @property
    def warmup_optimizer_steps(self) -> int:
        """Optimizer steps warming the learning rate up: ``warmup_steps`` as transformers reads it (a share of the
        optimizer steps when below 1), else ``warmup_ratio``'s share."""
        if self.warmup_steps:
            return int(self.warmup_steps) if self.warmup_steps >= 1 else math.ceil(self.max_steps * self.warmup_steps)
        return math.ceil(self.warmup_ratio * self.max_steps)  # transformers reads a ratio so (as warmup_steps < 1)

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates on ``eval_dataset`` (``eval_strategy: steps``)."""
        return self.eval_strategy == "steps"

    @property
    def eval_interval(self) -> int:
        """Optimizer steps between evaluations: ``eval_steps`` (a share of ``max_steps`` when below 1, rounded up), or
        ``logging_steps``, as transformers reads them."""
        if self.eval_steps is None:
            return self.logging_steps
        if self.eval_steps < 1:
            return max(1, math.ceil(self.max_steps * self.eval_steps))
        return int(self.eval_steps)

    def evaluates_at(self, step: int) -> bool:
        """Whether the run evaluates after optimizer step ``step`` (1-based): every `eval_interval` steps and after
        the last step, as transformers' ``eval_strategy: steps``."""
        return self.evaluates and (step % self.eval_interval == 0 or step == self.max_steps)

    def check_counts(self) -> None:
        """Refuse counts that do not make whole generations and windows, naming the options."""
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(f"max_steps must be a positive number of optimizer steps, or -1, got {self.max_steps}")
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            raise ValueError(f"num_train_epochs must be above 0 with max_steps -1, got {self.num_train_epochs}")
        micro, accumulated = self.micro_batches_per_generation, self.gradient_accumulation_steps
        if max(micro, accumulated) % min(micro, accumulated):
            raise ValueError(
                f"steps_per_generation ({micro}) must be a multiple or a divisor of gradient_accumulation_steps "
                f"({accumulated}): each optimizer step trains on whole generations or on a part of one"
            )
        if micro < accumulated and self.num_iterations > 1:
            raise ValueError(
                f"num_iterations ({self.num_iterations}) with steps_per_generation ({micro}) below "
                f"gradient_accumulation_steps ({accumulated}), which trains several generations in one optimizer "
                "step, is not implemented: raise steps_per_generation to gradient_accumulation_steps or a multiple"
            )
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"per_device_train_batch_size * steps_per_generation ({self.generation_batch_size}; "
                f"steps_per_generation defaults to gradient_accumulation_steps) must be a multiple of "
                f"num_generations ({self.num_generations})"
            )
