"""The GRPO training loop: rollout with the batched engine, rewards, group advantages, clipped policy update."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_scheduler

from fastgrpo import distributed
from fastgrpo.config import GRPOConfig
from fastgrpo.data import load_dataset
from fastgrpo.grpo.batch import RolloutBatch, build_batch, select_rows
from fastgrpo.grpo.checkpoint import prepare_output_dir, save_checkpoint, set_rng_state
from fastgrpo.grpo.losses import (
    CompletionLogprobs,
    completion_logprobs,
    group_advantages,
    grpo_loss,
    micro_batch_loss,
    micro_batch_rows,
)
from fastgrpo.grpo.policy import peak_memory_mb, reference_model, wrap_lora
from fastgrpo.grpo.prompts import StepPrompts
from fastgrpo.grpo.run_log import RunLog
from fastgrpo.models import eos_token_ids, load_model, load_tokenizer, resolve_model_path, warn_if_bf16_emulated
from fastgrpo.rewards import check_columns, compute_rewards, resolve_reward_funcs
from fastgrpo.rollout.sequence import GenerationOutput
from fastgrpo.speculative.draft import DraftHead
from fastgrpo.speculative.rollouts import Rollouts

logger = logging.getLogger(__name__)
DRAFT_DIR = "draft"


class GRPOTrainer:
    """Trains ``config.model`` with GRPO on ``config.dataset``.

    Args:
        config: a validated `GRPOConfig`.
        model, tokenizer: optional already-loaded policy and tokenizer (otherwise loaded from ``config.model``).
        dataset: optional rows (otherwise loaded from ``config.dataset``).
    """

    def __init__(
        self,
        config: GRPOConfig,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        dataset: list[dict[str, Any]] | None = None,
        resume: bool = False,
    ):
        config.validate()
        self.config = config
        self.dist = distributed.init(config.device, config.ddp_timeout)
        self.output_dir = Path(config.output_dir)
        self.reward_funcs = resolve_reward_funcs(config.reward_funcs)
        self.dataset = dataset if dataset is not None else load_dataset(config.dataset)
        check_columns(self.reward_funcs, self.dataset)
        self.global_prompts = config.prompts_per_step * self.dist.world_size
        if len(self.dataset) < self.global_prompts:
            raise ValueError(
                f"the dataset has {len(self.dataset)} rows, fewer than the {self.global_prompts} prompts per step "
                f"({config.prompts_per_step} on each of {self.dist.world_size} processes)"
            )
        self.start_step = 0
        with distributed.main_first(self.dist):
            checkpoint, resume_state = prepare_output_dir(
                self.output_dir, resume, config.overwrite_output_dir, self.dist.is_main
            )
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        source = str(checkpoint) if checkpoint else config.model
        with distributed.main_first(self.dist):  # the embedded model is converted once, by rank 0
            resolve_model_path(config.model)
        self.tokenizer = tokenizer or load_tokenizer(source)
        # A LoRA checkpoint holds the adapter only: the base model comes from `model` and the adapter is loaded on it.
        self.model = model or load_model(config.model if config.use_peft else source, config.dtype, self.dist.device)
        self.device = next(self.model.parameters()).device
        if config.bf16:
            warn_if_bf16_emulated("bf16", self.device)
        self.ref_model = reference_model(config, self.device) if config.beta > 0 else None
        if config.use_peft:
            self.model = wrap_lora(self.model, config, checkpoint)
        self.eos = eos_token_ids(self.model, self.tokenizer)
        self.rollouts = Rollouts(
            self.model,
            self.tokenizer,
            self.eos,
            config.speculation,
            config.draft_training,
            config.model,
            self._load_draft(checkpoint),
            config.seed,
        )
        # The training forward, under DDP (or FSDP2 with `fsdp`) when several processes train; either makes rank 0's
        # weights everyone's. FSDP2 shards the parameters, so the optimizer is built on the sharded ones.
        self.policy = distributed.wrap_policy(CompletionLogprobs(self.model), config.fsdp)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
        )
        self.scheduler = get_scheduler(
            config.lr_scheduler_type,
            self.optimizer,
            num_warmup_steps=int(config.warmup_ratio * config.max_steps * config.num_iterations),
            num_training_steps=config.max_steps * config.num_iterations,
        )
        if checkpoint is not None:
            self._restore(checkpoint, resume_state)
        self.sampling = config.sampling_params()
        self.prompts = StepPrompts(
            self.dataset,
            self.tokenizer,
            config.prompts_per_step,
            self.dist.rank,
            self.dist.world_size,
            config.seed,
            config.max_prompt_length,
        )

    # -- set-up -------------------------------------------------------------------------------------------
    def _load_draft(self, checkpoint: Path | None) -> DraftHead | None:
        """The draft to start from: the one of the checkpoint being resumed or a saved one (None: `Rollouts` makes a
        fresh one)."""
        spec = self.config.speculation
        if spec.mode == "off":
            return None
        if checkpoint is not None and (checkpoint / DRAFT_DIR).is_dir():
            return DraftHead.load(checkpoint / DRAFT_DIR, self.model)
        if spec.draft is not None:
            try:
                return DraftHead.load(spec.draft, self.model)
            except (ValueError, FileNotFoundError) as e:
                raise ValueError(f"speculation.draft: {e}") from None
        return None

    def _restore(self, checkpoint: Path, state: dict[str, Any]) -> None:
        distributed.load_optimizer_state(self.policy, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        if "draft_optimizer" in state:
            self.rollouts.load_optimizer_state(state["draft_optimizer"])
        self.start_step = state["step"]
        logger.info("resumed from %s at step %d", checkpoint, self.start_step)

    # -- one step -----------------------------------------------------------------------------------------
    def rollout(self, step: int, rows: list[dict[str, Any]]) -> tuple[list[list[int]], GenerationOutput]:
        """Sample ``num_generations`` completions per prompt (`Rollouts.generate`: the same completions whatever the
        number of processes sharing the step)."""
        prompt_ids = self.prompts.encode(rows)
        out = self.rollouts.generate(
            prompt_ids, self.sampling, self.config.num_generations, step, self.dist.rank, self.dist.world_size
        )
        return prompt_ids, out

    def _logps(self, logprobs: Callable[..., torch.Tensor], batch: RolloutBatch) -> torch.Tensor:
        """``[B, C]`` completion log-probs by ``logprobs`` (`completion_logprobs` of a model, or the DDP-wrapped
        training forward, which takes the same arguments without the model)."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.bf16):
            return logprobs(
                batch.input_ids.to(self.device),
                batch.attention_mask.to(self.device),
                batch.completion_mask.shape[1],
                self.config.temperature or 1.0,
                self.config.logprob_chunk_tokens,
            )

    @torch.no_grad()
    def _batch_logps(self, logprobs: Callable[..., torch.Tensor], batch: RolloutBatch) -> torch.Tensor:
        """``[N, C]`` completion log-probs of the whole batch, computed micro-batch by micro-batch."""
        mb = self.config.per_device_train_batch_size
        n, width = batch.completion_mask.shape
        chunks = [
            self._logps(logprobs, select_rows(batch, torch.arange(i, min(i + mb, n)))).cpu() for i in range(0, n, mb)
        ]
        return torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[1])) for c in chunks])

    def _fixed_logps(self, batch: RolloutBatch) -> None:
        """Old-policy log-probs (needed when the batch is reused) and reference log-probs (when beta > 0)."""
        if self.config.num_iterations > 1:
            batch.old_logps = self._batch_logps(self.policy, batch)
        if self.config.beta > 0:
            if self.ref_model is not None:
                batch.ref_logps = self._batch_logps(partial(completion_logprobs, self.ref_model), batch)
            else:
                with self.model.disable_adapter():
                    batch.ref_logps = self._batch_logps(self.policy, batch)

    def micro_batches(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """Row indices of each micro-batch (`micro_batch_rows`)."""
        cfg = self.config
        lengths = batch.attention_mask.sum(dim=1)
        return micro_batch_rows(batch.advantages, lengths, cfg.loss_type, cfg.beta, cfg.per_device_train_batch_size)

    def optimize(self, batch: RolloutBatch) -> dict[str, float]:
        """``num_iterations`` optimizer steps over the batch, each accumulating over micro-batches.

        With several processes, DDP averages the gradients at the last micro-batch; every rank runs as many
        micro-batches as the busiest one (the extra ones with a zero loss), and the losses are scaled so that the
        averaged gradient is the one of the whole job's batch."""
        cfg = self.config
        n = batch.input_ids.shape[0]
        world = self.dist.world_size
        total_tokens = distributed.sum_over_ranks(int(batch.completion_mask.sum())) or 1
        groups = self.micro_batches(batch)
        n_micro = distributed.max_over_ranks(len(groups))
        params = [p for p in self.model.parameters() if p.requires_grad]
        sums: dict[str, float] = {"loss": 0.0}
        grad_norms: list[float] = []
        count = 0
        self.model.train()
        for _ in range(cfg.num_iterations):
            for i in range(n_micro):
                padding = i >= len(groups)
                rows = torch.arange(1) if padding else groups[i]
                part = select_rows(batch, rows)
                mask = part.completion_mask.to(self.device)
                with distributed.gradient_sync(self.policy, sync=i == n_micro - 1):
                    logps = self._logps(self.policy, part)
                    old = part.old_logps.to(self.device) if part.old_logps is not None else logps.detach()
                    ref = part.ref_logps.to(self.device) if part.ref_logps is not None else None
                    loss, metrics = grpo_loss(
                        logps,
                        old,
                        part.advantages.to(self.device),
                        mask,
                        loss_type=cfg.loss_type,
                        epsilon=cfg.epsilon,
                        epsilon_high=cfg.epsilon_high,
                        beta=cfg.beta,
                        ref_logps=ref,
                        max_completion_length=cfg.max_completion_length,
                        num_items_in_batch=total_tokens,
                    )
                    loss = micro_batch_loss(loss, cfg.loss_type, rows.numel(), n, n_micro, world)
                    if padding:
                        loss = loss * 0.0
                    loss.backward()
                if padding:
                    continue
                sums["loss"] += float(loss.detach())
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                count += 1
            for p in params:  # a step whose rows were all skipped still moves Adam's moments, as a zero gradient
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        out = {k: v / max(count, 1) for k, v in sums.items() if k != "loss"}
        out["loss"] = sums["loss"] / cfg.num_iterations
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["learning_rate"] = self.scheduler.get_last_lr()[0]
        out["train/rows_trained"] = float(sum(g.numel() for g in groups))
        return out

    def score(
        self, rows: list[dict[str, Any]], out: GenerationOutput
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float], list[tuple[Any, str, float]]]:
        """Rewards of this rank's completions and their advantages within the whole job's batch.

        Returns ``(advantages [n], all_rewards [N], all_group_std [N], reward metrics, (prompt, completion, reward)
        of each completion)``: groups are whole
        on every rank, and the job's rewards are gathered so that ``scale_rewards: batch`` sees them all."""
        cfg = self.config
        completions = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        full_rows = [row for row in rows for _ in range(cfg.num_generations)]
        prompts = [r["prompt"] for r in full_rows]
        rewards, reward_metrics = compute_rewards(
            self.reward_funcs, cfg.reward_weights, prompts, completions, out.completion_ids, full_rows
        )
        all_rewards = torch.cat([torch.as_tensor(r) for r in distributed.gather(rewards.tolist())])
        all_advantages, all_std = group_advantages(all_rewards, cfg.num_generations, cfg.scale_rewards)
        mine = slice(self.dist.rank * rewards.numel(), (self.dist.rank + 1) * rewards.numel())
        samples = list(zip(prompts, completions, rewards.tolist(), strict=True))
        return all_advantages[mine].to(rewards.dtype), all_rewards, all_std, reward_metrics, samples

    def train_step(self, step: int) -> dict[str, float]:
        """Rollout, reward, advantages and policy update for one step; returns the step's metrics."""
        cfg = self.config
        rows = self.prompts.rows(step)
        t0 = time.perf_counter()
        # FSDP2 gathers the full parameters for the rollout and the draft update (which reads the LM head).
        with distributed.gathered(self.policy):
            prompt_ids, out = self.rollout(step, rows)
            t1 = time.perf_counter()
            advantages, all_rewards, all_std, reward_metrics, self._last_samples = self.score(rows, out)
            t2 = time.perf_counter()
            draft_metrics = self.rollouts.update_draft()
        t_policy = time.perf_counter()
        prompts_per_row = [p for p in prompt_ids for _ in range(cfg.num_generations)]
        batch = build_batch(prompts_per_row, out.completion_ids, self.tokenizer.pad_token_id, advantages)
        truncated = torch.tensor([r == "length" for r in out.finish_reasons])
        if cfg.mask_truncated_completions:
            batch.completion_mask[truncated] = 0
        self._fixed_logps(batch)
        train_metrics = self.optimize(batch)
        t3 = time.perf_counter()
        lengths = torch.tensor([len(c) for c in out.completion_ids], dtype=torch.float)
        terminated = lengths[~truncated]
        metrics = {
            "step": step + 1,
            "reward": float(all_rewards.mean()),
            "reward_std": float(all_std.mean()),
            "frac_reward_zero_std": float((all_std.view(-1, cfg.num_generations)[:, 0] < 1e-6).float().mean()),
            **reward_metrics,
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.float().mean()),
            "completions/mean_terminated_length": float(terminated.mean()) if terminated.numel() else 0.0,
            **train_metrics,
            **draft_metrics,
            "time/rollout": t1 - t0,
            "time/reward": t2 - t1,
            "time/train": t3 - t_policy,
            "time/step": t3 - t0,
            **out.stats.metrics(),
            "memory/peak_mb": peak_memory_mb(self.device),
        }
        metrics = distributed.reduce_metrics(metrics)
        return metrics

    # -- the loop -----------------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        """Write ``checkpoint-{step}`` (rank 0 writes it; every rank waits until it is complete)."""
        path = self.output_dir / f"checkpoint-{step}"
        weights, optimizer_state = distributed.full_state(self.policy, self.optimizer)  # all ranks take part
        if self.dist.is_main:

            def write_model(path: Path) -> None:
                self.model.save_pretrained(path, **({} if weights is None else {"state_dict": weights}))
                self.tokenizer.save_pretrained(path)
                if self.rollouts.draft is not None:
                    self.rollouts.draft.save(path / DRAFT_DIR)

            state = {}
            if not self.config.save_only_model:
                state = {"optimizer": optimizer_state, "scheduler": self.scheduler.state_dict()}
                if self.rollouts.draft_trainer is not None:
                    state["draft_optimizer"] = self.rollouts.optimizer_state()
            path = save_checkpoint(self.output_dir, step, write_model, state, self.config.save_total_limit)
        distributed.barrier()
        return path

    def train(self) -> list[dict[str, float]]:
        """Run until ``max_steps``; returns the metrics of the steps run by this call (the same on every rank)."""
        cfg = self.config
        main = self.dist.is_main
        history = []
        bar = tqdm(
            range(self.start_step, cfg.max_steps),
            initial=self.start_step,
            total=cfg.max_steps,
            desc="GRPO",
            disable=not (cfg.progress_bar and main),
        )
        log = RunLog(cfg, self.start_step) if main else None
        try:
            for step in bar:
                metrics = self.train_step(step)
                history.append(metrics)
                if log is not None:
                    log.write(step + 1, metrics)
                    log.samples(step + 1, self._last_samples)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", tok_s=f"{metrics['rollout/tokens_per_second']:.0f}")
                if (step + 1) % cfg.save_steps == 0 or step + 1 == cfg.max_steps:
                    self.save(step + 1)
        finally:
            if log is not None:
                log.close()
        return history
