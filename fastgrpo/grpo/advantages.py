"""Rewards to advantages as TRL 1.16's ``GRPOTrainer`` forms them, with the reward metrics it logs.

A completion that no reward function scores (each returned None) has reward NaN: it is left out of its group's
mean and std (and of the batch's), and its advantage is 0. The two ways TRL combines several reward functions
(``multi_objective_aggregation``) are here: ``sum_then_normalize`` (the weighted sum, then the group baseline and
``scale_rewards``) and ``normalize_then_sum`` (GDPO: each function normalised within its group, then the weighted
sum normalised over the batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fastgrpo.config import AGGREGATIONS

STD_EPS = 1e-4


def nanstd(values: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """The unbiased standard deviation over the non-NaN entries (all of ``values``, or along ``dim``); NaN where
    fewer than two are not NaN (TRL's ``nanstd``)."""
    if dim is None:
        values, dim = values.reshape(-1), 0
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=keepdim)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=keepdim).to(values.dtype)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, math.nan))
    return torch.sqrt(variance * correction)


@dataclass
class Advantages:
    """What `compute_advantages` gives: ``advantages`` ``[N]`` (0 for unscored completions), ``rewards`` ``[N]``
    (the weighted sum, NaN for unscored completions) and the step's reward metrics."""

    advantages: Tensor
    rewards: Tensor
    metrics: dict[str, float]


def compute_advantages(
    per_func: Tensor,
    weights: Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> Advantages:
    """Advantages of ``N`` completions laid out as ``N // num_generations`` consecutive groups of one prompt's.

    Args:
        per_func: ``[N, F]`` each reward function's rewards (NaN where it returned None); float64 keeps the
            arithmetic exact to rounding.
        weights: ``[F]`` the functions' weights.
        num_generations: the group size ``G``.
        scale_rewards: ``group`` divides by the group's std, ``batch`` by the batch's, ``none`` not at all (with
            ``normalize_then_sum`` the batch's always, as TRL).
        aggregation: one of `AGGREGATIONS`.

    Returns:
        `Advantages`, with the metrics TRL logs: ``reward`` and ``reward_std`` (mean and std over the whole batch's
        scored completions), ``frac_reward_zero_std`` (the share of completions whose advantage's std is 0: with
        ``scale_rewards: batch`` the batch's, so 0 or 1); and fastgrpo's own ``group_reward_std`` (the mean of the
        groups' stds) and ``frac_group_zero_std`` (the share of groups whose scored rewards do not vary, which
        therefore teach nothing, whatever ``scale_rewards`` is).
    """
    n, count = per_func.shape
    if n % num_generations:
        raise ValueError(f"{n} completions are not whole groups of num_generations={num_generations}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation must be one of {list(AGGREGATIONS)}, got {aggregation!r}")
    weights = weights.to(per_func)
    unscored = torch.isnan(per_func).all(dim=1)
    total = (per_func * weights).nansum(dim=1).masked_fill(unscored, math.nan)
    groups = n // num_generations
    if aggregation == "sum_then_normalize":
        grouped = total.view(groups, num_generations)
        baseline = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
        if scale_rewards == "batch":
            std = nanstd(total).expand(n) if n > 1 else torch.zeros_like(total)
        else:  # with "none" the group's std is only read for frac_reward_zero_std
            std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
        advantages = total - baseline
        if scale_rewards != "none":
            advantages = advantages / (std + STD_EPS)
    else:
        grouped = per_func.view(groups, num_generations, count)
        normalised = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (
            nanstd(grouped, dim=1, keepdim=True) + STD_EPS
        )
        summed = (normalised.view(n, count) * weights).nansum(dim=1).masked_fill(unscored, math.nan)
        std = nanstd(summed).expand(n) if n > 1 else torch.zeros_like(summed)
        advantages = (summed - torch.nanmean(summed)) / (std + STD_EPS)
    advantages = torch.nan_to_num(advantages, nan=0.0)
    group_std = nanstd(total.view(groups, num_generations), dim=1)
    metrics = {
        "reward": float(torch.nanmean(total)),
        "reward_std": float(nanstd(total)),
        "frac_reward_zero_std": float(torch.isclose(std, torch.zeros_like(std)).to(total.dtype).mean()),
        "group_reward_std": float(torch.nanmean(group_std)),
        "frac_group_zero_std": float(((group_std < 1e-6) | torch.isnan(group_std)).to(total.dtype).mean()),
    }
    return Advantages(advantages, total, metrics)
