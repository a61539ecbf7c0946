"""What TRL takes per micro-batch under gradient accumulation (``accumulation_scope: micro_batch``): the step's rows
in micro-batches of ``per_device_train_batch_size`` consecutive rows of its shuffled window (`micro_batch_slices`),
each ranking its own tokens for ``top_entropy_quantile`` (`top_entropy_mask`), averaging its own entropy for the
bonus (`bonus_weights`) and giving its own metrics, which the step averages (`sliced_metrics`). The update may still
run the rows packed otherwise: these are per row and per token."""

from __future__ import annotations

import torch

from fastgrpo import distributed
from fastgrpo.grpo.losses import entropy_threshold
from fastgrpo.grpo.update_metrics import job_row_metrics


def micro_batch_slices(rows: int, micro_batch_size: int, step_wide: bool) -> list[torch.Tensor]:
    """``[rows]`` split into TRL's micro-batches of ``micro_batch_size`` consecutive rows (``step_wide``: one)."""
    order = torch.arange(rows, device="cpu")
    return [order] if step_wide else list(order.split(micro_batch_size))


def top_entropy_mask(
    entropies: torch.Tensor, mask: torch.Tensor, slices: list[torch.Tensor], quantile: float, world: int
) -> torch.Tensor:
    """``[N, C]`` the tokens ``top_entropy_quantile`` keeps (``entropies`` and ``mask`` ``[N, C]``): in each slice,
    those at or above the quantile of that slice's tokens on every process (TRL gathers a micro-batch's)."""
    keep = torch.zeros_like(mask, dtype=torch.bool)
    for rows in slices:
        here, on = entropies[rows], mask[rows].bool()
        mine = here[on].float()
        everyone = torch.cat(distributed.gather(mine)) if world > 1 else mine
        threshold = entropy_threshold(everyone, torch.ones_like(everyone), quantile)
        keep[rows] = ((here * on) >= threshold) & on
    return keep


def bonus_weights(kept: torch.Tensor, slices: list[torch.Tensor]) -> torch.Tensor:
    """``[N]`` each row's weight in the entropy bonus (``kept`` ``[N, C]`` the tokens it acts on): one over its slice's
    kept tokens on this process and the number of slices, so that the bonus is the mean over the slices of their mean
    entropy, as TRL's accumulated one."""
    weights = torch.zeros(kept.shape[0], dtype=torch.float64, device="cpu")
    for rows in slices:
        weights[rows] = 1.0 / (max(float(kept[rows].sum()), 1.0) * len(slices))
    return weights


def sliced_metrics(
    parts: dict[str, torch.Tensor], slices: list[torch.Tensor], sequence_level: bool, world: int
) -> dict[str, float]:
    """The update's metrics (`job_row_metrics`) of each slice, with every process's same slice, averaged over the
    slices, as TRL averages the values it logs per micro-batch."""
    each = [job_row_metrics({k: v[rows] for k, v in parts.items()}, sequence_level, world) for rows in slices]
    return {key: sum(m[key] for m in each) / len(each) for key in each[0]}
