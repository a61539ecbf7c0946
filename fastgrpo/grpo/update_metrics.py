"""The policy update's metrics over the whole job's batch, as TRL logs them: each row's parts (`skipped_parts`, the
rows the update skips included), gathered from every process into ``clip_ratio/*``, ``kl`` and ``entropy``
(`job_row_metrics`), and the ``sampling/*`` gap between the sampler's log-probs and the policy's
(`sampling_metrics`)."""

from __future__ import annotations

import math

import torch

from fastgrpo import distributed
from fastgrpo.config import GRPOConfig
from fastgrpo.grpo.batch import RolloutBatch
from fastgrpo.grpo.losses import row_metrics, sampling_correction, vespo_weights


def skipped_parts(
    cfg: GRPOConfig, batch: RolloutBatch, start_entropies: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The per-row metric parts (`grpo_loss_rows`) of the batch before its micro-batches fill theirs: every row's
    tokens, no clipped token, and the entropies of `PolicyUpdate.fixed_logps`' pass (NaN for a row without)."""
    mask = batch.completion_mask.to(torch.float64)
    n = mask.shape[0]
    parts = {"tokens": mask.sum(dim=-1)}
    if cfg.loss_type == "cispo":
        parts["cispo_clip"] = torch.zeros(n, dtype=torch.float64, device="cpu")
    elif cfg.loss_type not in ("sapo", "vespo"):  # the losses that clip
        for name in ("clip_low", "clip_high", "clip_region"):
            parts[name] = torch.zeros(n, dtype=torch.float64, device="cpu")
    if cfg.loss_type == "vespo":
        parts["vespo_phi"] = _vespo_phi(cfg, batch)
    if cfg.beta > 0:
        parts["kl"] = torch.zeros(n, dtype=torch.float64, device="cpu")  # every row trains: filled by the micro-batches
    if start_entropies is not None:
        parts["entropy"] = (start_entropies.to(torch.float64) * mask).sum(dim=-1)
    else:
        parts["entropy"] = torch.full((n,), math.nan, dtype=torch.float64, device="cpu")
    return parts


def vespo_gamma(cfg: GRPOConfig) -> tuple[float, float, float, float]:
    """``cfg``'s vespo options as `fastgrpo.grpo.losses.vespo_weights` takes them."""
    return cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg


def _vespo_phi(cfg: GRPOConfig, batch: RolloutBatch) -> torch.Tensor:
    """``[N]`` vespo's weight of every row from the log-probs of `PolicyUpdate.fixed_logps`' pass (NaN for a row
    without), as the update's first iteration weighs a row it trains."""
    n = batch.completion_mask.shape[0]
    start = batch.start_logps
    if start is None:
        return torch.full((n,), math.nan, dtype=torch.float64, device="cpu")
    start = start.double()
    old = start if batch.old_logps is None else batch.old_logps.double()
    weights = None
    if batch.sampling_logps is not None and cfg.importance_sampling_correction:
        clips = cfg.importance_sampling_clip_min, cfg.importance_sampling_clip_max
        weights, _ = sampling_correction(
            old, batch.sampling_logps, batch.completion_mask, cfg.importance_sampling_mode, *clips
        )
    mask = batch.completion_mask.to(torch.float64)
    phi = vespo_weights(start - old, mask, batch.advantages.double()[:, None], weights, vespo_gamma(cfg))[:, 0]
    return phi.masked_fill(torch.isnan(start).any(dim=1), math.nan)


def job_row_metrics(parts: dict[str, torch.Tensor], sequence_level: bool, world_size: int) -> dict[str, float]:
    """`row_metrics` of the whole job's rows (each process's parts gathered), the entropy over the rows that
    have one (all but skipped rows without `PolicyUpdate.fixed_logps`' pass)."""
    if world_size > 1:
        gathered = distributed.gather(parts)
        parts = {name: torch.cat([g[name] for g in gathered]) for name in parts}
    known = ~torch.isnan(parts["entropy"])
    entropy = {"tokens": parts["tokens"][known], "entropy": parts["entropy"][known]}
    out = row_metrics({k: v for k, v in parts.items() if k != "entropy"}, sequence_level)
    out["entropy"] = row_metrics(entropy, sequence_level)["entropy"]
    return {name: float(value) for name, value in out.items()}


def sampling_metrics(cfg: GRPOConfig, batch: RolloutBatch, old_all: torch.Tensor) -> dict[str, float]:
    """TRL's ``sampling/*`` metrics over the rows whose old log-probs are known (every row, unless the update
    skipped some and ``score_skipped_rows`` is off), as TRL computes them over its generation batch; the ratio's
    only when the correction applies it."""
    if batch.sampling_logps is None:
        return {}
    known = ~torch.isnan(old_all).any(dim=1)
    if not known.any():
        return {}
    _, metrics = sampling_correction(
        old_all[known].double(),
        batch.sampling_logps[known],
        batch.completion_mask[known],
        cfg.importance_sampling_mode,
        cfg.importance_sampling_clip_min,
        cfg.importance_sampling_clip_max,
    )
    if not cfg.importance_sampling_correction:  # the gap is measured, no ratio is applied
        metrics = {k: v for k, v in metrics.items() if "importance_sampling_ratio" not in k}
    return {name: float(value) for name, value in metrics.items()}
