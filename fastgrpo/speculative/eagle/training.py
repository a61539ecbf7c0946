"""Training the draft head on target hidden states captured while the target runs anyway (rollouts or the GRPO
training forward), never with an extra target forward. Used offline (``fastgrpo draft train``) and online.

Loss per trained position: ``hidden_loss_weight * SmoothL1(predicted h_{j+1}, target h_{j+1})`` plus
``token_loss_weight * CE(target's next-token distribution, draft's)``, averaged over completion positions.

With ``unroll`` > 1 the draft is also trained the way it drafts deeper tree levels (EAGLE-3's training-time test):
at unroll step ``s`` the pair at position ``j + 1`` is ``(embed(x_{j+1}), draft's prediction of h_j)`` made at step
``s - 1``, and it attends to the true pairs up to position ``j + 1 - s`` and to its own drafted ancestors, exactly
what a depth-``s + 1`` tree node sees. The loss is averaged over the steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, get_scheduler

from fastgrpo import distributed
from fastgrpo.config import DraftTrainConfig
from fastgrpo.models import warn_if_bf16_emulated
from fastgrpo.precision import MasterWeights
from fastgrpo.speculative.eagle.head import DraftHead

if TYPE_CHECKING:
    from fastgrpo.rollout.drafter import Rollout
    from fastgrpo.rollout.sequence import GenerationOutput
    from fastgrpo.rollout.stats import GenerationStats


@dataclass
class DraftSample:
    """One sequence for draft training.

    tokens: ``[T + 1]`` token ids ``x_0 .. x_T`` (prompt then completion).
    hidden: ``[T, H]`` the target's final hidden states ``h_0 .. h_{T-1}`` (the last token was never fed).
    prompt_len: tokens of the prompt; positions predicting completion tokens are trained.
    targets: ``[T + 1]`` bool, which tokens the draft learns to predict (False on a tool's results, which the draft
        reads as context only); None: every completion token.
    """

    tokens: torch.Tensor
    hidden: torch.Tensor
    prompt_len: int
    targets: torch.Tensor | None = None


@dataclass
class DraftFit:
    """What one `DraftTrainer.fit` call measured.

    losses: the loss of every update.
    accuracy: the share of trained positions at which the draft's top token equals the token the target emitted
        next, measured by the first epoch's forwards, each on a batch before the update it drives: on data the draft
        has not been trained on (NaN when nothing was trained).
    """

    losses: list[float]
    accuracy: float

    def metrics(self, seconds: float) -> dict[str, float]:
        """Per-step metrics of an online update that took ``seconds``: ``draft/loss`` (the mean over its updates),
        ``draft/accuracy`` and ``draft/time``."""
        loss = sum(self.losses) / len(self.losses) if self.losses else float("nan")
        return {"draft/loss": loss, "draft/accuracy": self.accuracy, "draft/time": seconds}


def unrolled_attention_mask(t: int, step: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, T, (step + 1) * T]`` bool mask of unroll step ``step`` over the keys of steps ``0 .. step``: query
    ``i`` sees step 0's keys ``0 .. i - step`` (true features) and key ``i - step + e`` of each step ``e`` >= 1 (its
    drafted ancestors, then itself)."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    blocks = [j <= i - step] + [j == i - step + e for e in range(1, step + 1)]
    return torch.cat(blocks, dim=1)[None, None]


def budget_samples(samples: list[DraftSample], tree_share: float, min_share: float) -> tuple[list[DraftSample], float]:
    """The completions an online update trains on: while the controller keeps plain steps a draft update buys
    nothing in that rollout, so the share trained on follows ``tree_share`` (the share of decoding steps that ran a
    tree), at least ``min_share`` so that the draft keeps learning. They are evenly spaced over the rollout (every
    prompt's group keeps some). Returns them and the share actually taken."""
    share = max(min_share, min(tree_share, 1.0))
    count = max(1, math.ceil(share * len(samples)))
    if count >= len(samples):
        return samples, 1.0
    index = torch.linspace(0, len(samples) - 1, count, device="cpu").round().long().tolist()
    return [samples[i] for i in index], count / len(samples)


def rollout_samples(prompt_ids: list[list[int]], out: GenerationOutput, num_generations: int) -> list[DraftSample]:
    """One sample per completion of a rollout (a `GenerationOutput` made with ``capture_hidden``): row ``i`` is a
    completion of prompt ``i // num_generations``; a tool's result tokens are not targets."""
    samples = []
    for i, (c, h) in enumerate(zip(out.completion_ids, out.hidden_states, strict=True)):
        prompt = prompt_ids[i // num_generations]
        targets = None
        if out.tool_masks is not None and not all(out.tool_masks[i]):
            targets = torch.tensor([1] * len(prompt) + out.tool_masks[i], dtype=torch.bool, device="cpu")
        samples.append(DraftSample(torch.tensor(prompt + c, device="cpu"), h, len(prompt), targets))
    return samples


def pack_by_budget(lengths: list[int], budget: int) -> list[list[int]]:
    """Group sample indices (longest first) so that rows x longest length stays within ``budget`` tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class DraftTrainer:
    """Fits a `DraftHead` with AdamW; the target's embedding and LM head are used frozen (no gradient).

    Under torch.distributed the draft's forward runs under DDP: every rank trains on its own rollouts, the
    gradients are averaged, and the drafts of all ranks stay identical."""

    def __init__(self, draft: DraftHead, embed: nn.Module, lm_head: nn.Module, config: DraftTrainConfig):
        config.validate()
        self.draft, self.embed, self.lm_head, self.config = draft, embed, lm_head, config
        if config.bf16:
            warn_if_bf16_emulated("draft_training.bf16", next(draft.parameters()).device)
        self.forward = distributed.wrap_ddp(draft)
        # A bfloat16 draft (a GPU rollout's dtype) is updated through float32 master weights, as the policy is. Its
        # optimizer holds the same parameters either way (frozen ones too, which get no gradient and are skipped), so
        # that its state loads into a run of the other dtype.
        params = list(draft.parameters())
        self.masters = MasterWeights(params) if MasterWeights.needed(params) else None
        self.optimizer = torch.optim.AdamW(
            self.masters.copies if self.masters is not None else params, lr=config.learning_rate
        )

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state (and, for a low-precision draft, the float32 master weights) to save with a checkpoint."""
        state = self.optimizer.state_dict()
        return state if self.masters is None else {"optimizer": state, "master_weights": self.masters.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved; a state saved without master weights leaves them as the draft's
        weights."""
        if "master_weights" in state:
            if self.masters is not None:
                self.masters.load_state_dict(state["master_weights"])
            state = state["optimizer"]
        self.optimizer.load_state_dict(state)

    def _batch(self, samples: list[DraftSample]) -> tuple[torch.Tensor, ...]:
        """Right-padded ``[B, T]`` next tokens, ``[B, T, H]`` hidden states, ``[B, T]`` attention and loss masks."""
        dev = next(self.draft.parameters()).device
        width = max(s.hidden.shape[0] for s in samples)
        b, h = len(samples), samples[0].hidden.shape[-1]
        nxt = torch.zeros(b, width, dtype=torch.long, device=dev)
        hid = torch.zeros(b, width, h, dtype=samples[0].hidden.dtype, device=dev)
        attn = torch.zeros(b, width, dtype=torch.long, device=dev)
        train = torch.zeros(b, width, dtype=torch.bool, device=dev)
        for i, s in enumerate(samples):
            t = s.hidden.shape[0]
            nxt[i, :t] = s.tokens[1 : t + 1]
            hid[i, :t] = s.hidden
            attn[i, :t] = 1
            # Pair j predicts h_{j+1} (known for j < t - 1), whose LM head gives x_{j+2}: train on completions.
            train[i, max(s.prompt_len - 2, 0) : t - 1] = True
            if s.targets is not None:  # not on a tool's results
                train[i, : t - 1] &= s.targets[2 : t + 1].to(dev)
        return nxt, hid, attn, train

    def loss(self, samples: list[DraftSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """The weighted draft loss over the trained positions of a batch of samples, and the ``[2]`` counts (hits,
        positions) of the draft's top token (teacher-forced) against the token emitted next."""
        nxt, hid, attn, train = self._batch(samples)
        with torch.autocast(nxt.device.type, dtype=torch.bfloat16, enabled=self.config.bf16):
            return self._loss(nxt, hid, attn, train)

    def _loss(
        self, nxt: torch.Tensor, hid: torch.Tensor, attn: torch.Tensor, train: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = nxt.shape
        positions = torch.arange(1, t + 1, device=nxt.device).expand(b, t)
        with torch.no_grad():
            embeds = self.embed(nxt)
        if self.config.unroll == 1:
            pred = self.forward(embeds, hid, attention_mask=attn, position_ids=positions)
            return self._step_loss(pred, hid, nxt, train)
        steps = [
            # Rows before position ``step`` have no drafted ancestors: not trained at that step.
            self._step_loss(pred, hid, nxt, train & (positions > step))
            for step, pred in enumerate(self.unrolled_predictions(embeds, hid, positions))
        ]
        return sum(loss for loss, _ in steps) / len(steps), steps[0][1]

    def unrolled_predictions(
        self, embeds: torch.Tensor, hid: torch.Tensor, positions: torch.Tensor
    ) -> list[torch.Tensor]:
        """The draft's ``[B, T, H]`` predictions at each of ``unroll`` steps (see the module docstring): row ``j`` of
        step ``s`` predicts ``h_{j+1}`` as a depth-``s + 1`` tree node would, from ``s`` drafted ancestors.

        Args:
            embeds: ``[B, T, H]`` embeddings of the next tokens ``x_1 .. x_T``.
            hid: ``[B, T, H]`` target hidden states ``h_0 .. h_{T-1}`` (right-padded rows).
            positions: ``[B, T]`` position ids ``1 .. T``.
        """
        t = embeds.shape[1]
        cache, inputs, preds = DynamicCache(), hid, []
        for step in range(self.config.unroll):
            mask = unrolled_attention_mask(t, step, embeds.device)
            preds.append(
                self.forward(embeds, inputs, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
            )
            inputs = torch.cat([hid[:, :1], preds[-1][:, :-1]], dim=1)
        return preds

    def _step_loss(
        self, pred: torch.Tensor, hid: torch.Tensor, nxt: torch.Tensor, train: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted loss of ``[B, T, H]`` predictions (row ``j`` predicts ``hid[:, j + 1]``, whose LM head gives
        ``nxt[:, j + 1]``) over ``train`` rows, and the ``[2]`` counts (hits, positions) of the draft's top token."""
        rows = train[:, :-1]
        pred = pred[:, :-1][rows]
        target = hid[:, 1:][rows].to(pred.dtype)
        hidden_loss = F.smooth_l1_loss(pred, target)
        with torch.no_grad():
            # The target's distribution over the draft's vocabulary (the whole one unless reduced).
            target_logits = self.draft.logits(target, self.lm_head)
            target_probs = torch.softmax(target_logits.float(), dim=-1)
        draft_logp = torch.log_softmax(self.draft.logits(pred, self.lm_head).float(), dim=-1)
        token_loss = -(target_probs * draft_logp).sum(-1).mean()
        with torch.no_grad():
            hits = (self.draft.to_target_ids(draft_logp.argmax(-1)) == nxt[:, 1:][rows]).sum()
        counts = torch.stack([hits, torch.tensor(len(pred), device=hits.device)]).float()
        return self.config.hidden_loss_weight * hidden_loss + self.config.token_loss_weight * token_loss, counts

    def fit_online(
        self, samples: list[DraftSample], rollouts: list[GenerationStats], drafter: str = "eagle"
    ) -> dict[str, float]:
        """One online update on the completions of ``rollouts`` (``samples``, from `rollout_samples`): on all of them
        when every decoding step ran a tree of this draft (``drafter``, alone or merged), on fewer as fewer did
        (`budget_samples`, with that share of the rank that ran most, so that every rank takes the same share).
        Returns `DraftFit.metrics` with ``draft/trained_share`` and ``draft/tree_share``, which say why."""
        t0 = time.perf_counter()
        steps = sum(len(stats.concurrency) for stats in rollouts)
        trees = sum(stats.drafter_trees.get(drafter, 0) for stats in rollouts)
        tree_share = max(distributed.gather(trees / max(steps, 1)))
        samples, share = budget_samples(samples, tree_share, self.config.min_share)
        fit = self.fit(samples)
        return {**fit.metrics(time.perf_counter() - t0), "draft/trained_share": share, "draft/tree_share": tree_share}

    def fit(self, samples: list[DraftSample], progress: bool = False) -> DraftFit:
        """``epochs`` passes over ``samples`` packed by the token budget; returns the loss of every update and the
        draft's accuracy on the samples before it trained on them (see `DraftFit`).

        Under torch.distributed every rank makes as many updates as the rank with the most batches; a rank that has
        run out adds a zero loss, so that its gradient counts as zero in the average."""
        from tqdm.auto import tqdm

        usable = [s for s in samples if s.hidden.shape[0] >= 2]
        batches = pack_by_budget([s.hidden.shape[0] for s in usable], self.config.token_budget)
        n_updates = distributed.max_over_ranks(len(batches))
        if n_updates and not batches:
            raise RuntimeError("draft training: this rank has no sequence of at least 2 tokens to train on")
        total = self.config.epochs * n_updates
        scheduler = get_scheduler(
            self.config.lr_scheduler_type,
            self.optimizer,
            num_warmup_steps=int(self.config.warmup_ratio * total),
            num_training_steps=total,
        )
        self.draft.train()
        losses, counts = [], torch.zeros(2, device="cpu")
        for epoch in range(self.config.epochs):
            for i in tqdm(range(n_updates), desc="draft", disable=not progress):
                loss, batch_counts = self.loss([usable[j] for j in batches[min(i, len(batches) - 1)]])
                if epoch == 0 and i < len(batches):
                    counts += batch_counts.cpu()
                if i >= len(batches):
                    loss = loss * 0.0
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if self.masters is not None:
                    self.masters.take_grads(zero_missing=False)
                optimized = [p for group in self.optimizer.param_groups for p in group["params"]]
                torch.nn.utils.clip_grad_norm_(optimized, self.config.max_grad_norm)
                self.optimizer.step()
                if self.masters is not None:
                    self.masters.write_back()
                scheduler.step()
                if i < len(batches):
                    losses.append(float(loss.detach()))
        self.draft.eval()
        return DraftFit(losses, float(counts[0] / counts[1]) if counts[1] else float("nan"))


class EagleLearner:
    """Online learning of the EAGLE drafter (`fastgrpo.rollout.drafter.Learner`): ``trainer`` fits the draft on the
    hidden states the rollouts captured; its state is the optimizer's."""

    captures_hidden = True

    def __init__(self, trainer: DraftTrainer):
        self.trainer = trainer

    def learn(self, rollouts: list[Rollout]) -> dict[str, float]:
        samples = [s for r in rollouts for s in rollout_samples(r.prompt_ids, r.output, r.num_generations)]
        return self.trainer.fit_online(samples, [r.output.stats for r in rollouts])

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)
