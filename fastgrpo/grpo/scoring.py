"""A training step's rewards and advantages: this rank's completions scored by every reward function (with TRL's
``trainer_state``, ``log_metric`` and ``log_extra``), the rewards gathered from every process into group-relative
advantages over the whole job's batch, and the reward metrics and printed samples of the step."""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from fastgrpo import distributed
from fastgrpo.config import GRPOConfig
from fastgrpo.grpo.advantages import compute_advantages
from fastgrpo.grpo.policy_update import NonFiniteUpdate
from fastgrpo.grpo.trl_form import reward_completion
from fastgrpo.reward_calls import RewardFunc, RewardLog, TrainerState, reward_name
from fastgrpo.rewards import function_metrics, reward_matrix
from fastgrpo.rollout.sequence import GenerationOutput
from fastgrpo.tools.turns import ToolTurns


def reward_inputs(
    turns: ToolTurns | None, full_rows: list[dict[str, Any]], out: GenerationOutput, tokenizer: PreTrainedTokenizerBase
) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """``(prompts, completions, keyword arguments)`` for the reward functions of one completion per ``full_rows``
    entry: the completions' text (a message list for a conversational row of TRL's form, `reward_completion`), or
    with tools as TRL hands them: each a list of messages (the assistant's turns and
    the tools' results, and the turn the token budget cut off), each prompt with its environment's reset text, and the
    environments as ``environments``."""
    prompts = [r["prompt"] for r in full_rows]
    if turns is None:
        texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        return prompts, [reward_completion(r, t) for r, t in zip(full_rows, texts, strict=True)], {}
    given = {"environments": turns.environments} if turns.environments is not None else {}
    return turns.prompts or prompts, turns.messages(out.completion_ids), given


def reward_weights(cfg: GRPOConfig, funcs: int) -> list[float]:
    """One weight per reward function: ``reward_weights`` (all 1 when unset), and 1 for each environment's
    ``get_reward`` after them, as TRL weighs it."""
    given = cfg.reward_weights or [1.0] * len(cfg.reward_funcs)
    return [*given, *[1.0] * (funcs - len(given))]


def score_completions(
    cfg: GRPOConfig,
    reward_funcs: list[RewardFunc],
    tokenizer: PreTrainedTokenizerBase,
    rank: int,
    rows: list[dict[str, Any]],
    out: GenerationOutput,
    step: int = 0,
    turns: ToolTurns | None = None,
) -> tuple[torch.Tensor, dict[str, float], list[tuple[Any, str, float, dict[str, Any]]]]:
    """Rewards of this rank's completions (of ``rows``' prompts, ``num_generations`` each) and their advantages
    within the whole job's batch, as TRL forms them (`compute_advantages`: a completion no reward function scores is
    left out of its group's statistics and gets advantage 0).

    Returns ``(advantages [n], reward metrics, (prompt, completion, reward, extra columns) of each completion)``:
    groups are whole on every rank, and every function's rewards are gathered so that the metrics and
    ``scale_rewards: batch`` see the whole job's batch. Reward functions get TRL's ``trainer_state``,
    ``log_metric`` and ``log_extra`` keyword arguments; the values given to ``log_metric`` are averaged into the
    step's metrics. With tools (``turns``), completions are handed as TRL hands them (`reward_inputs`)."""
    full_rows = [row for row in rows for _ in range(cfg.num_generations)]
    prompts, completions, given = reward_inputs(turns, full_rows, out, tokenizer)
    logged = RewardLog()
    extra = logged.keywords(TrainerState(global_step=step, max_steps=cfg.max_steps)) | given
    ids = out.completion_ids
    per_func, _ = reward_matrix(reward_funcs, prompts, completions, ids, full_rows, extra, cfg.reward_timeout)
    gathered = distributed.gather(per_func.tolist())
    all_per_func = torch.cat([torch.tensor(part, dtype=torch.float64, device="cpu") for part in gathered])
    weights = torch.tensor(reward_weights(cfg, len(reward_funcs)), dtype=torch.float64, device="cpu")
    result = compute_advantages(
        all_per_func, weights, cfg.num_generations, cfg.scale_rewards, cfg.multi_objective_aggregation
    )
    overflowed = any(math.isinf(value) for value in result.metrics.values())  # a spread past float64's range
    if overflowed or not torch.isfinite(result.advantages).all():
        largest = float(all_per_func.nan_to_num(0.0).abs().max())
        raise NonFiniteUpdate(
            f"the rewards give advantages that are inf or nan (the largest reward's magnitude is {largest:.3g}; "
            "group means and spreads overflow well below float64's limit): scale the rewards down"
        )
    metrics = {**result.metrics, **function_metrics(all_per_func, [reward_name(f) for f in reward_funcs])}
    metrics.update(logged.metrics())
    n = per_func.shape[0]
    mine = slice(rank * n, (rank + 1) * n)
    rewards = result.rewards[mine].tolist()
    samples = [
        (prompt, completion, reward, {column: values[i] for column, values in logged.columns.items()})
        for i, (prompt, completion, reward) in enumerate(zip(prompts, completions, rewards, strict=True))
    ]
    return result.advantages[mine].to(torch.float32), metrics, samples
