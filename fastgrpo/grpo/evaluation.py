"""In-training evaluation, as TRL's ``eval_strategy: steps``: every ``eval_steps`` optimizer steps (and after the
last), ``num_generations_eval`` completions of each ``eval_dataset`` prompt, sampled as training samples (its
temperature, top_p, ...) by the trainer's own rollout engine and scored by its reward functions; their metrics go
under ``eval/``.

The evaluation leaves the training as it would be without it: its sampling noise comes from generators of its own
(seeded by the run's seed, the step and the prompt's row, so that the completions depend neither on the number of
processes nor on the batching), and the engine decodes the eval prompts without drafting, so that the drafters'
memory (the suffix drafter's), their online learning and the controller's estimates see the training's rollouts
only."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from fastgrpo import distributed
from fastgrpo.config import GRPOConfig
from fastgrpo.data import load_dataset
from fastgrpo.grpo.advantages import compute_advantages
from fastgrpo.grpo.batch import completion_lengths
from fastgrpo.grpo.scoring import reward_inputs, reward_weights
from fastgrpo.grpo.tool_use import check_tool_rows, rollout_prompts
from fastgrpo.reward_calls import RewardLog, TrainerState, reward_name
from fastgrpo.rewards import check_columns, function_metrics, reward_matrix
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.sampling_params import SamplingParams


class Trainer(Protocol):
    """What `evaluate` reads of a `fastgrpo.grpo.trainer.GRPOTrainer`."""

    config: GRPOConfig
    eval_rows: list[dict[str, Any]]
    dist: Any  # its processes (`fastgrpo.distributed`)
    sampling: SamplingParams
    rollouts: Any  # `fastgrpo.training_rollouts.TrainingRollouts`
    update: Any  # `fastgrpo.grpo.policy_update.PolicyUpdate`
    prompts: Any  # `fastgrpo.grpo.prompts.StepPrompts`
    tokenizer: Any
    reward_funcs: list[Any]
    tools: Any  # `fastgrpo.grpo.tool_use.RunTools` or None


PREFIX = "eval/"


def eval_uniforms(seed: int, step: int, index: int, rows: int, width: int) -> torch.Tensor:
    """``[rows, width]`` float64 uniforms that sample the completions of eval row ``index`` at step ``step``, from a
    generator of their own (never the training's: `fastgrpo.training_rollouts.step_uniforms`)."""
    digest = hashlib.sha256(f"fastgrpo eval {seed} {step} {index}".encode()).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.rand((rows, width), generator=generator, dtype=torch.float64, device="cpu")


@contextmanager
def without_drafting(engine: RolloutEngine) -> Iterator[None]:
    """The engine decodes plainly inside the block, and drafts afterwards as before with the same drafters and
    controller (their state untouched) and the shapes it had settled."""
    drafters, controller, settled = list(engine.drafters.values()), engine.controller, engine.settled
    engine.speculate(None)
    try:
        yield
    finally:
        engine.speculate(drafters or None, controller=controller)
        engine.settled = settled


def evaluation_rows(
    config: GRPOConfig,
    reward_funcs: list[Any],
    tools: bool,
    environments: Any,
    rows: list[dict[str, Any]] | None,
    world_size: int,
) -> list[dict[str, Any]]:
    """The rows the run evaluates on, none unless ``config.evaluates``: ``rows`` where given, else those of
    ``config.eval_dataset``, checked as the training rows are (the reward functions' columns, the tools' prompts)."""
    if not config.evaluates:
        return []
    check_eval_batch(config, world_size)
    rows = rows if rows is not None else load_dataset(config.eval_dataset)
    try:
        check_columns(reward_funcs, rows)
    except ValueError as e:
        raise ValueError(f"eval_dataset: {e}") from None
    check_tool_rows(tools, environments, rows, "eval_dataset")
    return rows


def check_eval_batch(config: Any, world_size: int) -> None:
    """TRL's condition on the eval batch: ``per_device_eval_batch_size`` x the processes whole groups of
    ``num_generations_eval``."""
    generations = config.num_generations_eval or config.num_generations
    source = "" if config.num_generations_eval else ", from num_generations"
    if (config.per_device_eval_batch_size * world_size) % generations:
        raise ValueError(
            f"per_device_eval_batch_size ({config.per_device_eval_batch_size}) x {world_size} process(es) must be a "
            f"multiple of num_generations_eval ({generations}{source})"
        )


def evaluate(trainer: Trainer, step: int) -> dict[str, float]:
    """The ``eval/`` metrics after optimizer step ``step``, the same on every process: ``eval/reward``,
    ``eval/reward_std``, ``eval/frac_reward_zero_std`` (TRL's definitions, over all the eval completions at once:
    TRL averages its eval batches' figures, the same with one batch), fastgrpo's ``eval/group_reward_std`` and
    ``eval/frac_group_zero_std``, ``eval/rewards/<func>/mean`` and ``/std``, ``eval/completions/*``, the values reward
    functions gave ``log_metric``, and ``eval/runtime`` (seconds)."""
    cfg = trainer.config
    rows = trainer.eval_rows
    generations = cfg.num_generations_eval or cfg.num_generations
    rank, world = trainer.dist.rank, trainer.dist.world_size
    mine = list(range(rank, len(rows), world))
    per_call = max(1, cfg.per_device_eval_batch_size // generations)
    params = trainer.sampling
    logged = RewardLog()
    extra = logged.keywords(TrainerState(global_step=step, max_steps=cfg.max_steps))
    t0 = time.perf_counter()
    results: list[tuple[int, list[list[float]], list[int], list[bool]]] = []
    engine = trainer.rollouts.engine
    with distributed.gathered(trainer.update.policy), without_drafting(engine):
        for start in range(0, len(mine), per_call):
            indices = mine[start : start + per_call]
            part = [rows[i] for i in indices]
            prompt_ids, per_prompt, turns = rollout_prompts(trainer.tools, part, generations, trainer.prompts)
            uniforms = None
            if not params.greedy:
                width = params.max_new_tokens
                uniforms = torch.cat([eval_uniforms(cfg.seed, step, i, generations, width) for i in indices])
            out = engine.generate(prompt_ids, params, per_prompt, uniforms=uniforms, turns=turns)
            full_rows = [row for row in part for _ in range(generations)]
            prompts, completions, given = reward_inputs(turns, full_rows, out, trainer.tokenizer)
            per_func, _ = reward_matrix(
                trainer.reward_funcs,
                prompts,
                completions,
                out.completion_ids,
                full_rows,
                extra | given,
                cfg.reward_timeout,
            )
            lengths_of = completion_lengths(out.completion_ids, out.tool_masks)
            for j, index in enumerate(indices):
                group = slice(j * generations, (j + 1) * generations)
                results.append(
                    (
                        index,
                        per_func[group].tolist(),
                        lengths_of[group],
                        [r == "length" for r in out.finish_reasons[group]],
                    )
                )
    everything = sorted((r for part in distributed.gather(results) for r in part), key=lambda r: r[0])
    per_func = torch.tensor([v for r in everything for v in r[1]], dtype=torch.float64, device="cpu")
    per_func = per_func.view(-1, len(trainer.reward_funcs))
    lengths = torch.tensor([n for r in everything for n in r[2]], dtype=torch.float, device="cpu")
    truncated = torch.tensor([t for r in everything for t in r[3]], dtype=torch.bool, device="cpu")
    weights = torch.tensor(reward_weights(cfg, len(trainer.reward_funcs)), dtype=torch.float64, device="cpu")
    result = compute_advantages(per_func, weights, generations, cfg.scale_rewards, cfg.multi_objective_aggregation)
    metrics = dict(result.metrics)
    if generations == 1 and (cfg.scale_rewards != "batch" or per_func.shape[0] == 1):
        metrics["frac_reward_zero_std"] = 1.0  # TRL takes a group (or a batch) of one as of std 0
    metrics |= function_metrics(per_func, [reward_name(f) for f in trainer.reward_funcs])
    terminated = lengths[~truncated]
    metrics |= {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.float().mean()),
        "completions/mean_terminated_length": float(terminated.mean()) if terminated.numel() else 0.0,
    }
    metrics |= distributed.reduce_metrics(logged.metrics()) if world > 1 else logged.metrics()
    metrics["runtime"] = max(distributed.gather(time.perf_counter() - t0))
    return {PREFIX + key: value for key, value in metrics.items()}
