"""GRPO objective: group-relative advantages and the clipped policy loss (the log-probs it weighs:
`fastgrpo.grpo.logprobs`).

Semantics follow TRL's ``GRPOTrainer`` (option names, loss types and metric names), so that
hyper-parameters and logged curves are comparable.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from fastgrpo.config import IMPORTANCE_SAMPLING_LEVELS, IMPORTANCE_SAMPLING_MODES, LOSS_TYPES, SCALE_REWARDS
from fastgrpo.grpo.advantages import compute_advantages, nanstd


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str = "group") -> tuple[Tensor, Tensor]:
    """Group-relative advantages of one reward per completion (`fastgrpo.grpo.advantages.compute_advantages`).

    Args:
        rewards: ``[N]`` rewards, laid out as ``N // num_generations`` consecutive groups of
            ``num_generations`` completions of the same prompt; NaN for a completion nothing scored, which is
            left out of its group's mean and std and gets advantage 0 (as TRL).
        num_generations: group size ``G`` (at least 2).
        scale_rewards: ``"group"`` divides by the group std, ``"batch"`` by the std of all
            ``N`` rewards, ``"none"`` does not scale. Stds are unbiased; ``1e-4`` is added.

    Returns:
        ``(advantages [N], group_std [N])`` in the rewards' dtype: ``reward - group mean`` (scaled as asked) and,
        for every completion, the unbiased std of its group (whatever ``scale_rewards`` is).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if num_generations < 2:
        raise ValueError(f"num_generations must be >= 2, got {num_generations}")
    if rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by num_generations={num_generations}, "
            f"got shape {tuple(rewards.shape)}"
        )
    wide = rewards.double()
    result = compute_advantages(
        wide.unsqueeze(1), torch.ones(1, dtype=torch.float64, device=rewards.device), num_generations, scale_rewards
    )
    group_std = nanstd(wide.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    return result.advantages.to(rewards.dtype), group_std.to(rewards.dtype)


def _aggregate(
    per_token_loss: Tensor,
    mask: Tensor,
    loss_type: str,
    max_completion_length: int | None,
    num_items_in_batch: int | float | Tensor | None,
) -> Tensor:
    """Reduce a ``[B, C]`` per-token loss to a scalar following ``loss_type``."""
    masked = per_token_loss * mask
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)).mean()
    if loss_type == "luspo":
        return masked.sum(dim=-1).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' requires max_completion_length")
        return masked.sum() / (per_token_loss.size(0) * max_completion_length)
    if num_items_in_batch is None:
        return masked.sum() / mask.sum().clamp(min=1.0)
    return masked.sum() / num_items_in_batch


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(policy || ref): ``exp(d) - d - 1`` with ``d = ref - logps``."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def off_policy_mask(
    advantages: Tensor, logps: Tensor, behaviour_logps: Tensor, mask: Tensor, threshold: float
) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's ``off_policy_mask_threshold``): ``[B, 1]``, 0 for a completion
    of negative advantage whose mean over its tokens of ``behaviour_logps - logps`` (the sampler's, or the old
    policy's, log-probs less the current ones: ``[B, C]``) is above ``threshold``, 1 elsewhere. NaN gaps count 0."""
    gap = torch.nan_to_num(behaviour_logps - logps.detach(), nan=0.0)
    mean_gap = (gap * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages.unsqueeze(1) >= 0) | (mean_gap <= threshold)).to(mask.dtype)


def entropy_threshold(entropies: Tensor, mask: Tensor, top_quantile: float) -> Tensor:
    """The entropy above which a token is among the ``top_quantile`` share of the masked tokens (``entropies`` and
    ``mask`` ``[B, C]``): their ``1 - top_quantile`` quantile, in float32 as TRL's; +inf without tokens."""
    values = entropies[mask.bool()].float()
    if values.numel() == 0:
        return torch.tensor(math.inf, device=entropies.device)
    return torch.quantile(values, 1 - top_quantile)


def grpo_loss_rows(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logps: Tensor | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: int | float | Tensor | None = None,
    importance_sampling_level: str = "token",
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_gamma: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
    sampling_weights: Tensor | None = None,
    use_bias_correction_kl: bool = True,
    token_mask: Tensor | None = None,
    sequence_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO's policy loss (TRL 1.16 ``GRPOTrainer._compute_loss``) and its metrics' per-row parts.

    The importance weight of a token is ``r = exp(logps - old_logps)``; with ``importance_sampling_level:
    "sequence"`` (GSPO) a row's tokens share ``exp`` of the mean of its tokens' log-ratios. Per token:

    - ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``: ``-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)``,
      ``r`` first capped at ``delta`` when it is set (two-sided clipping);
    - ``cispo``: ``-min(r, epsilon_high).detach() A logps`` (the weight capped, never the gradient cut);
    - ``sapo``: ``-sigmoid(tau (r - 1)) 4 / tau A``, ``tau`` being ``sapo_temperature_pos`` where ``A > 0`` and
      ``sapo_temperature_neg`` elsewhere (a soft gate in place of the clip);
    - ``vespo``: ``-phi(w) A logps``, ``phi`` `vespo_weights`' gamma weight of the row's sequence ratio ``w``
      (``vespo_gamma``: its k and lambda for ``A >= 0``, then for ``A < 0``; the sampler correction's token weights
      enter ``w``).

    That policy term is multiplied by ``sequence_mask`` (``[B, 1]``, `off_policy_mask`), ``token_mask`` (``[B,
    C]``, the tokens ``top_entropy_quantile`` keeps) and ``sampling_weights`` (``[B, C]`` or ``[B, 1]``, the sampler
    correction's weights, `sampling_correction`; not vespo's), in that order; then ``beta`` times the k3 KL to
    ``ref_logps`` is added, weighted by the unclipped, differentiable ratio ``r`` when ``use_bias_correction_kl``
    (the unbiased reverse-KL gradient).

    Args:
        logps: ``[B, C]`` current policy log-probs (differentiable).
        old_logps: ``[B, C]`` log-probs of the policy that sampled the completions
            (pass ``logps.detach()`` when fully on-policy).
        advantages: ``[B]`` per-completion advantages.
        mask: ``[B, C]`` completion mask (1 on real tokens).
        loss_type: one of ``LOSS_TYPES``, which also fixes the reduction: ``"grpo"`` and ``"sapo"`` per-sequence
            token mean then batch mean; ``"luspo"`` per-sequence sum then batch mean; ``"bnpo"`` token mean over
            this batch; ``"dr_grpo"`` sum / ``(B * max_completion_length)``; ``"dapo"``, ``"cispo"`` and
            ``"vespo"`` sum / ``num_items_in_batch`` (completion tokens
            of the whole generation batch, so micro-batch losses add up to the global token mean; defaults to
            this batch's token count).
        epsilon, epsilon_high: the clip range ``[1 - epsilon, 1 + epsilon_high]`` (``epsilon_high`` defaults to
            ``epsilon``); ``cispo`` caps the weight at ``epsilon_high`` itself.
        beta: weight of the k3 KL penalty to ``ref_logps`` (``[B, C]``, required when > 0).
        max_completion_length: required by ``"dr_grpo"``.
        num_items_in_batch: normaliser of ``"dapo"``, ``"cispo"`` and ``"vespo"``.
        importance_sampling_level: ``"token"`` or ``"sequence"``.
        delta: upper cap of the ratio in the clipped losses (None: none).
        sapo_temperature_pos, sapo_temperature_neg: ``sapo``'s gate temperatures.
        vespo_gamma: ``vespo``'s ``(k_pos, lambda_pos, k_neg, lambda_neg)``.

    Returns:
        ``(loss, rows)``: the scalar loss and, detached, ``[B]`` per-row parts of the metrics (`row_metrics` turns
        rows of a whole batch into TRL's figures): ``tokens`` (each row's masked tokens); for the clipped losses
        ``clip_low``, ``clip_high``, ``clip_region`` and for ``cispo`` ``cispo_clip`` (each row's count of clipped
        tokens, or at sequence level its 0/1 flag); for ``vespo`` ``vespo_phi`` (each row's gamma weight); ``kl``
        (each row's sum of the per-token KL term, ratio-weighted as it enters the loss) when ``beta > 0``.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {importance_sampling_level!r}"
        )
    if beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 requires ref_logps")
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    adv = advantages.unsqueeze(1)
    log_ratio = logps - old_logps
    if importance_sampling_level == "sequence":  # [B, 1]: the mean of each row's log-ratios (not their sum)
        log_ratio = ((log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    unclipped = ratio
    rows: dict[str, Tensor] = {"tokens": mask.sum(dim=-1)}

    def per_row(flags: Tensor) -> Tensor:  # [B, C] -> each row's masked count; [B, 1] -> the row's flag
        flags = flags.to(mask.dtype)
        return flags.squeeze(-1) if flags.shape[-1] == 1 else (flags * mask).sum(dim=-1)

    if loss_type == "cispo":
        per_token_loss = -torch.clamp(ratio, max=eps_high).detach() * adv * logps
        rows["cispo_clip"] = per_row((ratio.detach() > eps_high) & (adv > 0))
    elif loss_type == "sapo":
        temperature = torch.full_like(adv, sapo_temperature_neg).masked_fill_(adv > 0, sapo_temperature_pos)
        per_token_loss = -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * adv
    elif loss_type == "vespo":
        phi = vespo_weights(logps - old_logps, mask, adv, sampling_weights, vespo_gamma)
        per_token_loss = -phi * adv * logps
        rows["vespo_phi"] = phi.squeeze(-1)
    else:
        clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
        if delta is not None:
            ratio = torch.clamp(ratio, max=delta)
        per_token_loss = -torch.min(ratio * adv, clipped * adv)
        low = (ratio.detach() < 1 - epsilon) & (adv < 0)
        high = (ratio.detach() > 1 + eps_high) & (adv > 0)
        rows.update(clip_low=per_row(low), clip_high=per_row(high), clip_region=per_row(low | high))
    if sequence_mask is not None:
        per_token_loss = per_token_loss * sequence_mask
    if token_mask is not None:
        per_token_loss = per_token_loss * token_mask
    if sampling_weights is not None and loss_type != "vespo":  # vespo's are inside its weight
        per_token_loss = per_token_loss * sampling_weights
    if beta > 0:
        kl = k3_kl(logps, ref_logps)
        if use_bias_correction_kl:
            kl = kl * unclipped
        per_token_loss = per_token_loss + beta * kl
        rows["kl"] = (kl.detach() * mask).sum(dim=-1)
    loss = _aggregate(per_token_loss.expand_as(mask), mask, loss_type, max_completion_length, num_items_in_batch)
    return loss, {name: value.detach() for name, value in rows.items()}


@torch.no_grad()
def vespo_weights(
    log_ratio: Tensor, mask: Tensor, adv: Tensor, sampling_weights: Tensor | None, gamma: tuple[float, ...]
) -> Tensor:
    """VESPO's gamma weight ``phi(w) = exp(lambda) w^k exp(-lambda w)`` (1 at ``w = 1``) of each row's sequence ratio
    ``w``: ``exp`` of the sum of its tokens' ``log_ratio`` (``[B, C]``, each clamped to [-20, 20]) and of the logs of
    ``sampling_weights`` (``[B, C]``, the sampler correction's token weights, each log clamped to [log 1e-8, 20]),
    ``log w`` clamped to [log 1e-8, 20]; ``gamma`` gives k and lambda for ``adv`` (``[B, 1]``) ``>= 0``, then for
    ``< 0``. ``[B, 1]``, detached, computed in log space as TRL's ``get_gamma_weights``."""
    k_pos, lambda_pos, k_neg, lambda_neg = gamma
    floor = math.log(1e-8)
    log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(dim=-1, keepdim=True)
    if sampling_weights is not None:
        log_w = log_w + torch.log(sampling_weights).clamp(floor, 20.0).sum(dim=-1, keepdim=True)
    log_w = log_w.clamp(floor, 20.0)
    positive = adv >= 0
    k = torch.where(positive, k_pos, k_neg)
    lam = torch.where(positive, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


CLIP_METRICS = {
    "clip_low": "clip_ratio/low_mean",
    "clip_high": "clip_ratio/high_mean",
    "clip_region": "clip_ratio/region_mean",
    "cispo_clip": "cispo_clip_ratio",
}


def row_metrics(rows: dict[str, Tensor], sequence_level: bool) -> dict[str, Tensor]:
    """TRL's loss metrics over a batch from its rows' parts (`grpo_loss_rows`'s, ``[N]`` each, of every row of the
    batch: rows the update skips have ``tokens`` and no clipped token).

    Shares of tokens (of completions, empty ones included, at ``sequence_level``): ``clip_ratio/low_mean``,
    ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` or ``cispo_clip_ratio``; ``clip_ratio/low_min`` and
    ``clip_ratio/high_max``, the extremes over completions of each one's share of clipped tokens (completions
    without tokens left out; at sequence level its flag); ``kl`` and ``entropy``, token means, when their parts
    (``kl``, ``entropy``: each row's sums) are given. An empty batch gives 0 (NaN for the extremes)."""
    tokens = rows["tokens"]
    count = tokens.new_tensor(float(tokens.numel())) if sequence_level else tokens.sum()
    out = {}
    for part, name in CLIP_METRICS.items():
        if part in rows:
            out[name] = rows[part].sum() / count.clamp(min=1.0)
    extremes = (("clip_low", "clip_ratio/low_min", torch.min), ("clip_high", "clip_ratio/high_max", torch.max))
    for part, name, extreme in extremes:
        if part in rows:
            shares = rows[part] if sequence_level else (rows[part] / tokens)[tokens > 0]
            out[name] = extreme(shares) if shares.numel() else tokens.new_tensor(math.nan)
    for part in ("kl", "entropy"):
        if part in rows:
            out[part] = rows[part].sum() / tokens.sum().clamp(min=1.0)
    if "vespo_phi" in rows:  # a mean over completions (NaN: a row whose weight is unknown)
        phi = rows["vespo_phi"]
        known = ~torch.isnan(phi)
        out["vespo/phi_seq_mean"] = phi[known].sum() / known.sum().clamp(min=1)
    return out


def grpo_loss(
    logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, **options: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """`grpo_loss_rows` of one batch, with its metrics as TRL logs them for one micro-batch (`row_metrics`: the
    ``clip_ratio/*`` or ``cispo_clip_ratio`` shares and extremes, ``kl`` when ``beta > 0``). Shapes: ``logps``,
    ``old_logps``, ``mask`` ``[B, C]``, ``advantages`` ``[B]``; ``options``: `grpo_loss_rows`'s keyword arguments."""
    loss, rows = grpo_loss_rows(logps, old_logps, advantages, mask, **options)
    sequence_level = options.get("importance_sampling_level", "token") == "sequence"
    return loss, row_metrics(rows, sequence_level)


def sampling_correction(
    old_logps: Tensor,
    sampling_logps: Tensor,
    mask: Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """TRL's importance-sampling correction of the sampler's mismatch: the weight of the loss of tokens the sampler
    scored ``sampling_logps`` where the policy that the update starts from scores ``old_logps`` (both ``[B, C]``,
    ``mask`` ``[B, C]``).

    The ratio is ``exp(old - sampling)`` per token (``token_*`` modes) or ``exp`` of its sum over a completion's
    tokens (``sequence_*``: the completion's probability ratio, ``[B, 1]``); ``*_truncate`` clamps it into
    ``[clip_min, clip_max]``, ``*_mask`` sets it to 0 outside. Returns the weights (detached, in ``old_logps``'
    dtype) and the metrics TRL logs: ``sampling/sampling_logp_difference/{mean,max}`` (the absolute per-token gap)
    and ``sampling/importance_sampling_ratio/{min,mean,max}`` (after clamping or masking; per completion at sequence
    level)."""
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"importance_sampling_mode must be one of {IMPORTANCE_SAMPLING_MODES}, got {mode!r}")
    real = mask.bool()
    diff = (old_logps.detach().double() - sampling_logps.double()).masked_fill(~real, 0.0)
    log_ratio = diff.sum(dim=-1, keepdim=True) if mode.startswith("sequence") else diff
    ratio = torch.exp(log_ratio)
    low = float("-inf") if clip_min is None else clip_min
    high = float("inf") if clip_max is None else clip_max
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=low, max=high)
    else:
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    counted = torch.ones_like(ratio, dtype=torch.bool) if mode.startswith("sequence") else real
    n = counted.sum().clamp(min=1)
    metrics = {  # masked, not indexed: nothing is read back from the device
        "sampling/sampling_logp_difference/mean": diff.abs().sum() / real.sum().clamp(min=1),
        "sampling/sampling_logp_difference/max": diff.abs().max() if diff.numel() else diff.new_zeros(()),
        "sampling/importance_sampling_ratio/min": ratio.masked_fill(~counted, float("inf"))
        .min()
        .nan_to_num(posinf=0.0),
        "sampling/importance_sampling_ratio/mean": ratio.masked_fill(~counted, 0.0).sum() / n,
        "sampling/importance_sampling_ratio/max": ratio.masked_fill(~counted, 0.0).max(),
    }
    return ratio.to(old_logps.dtype), metrics


def micro_batch_rows(
    advantages: Tensor, lengths: Tensor, loss_type: str, skip_zero_advantages: bool, micro_batch_size: int
) -> list[Tensor]:
    """Row indices of each micro-batch of ``micro_batch_size`` rows (``advantages`` and ``lengths`` ``[N]``).

    For every loss type but ``bnpo`` the loss is a sum of per-row terms over a normaliser fixed by the whole
    batch, so rows can be regrouped freely: they are sorted by length (less padding), and rows whose advantage is 0
    are left out with ``skip_zero_advantages`` (without a KL term or an entropy bonus their loss and gradient are
    exactly 0). ``bnpo`` normalises by each micro-batch's token count, so its micro-batches keep TRL's consecutive
    order.
    """
    rows = torch.arange(advantages.shape[0], device=advantages.device)
    if loss_type != "bnpo":
        if skip_zero_advantages:
            rows = rows[advantages != 0]
        rows = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
    return [rows[i : i + micro_batch_size] for i in range(0, rows.numel(), micro_batch_size)]


def micro_batch_loss(
    loss: Tensor, loss_type: str, rows: int, batch_rows: int, micro_batches: int, world: int
) -> Tensor:
    """Scale a micro-batch's `grpo_loss` (over ``rows`` of the process's ``batch_rows`` rows, one of
    ``micro_batches``) to its share of the whole batch's loss, so that the accumulated gradient, averaged over the
    ``world`` processes as DDP does, is the gradient of the whole job's batch."""
    if loss_type in ("grpo", "sapo", "dr_grpo", "luspo"):
        return loss * rows / batch_rows
    if loss_type == "bnpo":
        return loss / micro_batches
    return loss * world
