"""The policy's side of a GRPO step: the training forward (under DDP, or FSDP2 with ``fsdp``, when several processes
train), AdamW and its learning-rate schedule, the log-probs a batch needs before the update, and the clipped update
itself, micro-batch by micro-batch."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from transformers import PreTrainedModel, get_scheduler

from fastgrpo import distributed
from fastgrpo.config import GRPOConfig
from fastgrpo.grpo.batch import RolloutBatch, select_rows
from fastgrpo.grpo.entropy_control import EntropyControl
from fastgrpo.grpo.logprobs import CompletionLogprobs, completion_logprobs
from fastgrpo.grpo.losses import (
    grpo_loss_rows,
    micro_batch_loss,
    micro_batch_rows,
    off_policy_mask,
    sampling_correction,
)
from fastgrpo.grpo.micro_batch_stats import bonus_weights, micro_batch_slices, sliced_metrics, top_entropy_mask
from fastgrpo.grpo.update_metrics import sampling_metrics, skipped_parts, vespo_gamma
from fastgrpo.models import autocast_bf16
from fastgrpo.precision import MasterWeights, fused_adamw
from fastgrpo.threads import ThreadGovernor

logger = logging.getLogger(__name__)


class NonFiniteUpdate(ValueError):
    """An update that would make the policy's weights inf or nan (a non-finite loss or gradient norm, or an optimizer
    step too large): the trainer stops before anything of it is saved."""


def all_finite(params: list[torch.Tensor]) -> bool:
    """Whether every element of ``params`` (this process's shards under FSDP2) is finite, on every process: the sum
    of each parameter in float32, which an inf or nan element makes inf or nan (so do weights summing beyond 3e38,
    which no trainable model holds); one read of the weights, a tenth of the time of an elementwise test on a CPU,
    and one read back."""
    local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in params]
    sums = [p.sum(dtype=torch.float32) for p in local if p.numel()]
    bad = not bool(torch.stack(sums).isfinite().all()) if sums else False
    return distributed.max_over_ranks(int(bad)) == 0


class PolicyUpdate:
    """Updates ``model`` (its trainable parameters) by GRPO's loss; ``ref_model`` gives the KL penalty's reference
    (None: the policy with its LoRA adapters disabled); ``world_size`` processes share each batch.

    With ``master_weights`` and bfloat16 (or float16) trainable parameters, AdamW updates float32 master weights:
    FSDP2's shards when the policy is sharded (`distributed.wrap_policy`), otherwise copies
    (`fastgrpo.precision.MasterWeights`) written back into the module after every step. In a single process the
    gradients accumulate over micro-batches in float32 on the masters; under DDP they accumulate and are all-reduced
    in the weights' dtype (DDP reduces the module's own gradients), and under FSDP2 they are reduce-scattered in
    float32 every micro-batch. AdamW runs fused on CUDA (`fused_adamw`)."""

    def __init__(self, model: PreTrainedModel, ref_model: PreTrainedModel | None, config: GRPOConfig, world_size: int):
        self.model = model
        self.ref_model = ref_model
        self.config = config
        self.world_size = world_size
        self.device = next(model.parameters()).device
        self.bf16 = autocast_bf16(config.bf16, self.device)
        self.threads: ThreadGovernor | None = None  # consulted before every micro-batch when set
        # The training forward, under DDP (or FSDP2 with `fsdp`) when several processes train; either makes rank 0's
        # weights everyone's. FSDP2 shards the parameters, so the optimizer is built on the sharded ones.
        if config.gradient_checkpointing:  # active in training mode only: rollouts run the model in eval mode
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.compute_dtype = trainable[0].dtype
        keep_masters = config.master_weights and MasterWeights.needed(trainable)
        self.entropy = EntropyControl(config)  # the entropy bonus's coefficient
        forward = CompletionLogprobs(model, config.cast_lm_head_to_fp32, entropy_grad=self.entropy.enabled)
        self.policy = distributed.wrap_policy(forward, config.fsdp, float32_shards=keep_masters)
        # FSDP2's float32 shards are the master weights; otherwise `MasterWeights` keeps them.
        self.float32_shards = keep_masters and distributed.is_sharded(self.policy)
        trainable = [p for p in model.parameters() if p.requires_grad]  # FSDP2 registers its shards in their place
        self.masters = MasterWeights(trainable) if keep_masters and not self.float32_shards else None
        replicated = isinstance(self.policy, torch.nn.parallel.DistributedDataParallel)
        if self.masters is not None and not replicated:  # DDP reduces the module's own gradients
            self.masters.take_grads_in_backward()
        self.optimizer = torch.optim.AdamW(
            self.masters.copies if self.masters is not None else trainable,
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_epsilon,
            weight_decay=config.weight_decay,
            fused=fused_adamw(self.device),
        )
        self.scheduler = get_scheduler(
            config.lr_scheduler_type,
            self.optimizer,
            num_warmup_steps=config.warmup_optimizer_steps,
            num_training_steps=config.max_steps,
        )

    @property
    def keeps_masters(self) -> bool:
        """Whether AdamW updates float32 master weights (FSDP2's shards or `MasterWeights`' copies)."""
        return self.masters is not None or self.float32_shards

    def full_state(self) -> tuple[dict | None, dict, dict | None]:
        """What a checkpoint keeps of the update (under FSDP2 every rank must call this): the model's weights to
        save (None: the module's own; gathered in the policy's dtype under FSDP2), the optimizer state, and the
        float32 master weights in the order of the trainable parameters (None: none kept). Under FSDP2 the weights
        and masters are gathered on rank 0 only."""
        weights, optimizer = distributed.full_state(self.policy, self.optimizer)
        if self.masters is not None:
            return weights, optimizer, self.masters.state_dict()
        if not self.float32_shards:
            return weights, optimizer, None
        if not weights:  # FSDP2 gathers the full state on rank 0 only
            return weights, optimizer, None
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        masters = {"masters": [weights[n] for n in names]}
        cast = {k: v.to(self.compute_dtype) if v.dtype == torch.float32 else v for k, v in weights.items()}
        return cast, optimizer, masters

    def load_masters_unless_kept(self, saved: dict) -> None:
        """A checkpoint's float32 master weights (`full_state`'s) for a run that keeps none: float32 parameters take
        them exactly (the saved weights are their bfloat16 rounding); low-precision ones keep the saved weights."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        shapes = [tuple(c.shape) for c in saved["masters"]]
        if all(p.dtype == torch.float32 for p in trainable) and shapes == [tuple(p.shape) for p in trainable]:
            self.load_masters(saved)
        else:
            logger.warning("--resume: the checkpoint's float32 master weights are not used (master_weights: false)")

    def load_masters(self, state: dict) -> None:
        """Restore the float32 master weights `full_state` saved: into the copies, or into the trainable parameters
        themselves (FSDP2's shards, or float32 parameters of a run that keeps no copies)."""
        if self.masters is not None:
            self.masters.load_state_dict(state)
            return
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        saved = state["masters"]
        if [tuple(s.shape) for s in saved] != [tuple(p.shape) for _, p in named]:
            raise ValueError("master weights saved for other trainable parameters than this run's")
        if distributed.is_sharded(self.policy):
            distributed.load_full_weights(self.policy, {n: s for (n, _), s in zip(named, saved, strict=True)})
            return
        with torch.no_grad():
            for (_, p), s in zip(named, saved, strict=True):
                p.copy_(s)

    def logps(self, logprobs: Callable[..., Any], batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[B, C]`` completion log-probs by ``logprobs`` (the training forward, `CompletionLogprobs` possibly
        wrapped by DDP or FSDP2, which gives the entropies too; or `completion_logprobs` of another model), and the
        ``[B, C]`` entropies (None where ``logprobs`` gives none)."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            out = logprobs(
                batch.input_ids.to(self.device),
                batch.attention_mask.to(self.device),
                batch.completion_mask.shape[1],
                self.config.temperature or 1.0,
                self.config.logprob_chunk_tokens,
            )
        return out if isinstance(out, tuple) else (out, None)

    @torch.no_grad()
    def batch_logps(
        self, logprobs: Callable[..., Any], batch: RolloutBatch, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[N, C]`` completion log-probs (and entropies, or None) of the batch's ``rows`` (None: all), computed
        micro-batch by micro-batch; the other rows hold NaN. Every process runs as many forwards as the busiest one
        (the extra ones on one row, thrown away), so that FSDP2's collectives pair up."""
        mb = self.config.per_device_train_batch_size
        n, width = batch.completion_mask.shape
        rows = torch.arange(n, device="cpu") if rows is None else rows.cpu()
        chunks = [c for c in rows.split(mb) if c.numel()]  # none when no row is asked for
        forwards = distributed.max_over_ranks(len(chunks)) if self.world_size > 1 else len(chunks)
        logps = torch.full((n, width), math.nan, dtype=torch.float32, device="cpu")
        entropies = None
        for i in range(forwards):
            part_rows = chunks[i] if i < len(chunks) else torch.zeros(1, dtype=torch.long, device="cpu")
            lp, ent = self.logps(logprobs, select_rows(batch, part_rows))
            if i >= len(chunks):
                continue
            keep = lp.shape[1]
            logps = logps.to(lp.dtype)
            logps[part_rows, :keep] = lp.cpu()
            logps[part_rows, keep:] = 0.0
            if ent is not None:
                if entropies is None:
                    entropies = torch.full((n, width), math.nan, dtype=ent.dtype, device="cpu")
                entropies[part_rows, :keep] = ent.cpu()
                entropies[part_rows, keep:] = 0.0
        return logps, entropies

    def skips_zero_advantages(self) -> bool:
        """Whether the update leaves out the rows of advantage 0: their loss and gradient are exactly 0 without a KL
        term or an entropy bonus (and with bnpo's consecutive micro-batches kept)."""
        cfg = self.config
        return cfg.beta == 0 and not self.entropy.enabled and cfg.loss_type != "bnpo"

    def fixed_logps(self, batch: RolloutBatch) -> None:
        """What the update reads besides its own forwards, by passes without gradient before it: the old policy's
        log-probs of every row (when a generation trains several optimizer steps), the entropies of every row (to
        rank them, ``top_entropy_quantile < 1``), or else of the rows the update skips (for the metrics, with
        ``score_skipped_rows``); and the reference log-probs (when ``beta > 0``). Anything already set is kept."""
        cfg = self.config
        n = batch.completion_mask.shape[0]
        groups = self.micro_batches(batch)
        trained = torch.cat(groups) if groups else torch.zeros(0, dtype=torch.long, device="cpu")
        reused = cfg.steps_per_generation_pass > 1
        every = reused or cfg.top_entropy_quantile < 1
        if every:
            rows = torch.arange(n, device="cpu")
        else:
            skipped = torch.ones(n, dtype=torch.bool, device="cpu")
            skipped[trained.cpu()] = False
            rows = (
                skipped.nonzero().squeeze(-1)
                if cfg.score_skipped_rows
                else torch.zeros(0, dtype=torch.long, device="cpu")
            )
        busiest = distributed.max_over_ranks(int(rows.numel())) if self.world_size > 1 else int(rows.numel())
        if busiest:
            logps, entropies = self.batch_logps(self.policy, batch, rows)
            batch.start_logps, batch.start_entropies = logps, entropies
            if reused and batch.old_logps is None:
                batch.old_logps = logps
        if cfg.beta > 0 and batch.ref_logps is None:
            if self.ref_model is not None:
                batch.ref_logps = self.batch_logps(partial(completion_logprobs, self.ref_model), batch)[0]
            else:
                with self.model.disable_adapter():
                    batch.ref_logps = self.batch_logps(self.policy, batch)[0]

    def micro_batches(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """Row indices of each micro-batch (`micro_batch_rows`; no row is left out when `skips_zero_advantages` is
        false)."""
        cfg = self.config
        lengths = batch.attention_mask.sum(dim=1)
        skip = self.skips_zero_advantages()
        return micro_batch_rows(batch.advantages, lengths, cfg.loss_type, skip, cfg.per_device_train_batch_size)

    def optimize(self, batch: RolloutBatch, num_items_in_batch: float | None = None) -> dict[str, float]:
        """One optimizer step on the batch (one window of a generation), accumulating over micro-batches;
        ``num_items_in_batch``: the completion tokens of every process that dapo, cispo and vespo divide the step's
        loss by (None: the batch's; TRL's: the generation's over its windows).

        With several processes, DDP averages the gradients at the last micro-batch (FSDP2 at every micro-batch);
        every rank runs as many micro-batches as the busiest one (the extra ones with a zero loss), and the losses are
        scaled so that the averaged gradient is the one of the whole job's batch.

        The metrics are TRL's over every completion of the job's batch, the rows the update skips included (their
        clip parts are 0; their entropies and log-probs come from `fixed_logps`' pass): ``clip_ratio/*`` (or
        ``cispo_clip_ratio``), ``kl`` and ``entropy``; where the generation trains this step only, the ``sampling/*``
        gap between the sampler's log-probs and those of the policy the step starts from (else the trainer's, over the
        generation)."""
        cfg = self.config
        n, width = batch.completion_mask.shape
        world = self.world_size
        if num_items_in_batch is None:
            num_items_in_batch = distributed.sum_over_ranks(int(batch.completion_mask.sum()))
        total_tokens = max(num_items_in_batch, 1)
        groups = self.micro_batches(batch)
        n_micro = distributed.max_over_ranks(len(groups))
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        sequence_level = cfg.importance_sampling_level == "sequence"
        step_wide = cfg.accumulation_scope == "step"
        slices = micro_batch_slices(n, cfg.per_device_train_batch_size, step_wide)
        token_mask = None
        if cfg.top_entropy_quantile < 1:  # ranked by the entropies of the policy the step starts from
            quantile = cfg.top_entropy_quantile
            token_mask = top_entropy_mask(batch.start_entropies, batch.completion_mask, slices, quantile, world)
        kept = batch.completion_mask if token_mask is None else batch.completion_mask * token_mask
        bonus = self.entropy.enabled
        bonus_tokens = distributed.sum_over_ranks(float(kept.sum())) if bonus else 1.0
        bonus_share = None if step_wide else bonus_weights(kept, slices)  # TRL's: each micro-batch's mean
        coef = self.entropy.applied()
        start_logps = batch.start_logps
        start_entropies = batch.start_entropies
        # the old policy's log-probs of every row, for the sampling/* metrics: the update's own where it trains
        old_all = batch.old_logps.clone() if batch.old_logps is not None else start_logps
        old_all = old_all.clone() if old_all is not None else torch.full((n, width), math.nan, device="cpu")
        self.model.train()
        parts = skipped_parts(cfg, batch, start_entropies)
        loss_sum = policy_sum = trained_entropy = 0.0
        for i in range(n_micro):
            if self.threads is not None:
                self.threads.update()
            padding = i >= len(groups)
            rows = torch.arange(1, device="cpu") if padding else groups[i]
            part = select_rows(batch, rows)
            mask = part.completion_mask.to(self.device)
            with distributed.gradient_sync(self.policy, sync=i == n_micro - 1):
                logps, entropies = self.logps(self.policy, part)
                old = part.old_logps.to(self.device) if part.old_logps is not None else logps.detach()
                ref = part.ref_logps.to(self.device) if part.ref_logps is not None else None
                advantages = part.advantages.to(self.device)
                weights = None
                if part.sampling_logps is not None and cfg.importance_sampling_correction:
                    weights, _ = sampling_correction(
                        old,
                        part.sampling_logps.to(self.device),
                        mask,
                        cfg.importance_sampling_mode,
                        cfg.importance_sampling_clip_min,
                        cfg.importance_sampling_clip_max,
                    )
                sequence_mask = None
                if cfg.off_policy_mask_threshold is not None:
                    behaviour = part.sampling_logps if part.sampling_logps is not None else old
                    sequence_mask = off_policy_mask(
                        advantages,
                        logps,
                        behaviour.to(self.device).to(logps.dtype),
                        mask.to(logps.dtype),
                        cfg.off_policy_mask_threshold,
                    )
                keep = None if token_mask is None else token_mask[rows, : mask.shape[1]].to(self.device)
                loss, row_parts = grpo_loss_rows(
                    logps,
                    old,
                    advantages,
                    mask,
                    loss_type=cfg.loss_type,
                    epsilon=cfg.epsilon,
                    epsilon_high=cfg.epsilon_high,
                    beta=cfg.beta,
                    ref_logps=ref,
                    max_completion_length=cfg.max_completion_length,
                    num_items_in_batch=total_tokens,
                    importance_sampling_level=cfg.importance_sampling_level,
                    delta=cfg.delta,
                    sapo_temperature_pos=cfg.sapo_temperature_pos,
                    sapo_temperature_neg=cfg.sapo_temperature_neg,
                    vespo_gamma=vespo_gamma(cfg),
                    sampling_weights=weights,
                    use_bias_correction_kl=cfg.use_bias_correction_kl,
                    token_mask=None if keep is None else keep.to(logps.dtype),
                    sequence_mask=sequence_mask,
                )
                loss = micro_batch_loss(loss, cfg.loss_type, rows.numel(), n, n_micro, world)
                policy_part = loss.detach()
                if bonus:  # the mean entropy of the kept tokens: of each micro-batch's (averaged), or the step's
                    kept_here = mask.to(entropies.dtype) * (1.0 if keep is None else keep.to(entropies.dtype))
                    entropy_rows = (entropies * kept_here).sum(dim=-1)
                    if bonus_share is None:
                        loss = loss - coef * entropy_rows.sum() / bonus_tokens * world
                    else:
                        share = bonus_share[rows].to(self.device, entropy_rows.dtype)
                        loss = loss - coef * (entropy_rows * share).sum()
                    if not padding:
                        trained_entropy += float(entropy_rows.detach().sum())
                if padding:
                    loss = loss * 0.0
                loss.backward()
            if padding:
                continue
            loss_sum += float(loss.detach())
            policy_sum += float(policy_part)
            for name, value in row_parts.items():
                parts[name][rows] = value.to(parts[name].dtype).cpu()
            masked = mask.to(entropies.dtype)
            parts["entropy"][rows] = (entropies.detach() * masked).sum(dim=-1).to(torch.float64).cpu()
            if batch.old_logps is None:
                old_all[rows, : mask.shape[1]] = old.detach().to(old_all.dtype).cpu()
        if self.masters is not None:
            self.masters.take_grads()  # a parameter without any gradient gets zeros, as below
        else:
            for p in params:  # a step whose rows were all skipped still moves Adam's moments, as a zero gradient
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteUpdate(
                f"the gradient norm is {grad_norm} (the loss is {loss_sum}): lower learning_rate, or check the rewards"
            )
        rate = self.scheduler.get_last_lr()[0]  # the rate this optimizer step uses (TRL's `learning_rate`)
        self.optimizer.step()
        if self.masters is not None:
            self.masters.write_back()
        if not all_finite([p for p in self.model.parameters() if p.requires_grad]):  # as the module holds them
            raise NonFiniteUpdate("the optimizer step made a weight inf or nan: lower learning_rate")
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        out = sliced_metrics(parts, slices, sequence_level, world)
        if cfg.steps_per_generation_pass == 1:  # else the trainer's, over the whole generation
            out.update(sampling_metrics(cfg, batch, old_all))
        out |= {"loss": loss_sum, "grad_norm": grad_norm, "learning_rate": rate}
        if bonus:  # TRL's, with the bonus: the step's loss without it (TRL's per micro-batch), the coefficient after it
            self.entropy.observe(distributed.sum_over_ranks(trained_entropy), bonus_tokens)
            if not step_wide and cfg.loss_type in ("dapo", "cispo", "vespo"):
                policy_sum /= len(slices)  # TRL's mean of its micro-batches' shares of the step's loss
            out |= {"policy_loss": policy_sum, "entropy_coef": self.entropy.coef}
        out["train/rows_trained"] = float(sum(g.numel() for g in groups))
        return out
