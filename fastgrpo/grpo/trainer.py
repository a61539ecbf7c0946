"""The GRPO training loop: rollout with the batched engine, rewards, group advantages, clipped policy update."""

from __future__ import annotations

import json
import logging
import random
import resource
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_scheduler

from fastgrpo import distributed
from fastgrpo.config import GRPOConfig, config_to_dict
from fastgrpo.data import load_dataset
from fastgrpo.grpo.checkpoint import (
    list_checkpoints,
    load_latest_intact,
    remove_leftovers,
    save_checkpoint,
    set_rng_state,
)
from fastgrpo.grpo.losses import CompletionLogprobs, completion_logprobs, group_advantages, grpo_loss
from fastgrpo.models import (
    encode_prompts,
    eos_token_ids,
    load_model,
    load_tokenizer,
    resolve_model_path,
    warn_if_bf16_emulated,
)
from fastgrpo.rewards import check_columns, compute_rewards, resolve_reward_funcs
from fastgrpo.rollout.engine import GenerationOutput, RolloutEngine
from fastgrpo.spec.controller import controller_from_config
from fastgrpo.spec.draft import DraftHead
from fastgrpo.spec.draft_trainer import DraftTrainer, rollout_samples
from fastgrpo.spec.offline import frequent_tokens_on_all_ranks

logger = logging.getLogger(__name__)
DRAFT_DIR = "draft"


@dataclass
class RolloutBatch:
    """One step's completions as training tensors (``N = prompts * num_generations`` rows).

    ``input_ids`` is ``[N, P + C]``: the prompt left-padded to ``P``, the completion right-padded to ``C``;
    ``attention_mask`` likewise; ``completion_mask`` ``[N, C]`` marks the completion tokens that are trained.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None


def build_batch(
    prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int, advantages: torch.Tensor
) -> RolloutBatch:
    """Pack prompts (one per completion) and completions into left/right padded tensors."""
    n = len(completion_ids)
    p_len = max(map(len, prompt_ids))
    c_len = max(max(map(len, completion_ids)), 1)
    ids = torch.full((n, p_len + c_len), pad_id, dtype=torch.long)
    attn = torch.zeros(n, p_len + c_len, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=False)):
        ids[i, p_len - len(p) : p_len] = torch.tensor(p)
        ids[i, p_len : p_len + len(c)] = torch.tensor(c, dtype=torch.long)
        attn[i, p_len - len(p) : p_len + len(c)] = 1
    return RolloutBatch(ids, attn, attn[:, p_len:].clone(), advantages)


def select_rows(batch: RolloutBatch, rows: torch.Tensor) -> RolloutBatch:
    """Some rows of a batch (``rows``: ``[n]`` indices), trimmed to the prompt and completion columns they use."""
    attn = batch.attention_mask[rows]
    c_len = batch.completion_mask.shape[1]
    p_len = attn.shape[1] - c_len
    used = attn.any(dim=0).nonzero().squeeze(-1)
    start = min(int(used.min()), p_len - 1)
    keep = max(int(used.max()) + 1 - p_len, 1)

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows, :keep]

    return RolloutBatch(
        input_ids=batch.input_ids[rows, start : p_len + keep],
        attention_mask=attn[:, start : p_len + keep],
        completion_mask=batch.completion_mask[rows, :keep],
        advantages=batch.advantages[rows],
        old_logps=cut(batch.old_logps),
        ref_logps=cut(batch.ref_logps),
    )


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of the process so far: allocated device memory on CUDA, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


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
            checkpoint, resume_state = self._prepare_output_dir(resume)
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
        self.ref_model = self._load_reference() if config.beta > 0 else None
        if config.use_peft:
            self.model = self._wrap_peft(self.model, checkpoint)
        self.eos = eos_token_ids(self.model, self.tokenizer)
        self.engine = RolloutEngine(self.model, self.eos, self.tokenizer)
        self.draft: DraftHead | None = None
        self.draft_trainer: DraftTrainer | None = None
        draft = self._load_draft(checkpoint)
        if draft is not None:
            self._attach_draft(draft)
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
        self.prompt_cache: dict[int, list[int]] = {}
        self._warned_truncation = False
        self.tb_writer = self._tensorboard() if "tensorboard" in config.report_to and self.dist.is_main else None

    # -- set-up -------------------------------------------------------------------------------------------
    def _prepare_output_dir(self, resume: bool) -> tuple[Path | None, dict[str, Any] | None]:
        """Refuse an ``output_dir`` that holds another run unless resuming it or ``overwrite_output_dir`` (which
        deletes it), remove what an interrupted run left behind, and pick the checkpoint to resume from: the newest
        whose weights and state are readable. Returns it and its state (None and None for a new run)."""
        out, main = self.output_dir, self.dist.is_main
        earlier = [p for p in (out / "metrics.jsonl", *list_checkpoints(out)) if p.exists()]
        if earlier and not resume:
            if not self.config.overwrite_output_dir:
                raise ValueError(
                    f"output_dir {out} holds another run ({', '.join(p.name for p in earlier)}): continue it with "
                    "--resume, start over there with --overwrite_output_dir true (which deletes it), or choose "
                    "another output_dir"
                )
            if main:
                for path in earlier:
                    if path.is_dir():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
                logger.warning("overwrite_output_dir: deleted the earlier run in %s", out)
        if main:
            for path in remove_leftovers(out):
                logger.warning("removed %s, left behind by an interrupted run", path)
        if not resume:
            return None, None
        checkpoint, state, passed = load_latest_intact(out)
        for reason in passed:
            logger.warning("--resume: passing over %s", reason)
        if checkpoint is None:
            detail = f" intact ({'; '.join(passed)})" if passed else ""
            raise FileNotFoundError(f"--resume: no{detail} checkpoint under {out}")
        if "optimizer" not in state:
            raise ValueError(
                f"--resume: {checkpoint} was saved with save_only_model: true and holds no optimizer state to resume "
                "from; start a new run from its weights with --model instead"
            )
        return checkpoint, state

    def _load_reference(self) -> PreTrainedModel | None:
        """A frozen copy of the initial policy for the KL penalty (none with LoRA: adapters are disabled)."""
        if self.config.use_peft:
            return None
        ref = load_model(self.config.model, dtype=self.config.dtype).to(self.device).eval()
        ref.requires_grad_(False)
        return ref

    def _load_draft(self, checkpoint: Path | None) -> DraftHead | None:
        """The draft for speculative rollouts: from the checkpoint being resumed, a saved draft, or a fresh one
        (None with ``speculation.draft_vocab_size``: that one is made after the first rollout, `attach_vocab_draft`)."""
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
        if spec.draft_vocab_size is not None:
            return None
        return self._fresh_draft()

    def _fresh_draft(self, vocab: torch.Tensor | None = None) -> DraftHead:
        """An untrained draft, over the ``[V_d]`` target ids ``vocab`` or the full vocabulary."""
        param = next(self.model.parameters())
        return DraftHead(self.model.config, self.config.model, vocab).to(device=param.device, dtype=param.dtype)

    def _attach_draft(self, draft: DraftHead) -> None:
        """Roll out speculatively with ``draft`` from now on, and train it online when draft learning is on."""
        cfg = self.config
        controller = controller_from_config(cfg.speculation, self.model, draft, cfg.model)
        self.engine = RolloutEngine(self.model, self.eos, self.tokenizer, draft=draft, controller=controller)
        self.draft = draft
        if cfg.draft_training.online:
            embed, head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
            self.draft_trainer = DraftTrainer(draft, embed, head, cfg.draft_training)

    @property
    def awaits_draft_vocab(self) -> bool:
        """Speculation is on but its fresh draft waits for the first rollout to choose its reduced vocabulary."""
        return self.config.speculation.mode != "off" and self.draft is None

    def attach_vocab_draft(self, out: GenerationOutput) -> None:
        """Make and attach the fresh draft of ``speculation.draft_vocab_size``: its vocabulary is the most frequent
        tokens of this rollout's completions on all ranks (so that every rank builds the same draft)."""
        vocab = frequent_tokens_on_all_ranks(out.completion_ids, self.config.speculation.draft_vocab_size, self.eos)
        self._attach_draft(self._fresh_draft(vocab))

    def _wrap_peft(self, model: PreTrainedModel, checkpoint: Path | None) -> PreTrainedModel:
        from peft import LoraConfig, PeftModel, get_peft_model

        if checkpoint is not None:
            return PeftModel.from_pretrained(model, str(checkpoint), is_trainable=True)

        lora = LoraConfig(
            r=self.config.lora_r,
            lora_alpha=self.config.lora_alpha,
            lora_dropout=self.config.lora_dropout,
            target_modules=self.config.lora_target_modules or "all-linear",
            task_type="CAUSAL_LM",
        )
        try:
            return get_peft_model(model, lora)
        except ValueError as e:
            raise ValueError(f"lora_target_modules {self.config.lora_target_modules}: {e}") from None

    def _tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("report_to: tensorboard needs `pip install tensorboard`") from e
        return SummaryWriter(str(self.output_dir / "tensorboard"))

    def _restore(self, checkpoint: Path, state: dict[str, Any]) -> None:
        distributed.load_optimizer_state(self.policy, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        if self.draft_trainer is not None and "draft_optimizer" in state:
            self.draft_trainer.optimizer.load_state_dict(state["draft_optimizer"])
        self.start_step = state["step"]
        logger.info("resumed from %s at step %d", checkpoint, self.start_step)

    # -- one step -----------------------------------------------------------------------------------------
    def step_rows(self, step: int) -> list[dict[str, Any]]:
        """This process's prompts of a step: a seeded permutation per epoch, so a resumed run sees the same ones.

        The step's prompts for the whole job are cut into one consecutive share per rank, so a run on N processes
        sees the prompts, in the same order, that one process sees with an N times larger batch."""
        per_rank = self.config.prompts_per_step
        first = step * self.global_prompts + self.dist.rank * per_rank
        rows = []
        for k in range(first, first + per_rank):
            epoch, index = divmod(k, len(self.dataset))
            order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.config.seed + epoch))
            rows.append(self.dataset[int(order[index])])
        return rows

    def _encode(self, rows: list[dict[str, Any]]) -> list[list[int]]:
        out = []
        limit = self.config.max_prompt_length
        for row in rows:
            key = id(row)
            if key not in self.prompt_cache:
                ids = encode_prompts(self.tokenizer, [row["prompt"]], limit + 1)[0]
                if len(ids) > limit and not self._warned_truncation:
                    self._warned_truncation = True
                    logger.warning(
                        "a prompt is longer than max_prompt_length (%d tokens): it keeps its last %d tokens and loses "
                        "its beginning, the chat template's header included; raise max_prompt_length (later prompts "
                        "are cut without another warning)",
                        limit,
                        limit,
                    )
                self.prompt_cache[key] = ids[-limit:]
            out.append(self.prompt_cache[key])
        return out

    def rollout(self, step: int, rows: list[dict[str, Any]]) -> tuple[list[list[int]], GenerationOutput]:
        """Sample ``num_generations`` completions per prompt.

        The uniforms that pick the sampled tokens are drawn for the whole job's rows from a generator seeded by
        (seed, step), and each rank takes its own rows' share: a completion does not depend on how many
        processes share the step."""
        cfg = self.config
        prompt_ids = self._encode(rows)
        uniforms = None
        if not self.sampling.greedy:
            generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            rows_per_rank = cfg.prompts_per_step * cfg.num_generations
            shape = (rows_per_rank * self.dist.world_size, cfg.max_completion_length)
            uniforms = torch.rand(shape, generator=generator, dtype=torch.float64)
            uniforms = uniforms[self.dist.rank * rows_per_rank : (self.dist.rank + 1) * rows_per_rank]
        capture = self.draft_trainer is not None or (self.awaits_draft_vocab and self.config.draft_training.online)
        out = self.engine.generate(
            prompt_ids, self.sampling, cfg.num_generations, capture_hidden=capture, uniforms=uniforms
        )
        return prompt_ids, out

    def update_draft(self, prompt_ids: list[list[int]], out: GenerationOutput) -> dict[str, float]:
        """Online draft learning on a rollout's completions (also those of groups the policy update skips), with the
        target hidden states its forwards captured: all of them when the rollout ran trees at every step, fewer as
        it ran fewer (`DraftTrainer.fit_online`). The policy is frozen meanwhile (the draft's
        loss reaches no policy weight)."""
        return self.draft_trainer.fit_online(rollout_samples(prompt_ids, out, self.config.num_generations), [out.stats])

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
        """Row indices of each micro-batch of ``per_device_train_batch_size`` rows.

        For ``grpo``, ``dr_grpo`` and ``dapo`` the loss is a sum of per-row terms over a normaliser fixed by the
        whole batch, so rows can be regrouped freely: they are sorted by length (less padding), and rows whose
        advantage is 0 are left out when ``beta == 0`` (their loss and gradient are exactly 0). ``bnpo``
        normalises by each micro-batch's token count, so its micro-batches keep TRL's consecutive order.
        """
        cfg = self.config
        mb = cfg.per_device_train_batch_size
        rows = torch.arange(batch.input_ids.shape[0])
        if cfg.loss_type != "bnpo":
            if cfg.beta == 0:
                rows = rows[batch.advantages != 0]
            lengths = batch.attention_mask[rows].sum(dim=1)
            rows = rows[torch.argsort(lengths, descending=True, stable=True)]
        return [rows[i : i + mb] for i in range(0, rows.numel(), mb)]

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
                    # Scale each micro-batch's loss to its share of the whole batch's loss (DDP divides by `world`).
                    if cfg.loss_type in ("grpo", "dr_grpo"):
                        loss = loss * rows.numel() / n
                    elif cfg.loss_type == "bnpo":
                        loss = loss / n_micro
                    else:
                        loss = loss * world
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
        """Rewards of this rank's completions and their advantages within the whole job's batch.

        Returns ``(advantages [n], all_rewards [N], all_group_std [N], reward metrics)``: groups are whole
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
        self._last_samples = list(zip(prompts, completions, rewards.tolist(), strict=True))
        return all_advantages[mine].to(rewards.dtype), all_rewards, all_std, reward_metrics

    def train_step(self, step: int) -> dict[str, float]:
        """Rollout, reward, advantages and policy update for one step; returns the step's metrics."""
        cfg = self.config
        rows = self.step_rows(step)
        t0 = time.perf_counter()
        # FSDP2 gathers the full parameters for the rollout and the draft update (which reads the LM head).
        with distributed.gathered(self.policy):
            prompt_ids, out = self.rollout(step, rows)
            t1 = time.perf_counter()
            advantages, all_rewards, all_std, reward_metrics = self.score(rows, out)
            t2 = time.perf_counter()
            if self.awaits_draft_vocab:
                self.attach_vocab_draft(out)
            draft_metrics = self.update_draft(prompt_ids, out) if self.draft_trainer is not None else {}
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
            "rollout/tokens_per_second": out.stats.tokens_per_second,
            "rollout/target_forwards": out.stats.target_forwards,
            "spec/accept_length": out.stats.accept_length,
            "spec/tree_accept_length": out.stats.tree_accept_length,
            "spec/n_verify_mean": out.stats.n_verify_mean,
            "spec/concurrency_mean": out.stats.concurrency_mean,
            "spec/draft_time": out.stats.draft_time,
            "spec/verify_time": out.stats.verify_time,
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
                if self.draft is not None:
                    self.draft.save(path / DRAFT_DIR)

            state = {}
            if not self.config.save_only_model:
                state = {"optimizer": optimizer_state, "scheduler": self.scheduler.state_dict()}
                if self.draft_trainer is not None:
                    state["draft_optimizer"] = self.draft_trainer.optimizer.state_dict()
            path = save_checkpoint(self.output_dir, step, write_model, state, self.config.save_total_limit)
        distributed.barrier()
        return path

    def _open_log(self) -> Any:
        """``metrics.jsonl`` for appending (rank 0 only), without the lines of steps after the resumed checkpoint."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(self.config), sort_keys=False))
        metrics_path = self.output_dir / "metrics.jsonl"
        if metrics_path.exists():
            # Steps logged after the checkpoint being resumed from are run again: drop their old lines.
            kept = [
                line for line in metrics_path.read_text().splitlines() if json.loads(line)["step"] <= self.start_step
            ]
            metrics_path.write_text("".join(line + "\n" for line in kept))
        return metrics_path.open("a")

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
        with self._open_log() if main else nullcontext() as log:
            for step in bar:
                metrics = self.train_step(step)
                history.append(metrics)
                if main and (step + 1) % cfg.logging_steps == 0:
                    log.write(json.dumps(metrics) + "\n")
                    log.flush()
                    if self.tb_writer is not None:
                        for k, v in metrics.items():
                            self.tb_writer.add_scalar(k, v, step + 1)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", tok_s=f"{metrics['rollout/tokens_per_second']:.0f}")
                if main and cfg.log_completions and (step + 1) % cfg.log_completions_steps == 0:
                    self._print_samples(step + 1)
                if (step + 1) % cfg.save_steps == 0 or step + 1 == cfg.max_steps:
                    self.save(step + 1)
        return history

    def _print_samples(self, step: int) -> None:
        for prompt, completion, reward in self._last_samples[: self.config.num_completions_to_print]:
            text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
            tqdm.write(f"[step {step}] reward={reward:.2f}\n  prompt: {text}\n  completion: {completion.strip()}")
