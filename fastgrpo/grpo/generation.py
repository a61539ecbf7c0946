"""One generation of a training run: its completions sampled, scored and made a training batch, with the log-probs
the update reads before it, and cut into the windows its optimizer steps train on (`fastgrpo.config.step_counts`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from fastgrpo import distributed
from fastgrpo.config import GRPOConfig
from fastgrpo.device_memory import peak_memory_mb, peak_reserved_mb, reset_peak_memory, synchronized
from fastgrpo.grpo.batch import (
    RolloutBatch,
    build_batch,
    completion_lengths,
    completion_metrics,
    concat_batches,
    mask_tool_results,
    select_rows,
)
from fastgrpo.grpo.policy_update import PolicyUpdate
from fastgrpo.grpo.prompts import StepPrompts
from fastgrpo.grpo.scoring import score_completions
from fastgrpo.grpo.tool_use import RunTools, ToolTurns
from fastgrpo.grpo.update_metrics import sampling_metrics
from fastgrpo.rollout.sequence import GenerationOutput
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.training_rollouts import TrainingRollouts


class Generating(Protocol):
    """What a generation reads of the trainer (`fastgrpo.grpo.trainer.GRPOTrainer`)."""

    config: GRPOConfig
    device: torch.device
    dist: distributed.DistInfo
    prompts: StepPrompts
    model: torch.nn.Module
    update: PolicyUpdate | None
    rollouts: TrainingRollouts
    reward_funcs: list[Any]
    tokenizer: PreTrainedTokenizerBase
    sampling: SamplingParams
    tools: RunTools | None
    start_step: int  # the optimizer steps done when the run began or resumed
    generations_dropped: int  # by an asynchronous run, before those its next step trains on (when it resumed)

    def rollout(
        self, step: int, rows: list[dict[str, Any]]
    ) -> tuple[list[list[int]], GenerationOutput, ToolTurns | None]: ...


@dataclass
class Generation:
    """A generation's training batch (``N`` rows, this process's), ``windows``: ``[N / windows]`` row indices of
    each optimizer step's part, ``num_items_in_batch``: the completion tokens of every process over the windows (what
    dapo, cispo and vespo divide a step's loss by, as TRL), ``metrics``: what the generation logs (rewards, lengths,
    rollout and time), ``samples``: the completions shown in the log."""

    batch: RolloutBatch
    windows: list[torch.Tensor]
    num_items_in_batch: float
    metrics: dict[str, float]
    samples: list[tuple[Any, str, float, dict[str, Any]]]

    def window(self, index: int) -> RolloutBatch:
        """The rows optimizer step ``index`` of a pass trains on, in the window's order (its micro-batches are
        consecutive rows of it, `fastgrpo.grpo.micro_batch_stats`)."""
        return select_rows(self.batch, self.windows[index])


def windows(rows: int, count: int, seed: int, generation: int, rank: int) -> list[torch.Tensor]:
    """``count`` disjoint windows of ``rows`` rows, as TRL shuffles a generation before slicing it: a random order of
    the rows, seeded by the run's ``seed``, the ``generation`` and the process's ``rank`` (the same after a resume),
    cut into equal parts."""
    generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + generation * 1_009 + rank)
    order = torch.randperm(rows, generator=generator, device="cpu")
    return list(order.chunk(count))


@dataclass
class Produced:
    """A generation sampled and scored, before the update reads its log-probs (`prepare`): made by `produce`, on this
    process or on a rollout process (`fastgrpo.grpo.pipeline`), which sends it whole, or a share to each training
    process, with ``lengths``, each row's completion tokens, ``versions``, per row the weight version of its tokens as
    ``(first position, version)`` runs, and ``oldest``."""

    generation: int
    batch: RolloutBatch
    metrics: dict[str, float]
    samples: list[tuple[Any, str, float, dict[str, Any]]]
    lengths: list[int] | None = None
    versions: list[list[tuple[int, int]]] | None = None
    oldest: int = 0  # the weight version of the generation's oldest token (of every share)


def generate(trainer: Generating, generation: int, step: int) -> Generation:
    """Generation ``generation`` (0-based) of ``trainer``'s run, made before optimizer step ``step`` (0-based):
    `produce` then `prepare`."""
    return prepare(trainer, produce(trainer, generation, step))


def produce(trainer: Generating, generation: int, step: int) -> Produced:
    """Generation ``generation``'s completions (`GRPOTrainer.rollout`), then `scored` (``step``: the optimizer step it
    is made before, which the reward functions are told)."""
    rows = trainer.prompts.rows(generation)
    t0 = time.perf_counter()
    reset_peak_memory(trainer.device)
    # FSDP2 gathers the full parameters for the rollout and the draft update (which reads the LM head); a rollout
    # process holds them whole (it trains nothing: no update).
    with distributed.gathered(trainer.update.policy if trainer.update is not None else trainer.model):
        prompt_ids, out, turns = trainer.rollout(generation, rows)
        return scored(trainer, generation, step, rows, prompt_ids, out, turns, time.perf_counter() - t0)


def scored(
    trainer: Generating,
    generation: int,
    step: int,
    rows: list[dict[str, Any]],
    prompt_ids: list[list[int]],
    out: GenerationOutput,
    turns: ToolTurns | None,
    rollout_seconds: float,
) -> Produced:
    """The completions ``out`` of generation ``generation`` (of the dataset ``rows``, sampled in ``rollout_seconds``)
    made a `Produced`: their rewards and advantages, the drafters' online update and the batch."""
    cfg, device = trainer.config, trainer.device
    t1 = time.perf_counter()
    advantages, reward_metrics, samples = score_completions(
        cfg, trainer.reward_funcs, trainer.tokenizer, trainer.dist.rank, rows, out, step, turns
    )
    t2 = time.perf_counter()
    draft_metrics = trainer.rollouts.learn()
    t_learnt = synchronized(device)
    memory: dict[str, float] = {}
    if device.type == "cuda":  # captured states go back to the allocator for the update (the KV caches stay)
        memory["memory/rollout_peak_mb"] = peak_memory_mb(device)
        memory["memory/rollout_peak_reserved_mb"] = peak_reserved_mb(device)
        out.hidden_states = None
        trainer.rollouts.release()
        reset_peak_memory(device)
    prompts_per_row = [p for p in prompt_ids for _ in range(len(out.completion_ids) // len(prompt_ids))]
    batch = build_batch(prompts_per_row, out.completion_ids, trainer.tokenizer.pad_token_id, advantages, out.logprobs)
    truncated = torch.tensor([r == "length" for r in out.finish_reasons], device="cpu")
    if out.tool_masks is not None:  # tool results: no loss, KL or token metric, as TRL's tool_mask
        mask_tool_results(batch, out.tool_masks)
    if cfg.mask_truncated_completions:
        batch.completion_mask[truncated] = 0
    lengths = torch.tensor(completion_lengths(out.completion_ids, out.tool_masks), dtype=torch.float, device="cpu")
    metrics = {
        **reward_metrics,
        **completion_metrics(lengths, truncated, sum(map(len, prompts_per_row))),
        **draft_metrics,
        **{"time/rollout": rollout_seconds, "time/drafting": out.stats.draft_time, "time/reward": t2 - t1},
        "time/draft_learning": t_learnt - t2,
        **out.stats.metrics(),
        **(turns.metrics() if turns is not None else {}),
        **memory,
    }
    return Produced(generation, batch, metrics, samples)


def prepare(trainer: Generating, produced: Produced) -> Generation:
    """``produced`` made a `Generation`: the log-probs the update reads before it (`PolicyUpdate.fixed_logps`) and
    its windows."""
    cfg, batch = trainer.config, produced.batch
    t_policy = time.perf_counter()
    trainer.update.fixed_logps(batch)
    metrics = {**produced.metrics, "time/logprobs": synchronized(trainer.device) - t_policy}
    if cfg.steps_per_generation_pass > 1:
        metrics |= sampling_metrics(cfg, batch, batch.old_logps)
    count = cfg.windows_per_generation
    tokens = distributed.sum_over_ranks(int(batch.completion_mask.sum())) / count
    rows = batch.completion_mask.shape[0]
    parts = windows(rows, count, cfg.seed, produced.generation, trainer.dist.rank)
    return Generation(batch, parts, tokens, metrics, produced.samples)


def merge(generations: list[Generation], pad_id: int, seed: int, generation: int, rank: int) -> Generation:
    """Generations one optimizer step trains on together (``steps_per_generation`` below
    ``gradient_accumulation_steps``; ``generation``: the first's index): their rows in one window, shuffled as
    `windows` shuffles one, their tokens summed; their metrics averaged as TRL averages a step's logged values, but
    tokens, seconds and compilations, which add up, and memory peaks, the largest."""
    batch = concat_batches([g.batch for g in generations], pad_id)
    metrics: dict[str, float] = {}
    for key in dict.fromkeys(k for g in generations for k in g.metrics):  # a drafter's figures may be in some only
        values = [g.metrics[key] for g in generations if key in g.metrics]
        if key.endswith("terminated_length"):  # NaN where none ended: the job's reduction decides (`reduce_metrics`)
            values = [v for v in values if not math.isnan(v)] or [math.nan]
        if key in ("num_tokens", "spec/time_saved") or key.startswith(("time/", "compile/")):
            metrics[key] = sum(values)
        elif key.startswith("async/") and key.endswith(("_seconds", "_samples", "/max")):  # totals, largest
            metrics[key] = max(values) if key.endswith("/max") else sum(values)
        elif key.startswith("memory/"):
            metrics[key] = max(values)
        else:
            metrics[key] = sum(values) / len(values)
    rows = windows(batch.completion_mask.shape[0], 1, seed, generation, rank)  # ``generation``: the first's
    tokens = sum(g.num_items_in_batch for g in generations)
    return Generation(batch, rows, tokens, metrics, [s for g in generations for s in g.samples])
