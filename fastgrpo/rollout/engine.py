"""Batched rollout engine with continuous batching over a static per-row KV cache.

A call prefills each distinct prompt once, replicates its cache rows for the ``num_generations`` samples, then
decodes. Every step runs one target forward over the active rows; a row that ends (EOS, a stop string or the
length limit) leaves the batch at once, so the concurrency falls during the call and is recorded per step.
A step emits a variable number of tokens per row, which is what speculative steps plug into.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.runner import decoder_and_head, forward_block
from fastgrpo.rollout.sampling import SamplingParams, process_logits, sample


@dataclass
class GenerationStats:
    """What one generation call did. Per-step lists have one entry per target forward after the prefill."""

    target_forwards: int = 0
    tokens_emitted: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    concurrency: list[int] = field(default_factory=list)
    tokens_per_forward: list[int] = field(default_factory=list)

    @property
    def total_time(self) -> float:
        return self.prefill_time + self.decode_time

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_emitted / max(self.total_time, 1e-9)

    @property
    def concurrency_mean(self) -> float:
        return sum(self.concurrency) / max(len(self.concurrency), 1)


@dataclass
class GenerationOutput:
    """Completions in prompt-major order: row ``p * num_generations + g`` is sample ``g`` of prompt ``p``."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    stats: GenerationStats


@dataclass
class _Batch:
    """State of the active rows; row ``i`` of every tensor is cache row ``i``."""

    ids: torch.Tensor  # [B] index of the completion this row produces
    row_len: torch.Tensor  # [B] filled cache slots
    pending: torch.Tensor  # [B] sampled token not yet written to the cache


class RolloutEngine:
    """Generates completions with a transformers causal LM, driving its decoder directly.

    Args:
        model: the policy; its weights are used as they are (no copy).
        eos_token_ids: ids that end a completion.
        tokenizer: needed only for stop strings.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_ids: list[int],
        tokenizer: PreTrainedTokenizerBase | None = None,
    ):
        self.model = model
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.tokenizer = tokenizer
        self.cache: RowCache | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _cache_for(self, rows: int, length: int) -> RowCache:
        """Reuse the cache buffers when they are big enough (zeroed once at allocation, always finite)."""
        c = self.cache
        if c is None or c.max_rows < rows or c.max_len < length:
            self.cache = None
            c = RowCache(self.model.config, rows, length, self.model.dtype, self.device)
            self.cache = c
        return c

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        num_generations: int = 1,
        generator: torch.Generator | None = None,
    ) -> GenerationOutput:
        """Sample ``num_generations`` completions for each prompt (token id lists, no padding)."""
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt must have at least one token")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine to be built with a tokenizer")
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate(prompt_ids, params, num_generations, generator)
        finally:
            self.model.train(was_training)

    def _generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        num_generations: int,
        generator: torch.Generator | None,
    ) -> GenerationOutput:
        stats = GenerationStats()
        n_rows = len(prompt_ids) * num_generations
        out_ids: list[list[int]] = [[] for _ in range(n_rows)]
        out_lp: list[list[float]] = [[] for _ in range(n_rows)]
        reasons = ["length"] * n_rows
        cache = self._cache_for(n_rows, max(map(len, prompt_ids)) + params.max_new_tokens + 1)

        t0 = time.perf_counter()
        batch, logprobs = self._prefill(cache, prompt_ids, num_generations)
        stats.prefill_time = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._emit(batch, logprobs, params, generator, out_ids, out_lp, reasons, stats)
        batch = self._drop_finished(cache, batch, out_ids, reasons, params)
        while batch.ids.numel():
            stats.concurrency.append(batch.ids.numel())
            stats.tokens_per_forward.append(batch.ids.numel())
            logprobs = self._decode_step(cache, batch)
            stats.target_forwards += 1
            self._emit(batch, logprobs, params, generator, out_ids, out_lp, reasons, stats)
            batch = self._drop_finished(cache, batch, out_ids, reasons, params)
        stats.decode_time = time.perf_counter() - t0
        return GenerationOutput(out_ids, out_lp, reasons, stats)

    def _prefill(
        self, cache: RowCache, prompt_ids: list[list[int]], num_generations: int
    ) -> tuple[_Batch, torch.Tensor]:
        """Prefill each prompt once (right-padded at slot 0), then replicate rows; returns last-position logits."""
        dev = self.device
        lens = torch.tensor([len(p) for p in prompt_ids], device=dev)
        width = int(lens.max())
        ids = torch.zeros(len(prompt_ids), width, dtype=torch.long, device=dev)
        for i, p in enumerate(prompt_ids):
            ids[i, : len(p)] = torch.tensor(p, device=dev)
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
        zeros = torch.zeros(len(prompt_ids), dtype=torch.long, device=dev)
        hidden = forward_block(self.model, cache, ids, zeros, torch.arange(width, device=dev), causal)
        last = hidden[torch.arange(len(prompt_ids), device=dev), lens - 1]
        logits = decoder_and_head(self.model)[1](last)
        rows = torch.arange(len(prompt_ids), device=dev).repeat_interleave(num_generations)
        if num_generations > 1:
            cache.select_rows(rows)
        batch = _Batch(
            ids=torch.arange(rows.numel(), device=dev),
            row_len=lens[rows],
            pending=torch.zeros(rows.numel(), dtype=torch.long, device=dev),
        )
        return batch, logits[rows]

    def _decode_step(self, cache: RowCache, batch: _Batch) -> torch.Tensor:
        """One autoregressive forward: write each row's pending token; returns ``[B, V]`` next-token logits."""
        dev = self.device
        one = torch.ones(1, 1, dtype=torch.bool, device=dev)
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        hidden = forward_block(self.model, cache, batch.pending[:, None], batch.row_len, zero, one)
        batch.row_len = batch.row_len + 1
        return decoder_and_head(self.model)[1](hidden[:, -1])

    def _emit(
        self,
        batch: _Batch,
        logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        out_ids: list[list[int]],
        out_lp: list[list[float]],
        reasons: list[str],
        stats: GenerationStats,
    ) -> None:
        """Sample one token per active row from ``[B, V]`` logits and append it to the row's completion."""
        logprobs = process_logits(logits, params)
        tokens = sample(logprobs, params, generator)
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
        batch.pending = tokens
        is_eos = torch.isin(tokens, self.eos.to(tokens.device))
        for i, tok, lp, eos in zip(batch.ids.tolist(), tokens.tolist(), chosen.tolist(), is_eos.tolist(), strict=False):
            out_ids[i].append(tok)
            out_lp[i].append(lp)
            if eos:
                reasons[i] = "stop"
        stats.tokens_emitted += tokens.numel()

    def _drop_finished(
        self,
        cache: RowCache,
        batch: _Batch,
        out_ids: list[list[int]],
        reasons: list[str],
        params: SamplingParams,
    ) -> _Batch:
        """Remove rows that hit EOS, a stop string or the length limit; compact the cache to the survivors."""
        keep = []
        for pos, i in enumerate(batch.ids.tolist()):
            if reasons[i] != "stop" and params.stop and self._hit_stop(out_ids[i], params.stop):
                reasons[i] = "stop"
            if reasons[i] != "stop" and len(out_ids[i]) < params.max_new_tokens:
                keep.append(pos)
        if len(keep) == batch.ids.numel():
            return batch
        rows = torch.tensor(keep, dtype=torch.long, device=batch.ids.device)
        if keep:
            cache.select_rows(rows, upto=int(batch.row_len.max()))
        return _Batch(ids=batch.ids[rows], row_len=batch.row_len[rows], pending=batch.pending[rows])

    def _hit_stop(self, completion: list[int], stop: tuple[str, ...]) -> bool:
        """Whether the decoded tail of a completion contains a stop string."""
        window = max(len(s) for s in stop) + 8
        text = self.tokenizer.decode(completion[-window:], skip_special_tokens=False)
        return any(s in text for s in stop)
