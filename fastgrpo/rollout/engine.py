"""Batched rollout engine with continuous batching over a static per-row KV cache.

A call prefills each distinct prompt once, replicates its cache rows for the ``num_generations`` samples, then
decodes. Every step runs one target forward over the active rows and emits a variable number of tokens per row:
one for an autoregressive step, the accepted path plus one for a speculative step, where a draft head proposes a
tree per row and the target verifies all trees in one forward. A row that ends (EOS, a stop string or the length
limit) leaves the batch at once, so the concurrency falls during the call; it is recorded per step.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastgrpo.rollout.attention import rollout_attention
from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.linear import rollout_linears
from fastgrpo.rollout.lora import merged_lora
from fastgrpo.rollout.runner import decoder_and_head, forward_block, forward_chain
from fastgrpo.rollout.sampling import SamplingParams, process_logits, sample
from fastgrpo.rollout.verify import accept
from fastgrpo.spec.controller import Controller, StaticController
from fastgrpo.spec.draft import DraftHead
from fastgrpo.spec.tree import TreeShape, expand_tree


@dataclass
class GenerationStats:
    """What one generation call did. Per-step lists have one entry per target forward after the prefill."""

    target_forwards: int = 0
    draft_forwards: int = 0
    tokens_emitted: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    concurrency: list[int] = field(default_factory=list)
    tokens_per_forward: list[int] = field(default_factory=list)  # tokens emitted by each decoding forward
    step_times: list[float] = field(default_factory=list)  # seconds of each decoding step, bookkeeping included
    tree_nodes: list[int] = field(default_factory=list)
    depth_offered: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)

    @property
    def total_time(self) -> float:
        return self.prefill_time + self.decode_time

    @property
    def bookkeeping_time(self) -> float:
        return self.decode_time - self.draft_time - self.verify_time

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_emitted / max(self.total_time, 1e-9)

    @property
    def concurrency_mean(self) -> float:
        return sum(self.concurrency) / max(len(self.concurrency), 1)

    @property
    def decode_tokens(self) -> int:
        """Tokens emitted by decoding forwards (the first token of each row comes from the prefill)."""
        return sum(self.tokens_per_forward)

    @property
    def n_verify_mean(self) -> float:
        """Mean tokens verified per row per target forward (1 for autoregressive steps)."""
        steps = len(self.concurrency)
        return (sum(self.tree_nodes) + steps - len(self.tree_nodes)) / max(steps, 1)

    @property
    def accept_length(self) -> float:
        """Tokens emitted per row per decoding forward (1.0 for autoregressive decoding)."""
        return self.decode_tokens / max(sum(self.concurrency), 1)

    @property
    def tree_accept_length(self) -> float:
        """1 + draft tokens accepted per row per speculative step: the draft's acceptance, apart from how often the
        controller chose a tree (`accept_length` counts plain steps as 1.0). NaN without a speculative step."""
        if not self.depth_offered:
            return float("nan")
        return 1.0 + sum(self.depth_accepted) / self.depth_offered[0]

    @property
    def acceptance_by_depth(self) -> list[float]:
        """For each draft depth d (1-based), the fraction of offered depth-d paths whose token was accepted."""
        return [a / o if o else 0.0 for a, o in zip(self.depth_accepted, self.depth_offered, strict=True)]

    def record_depths(self, tree_depth: torch.Tensor, accepted: torch.Tensor) -> None:
        """``tree_depth`` ``[B]`` deepest node per row, ``accepted`` ``[B]`` accepted draft tokens per row."""
        for d in range(1, int(tree_depth.max()) + 1):
            if len(self.depth_offered) < d:
                self.depth_offered.append(0)
                self.depth_accepted.append(0)
            self.depth_offered[d - 1] += int((tree_depth >= d).sum())
            self.depth_accepted[d - 1] += int((accepted >= d).sum())


@dataclass
class GenerationOutput:
    """Completions in prompt-major order: row ``p * num_generations + g`` is sample ``g`` of prompt ``p``."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    stats: GenerationStats
    hidden_states: list[torch.Tensor] | None = None
    """With ``capture_hidden``: per row ``[prompt + completion - 1, H]`` target final hidden states of every token
    that was fed to the target (all but the last), from the forwards the decoding ran anyway."""


@dataclass
class _Batch:
    """State of the active rows; row ``i`` of every tensor is cache row ``i`` (target and draft caches).

    With a draft, ``pend_tok``/``pend_hid`` ``[B, C + 1]``/``[B, C + 1, H]`` hold the (token, preceding target
    hidden state) pairs that the draft cache has not consumed yet, the first ``pend_n[b]`` of row ``b``; the capacity
    ``C`` grows by doubling and the last column is a spare one that scatters of nothing write to.
    """

    ids: torch.Tensor  # [B] index of the completion this row produces
    row_len: torch.Tensor  # [B] filled target cache slots
    pending: torch.Tensor  # [B] emitted token not yet written to the target cache
    emitted: torch.Tensor  # [B] tokens of the completion so far
    draft_len: torch.Tensor | None = None  # [B] filled draft cache slots
    pend_tok: torch.Tensor | None = None
    pend_hid: torch.Tensor | None = None
    pend_n: torch.Tensor | None = None

    def select(self, rows: torch.Tensor) -> _Batch:
        return _Batch(*(None if t is None else t[rows] for t in vars(self).values()))

    def push_pairs(self, tokens: torch.Tensor, hidden: torch.Tensor, count: torch.Tensor) -> None:
        """Append ``count[b]`` (token ``[B, E]``, hidden ``[B, E, H]``) pairs to each row's pending pairs."""
        b, e = tokens.shape
        need, cap = int((self.pend_n + count).max()), self.pend_tok.shape[1] - 1
        if need > cap:
            grown = max(need, 2 * cap)
            new_tok = self.pend_tok.new_zeros(b, grown + 1)
            new_hid = self.pend_hid.new_zeros(b, grown + 1, hidden.shape[-1])
            new_tok[:, :cap], new_hid[:, :cap] = self.pend_tok[:, :cap], self.pend_hid[:, :cap]
            self.pend_tok, self.pend_hid, cap = new_tok, new_hid, grown
        steps = torch.arange(e, device=tokens.device)[None, :]
        index = torch.where(steps < count[:, None], self.pend_n[:, None] + steps, cap)  # the spare column
        rows = torch.arange(b, device=tokens.device)[:, None]
        self.pend_tok[rows, index] = tokens  # index assignment, not scatter_ (slow on bfloat16, see cache.py)
        self.pend_hid[rows, index] = hidden.to(self.pend_hid.dtype)
        self.pend_n = self.pend_n + count


def _fill_holes(keep: list[int]) -> list[int]:
    """New order of the rows after dropping finished ones (``keep``: the kept positions, ascending): a kept row
    stays where it is unless it lies past the new batch size, then it moves into the slot of a finished row, so
    the caches copy one row per finished row instead of shifting every row after it."""
    kept, tail = set(keep), [p for p in keep if p >= len(keep)]
    return [p if p in kept else tail.pop() for p in range(len(keep))]


class RolloutEngine:
    """Generates completions with a transformers causal LM, driving its decoder directly.

    Args:
        model: the policy; its weights are used as they are (no copy).
        eos_token_ids: ids that end a completion.
        tokenizer: needed only for stop strings.
        draft: an EAGLE-style draft head for speculative steps (None: autoregressive only).
        tree: a static tree shape for every speculative step; ``nodes == 1`` is a plain autoregressive step.
        controller: instead of ``tree``, chooses each step's shape from the number of active rows.
        merge_lora: run a peft LoRA policy with its adapters merged into the base weights during each call (see
            `fastgrpo.rollout.lora`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_ids: list[int],
        tokenizer: PreTrainedTokenizerBase | None = None,
        draft: DraftHead | None = None,
        tree: TreeShape | None = None,
        controller: Controller | None = None,
        merge_lora: bool = True,
    ):
        if tree is not None and controller is not None:
            raise ValueError("give a static tree shape or a controller, not both")
        if tree is not None:
            controller = StaticController(tree)
        if (draft is None) != (controller is None):
            raise ValueError("speculative decoding needs both a draft and a tree shape or controller")
        self.model = model
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.tokenizer = tokenizer
        self.draft = draft
        self.controller = controller
        self.merge_lora = merge_lora
        self.cache: RowCache | None = None
        self.draft_cache: RowCache | None = None
        self._backlog_seconds = 0.0  # catch-up time of the last speculative step that belongs to earlier plain steps
        self._draft_state: tuple[tuple[int, int], ...] | None = None  # see `_draft_changed`

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _draft_changed(self) -> bool:
        """Whether the draft's weights changed since the previous call (an optimizer step or a load writes them in
        place, which bumps each tensor's version counter); True on the first call."""
        if self.draft is None:
            return False
        state = tuple((p.data_ptr(), p._version) for p in self.draft.parameters())
        changed, self._draft_state = state != self._draft_state, state
        return changed

    def _caches(self, rows: int, length: int) -> RowCache:
        """Reuse the cache buffers when big enough (zeroed once at allocation, so always finite)."""
        bound = self.controller.max_shape if self.controller else None
        extra = bound.nodes if bound else 1
        if self.cache is None or self.cache.max_rows < rows or self.cache.max_len < length + extra:
            self.cache = None
            self.cache = RowCache(self.model.config, rows, length + extra, self.model.dtype, self.device)
        if self.draft is not None:
            # Room for the context, a catch-up block as long as the longest row's pending pairs, and a tree.
            need = 2 * length + bound.depth * bound.top_k
            c = self.draft_cache
            if c is None or c.max_rows < rows or c.max_len < need:
                self.draft_cache = None
                self.draft_cache = RowCache(self.draft.body.config, rows, need, self.model.dtype, self.device)
        return self.cache

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        num_generations: int = 1,
        generator: torch.Generator | None = None,
        capture_hidden: bool = False,
        uniforms: torch.Tensor | None = None,
    ) -> GenerationOutput:
        """Sample ``num_generations`` completions for each prompt (token id lists, no padding).

        ``capture_hidden`` also returns the target's hidden states (for draft training). When sampling, the token at
        each (completion, position) is chosen by one uniform: ``uniforms`` ``[len(prompt_ids) * num_generations,
        max_new_tokens]`` gives them, otherwise they are drawn from ``generator``."""
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt must have at least one token")
        expected = (len(prompt_ids) * num_generations, params.max_new_tokens)
        if uniforms is not None and tuple(uniforms.shape) != expected:
            raise ValueError(f"uniforms must have shape {expected}, got {tuple(uniforms.shape)}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine to be built with a tokenizer")
        was_training = self.model.training
        self.model.eval()
        try:
            with (
                merged_lora(self.model) if self.merge_lora else nullcontext(),
                rollout_attention(self.model, self.draft.decoder if self.draft is not None else None),
                rollout_linears(self.model, self.draft),
            ):
                return self._generate(prompt_ids, params, num_generations, generator, capture_hidden, uniforms)
        finally:
            self.model.train(was_training)

    def _generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        num_generations: int,
        generator: torch.Generator | None,
        capture_hidden: bool,
        uniforms: torch.Tensor | None,
    ) -> GenerationOutput:
        stats = GenerationStats()
        n_rows = len(prompt_ids) * num_generations
        out = GenerationOutput([[] for _ in range(n_rows)], [[] for _ in range(n_rows)], ["length"] * n_rows, stats)
        cache = self._caches(n_rows, max(map(len, prompt_ids)) + params.max_new_tokens + 1)
        if self.controller is not None:
            self.controller.begin(draft_changed=self._draft_changed())

        t0 = time.perf_counter()
        batch, logits, hidden, prompt_hidden = self._prefill(cache, prompt_ids, num_generations)
        captured = None
        if capture_hidden:
            captured = [
                [prompt_hidden[i // num_generations, : len(prompt_ids[i // num_generations])]] for i in range(n_rows)
            ]
        noise = None
        if not params.greedy:  # one uniform per (completion, position), see `sample`
            noise = uniforms
            if noise is None:
                where = generator.device if generator is not None else torch.device("cpu")
                shape = (n_rows, params.max_new_tokens)
                noise = torch.rand(shape, generator=generator, dtype=torch.float64, device=where)
            noise = noise.to(device=batch.ids.device, dtype=torch.float64)
        logprobs = process_logits(logits, params)
        first = sample(logprobs, params, None if noise is None else noise[:, 0])
        ones = torch.ones_like(first)
        if self.draft is not None:
            batch.push_pairs(first[:, None], hidden[:, None], ones)
        stats.prefill_time = time.perf_counter() - t0
        t0 = time.perf_counter()
        batch = self._emit(batch, first[:, None], logprobs.gather(1, first[:, None]), ones, params, out)
        while batch.ids.numel():
            rows = batch.ids.numel()
            stats.concurrency.append(rows)
            step_start = time.perf_counter()
            backlog = int(batch.pend_n.max()) if self.draft is not None else 0
            shape = self.controller.choose(rows, backlog) if self.controller else None
            path_rank = None
            if shape is not None and shape.speculative:
                tokens, lps, count, fed, path_rank = self._speculative_step(batch, shape, params, noise, stats)
            else:
                tokens, lps, count, fed = self._autoregressive_step(batch, params, noise, stats)
            stats.target_forwards += 1
            if captured is not None:
                for b, (i, n) in enumerate(zip(batch.ids.tolist(), count.tolist(), strict=True)):
                    captured[i].append(fed[b, :n])
            emitted_before = stats.tokens_emitted
            accepted = count - 1
            batch = self._emit(batch, tokens, lps, count, params, out)
            stats.tokens_per_forward.append(stats.tokens_emitted - emitted_before)
            stats.step_times.append(time.perf_counter() - step_start)
            if shape is not None:
                seconds = stats.step_times[-1] - (self._backlog_seconds if shape.speculative else 0.0)
                self.controller.observe(rows, shape, seconds, accepted, path_rank)
        stats.decode_time = time.perf_counter() - t0
        if captured is not None:
            out.hidden_states = [
                torch.cat(parts)[: len(prompt_ids[i // num_generations]) + len(out.completion_ids[i]) - 1]
                for i, parts in enumerate(captured)
            ]
        return out

    def _prefill(
        self, cache: RowCache, prompt_ids: list[list[int]], num_generations: int
    ) -> tuple[_Batch, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill each prompt once (right-padded at slot 0), then replicate rows.

        Returns the batch, ``[R, V]`` last-position logits, ``[R, H]`` last-position hidden states and the
        ``[P, T, H]`` hidden states of every prompt position.
        """
        dev = self.device
        lens = torch.tensor([len(p) for p in prompt_ids], device=dev)
        ids = torch.zeros(len(prompt_ids), int(lens.max()), dtype=torch.long, device=dev)
        for i, p in enumerate(prompt_ids):
            ids[i, : len(p)] = torch.tensor(p, device=dev)
        decoder, head = decoder_and_head(self.model)
        hidden = forward_chain(decoder, cache, torch.zeros_like(lens), input_ids=ids)
        last = hidden[torch.arange(len(prompt_ids), device=dev), lens - 1]
        rows = torch.arange(len(prompt_ids), device=dev).repeat_interleave(num_generations)
        if num_generations > 1:
            cache.select_rows(rows, upto=ids.shape[1])
        zeros = torch.zeros_like(rows)
        batch = _Batch(ids=torch.arange(rows.numel(), device=dev), row_len=lens[rows], pending=zeros, emitted=zeros)
        if self.draft is not None:
            # Pairs (x_{j+1}, h_j) of the prompt; the pair of the first sampled token is pushed by the caller.
            pairs = lens - 1
            batch.draft_len = torch.zeros_like(batch.row_len)
            spare = torch.zeros(rows.numel(), 1, dtype=ids.dtype, device=dev)
            batch.pend_tok = torch.cat([ids[rows, 1:], spare], 1)
            batch.pend_hid = torch.cat([hidden[rows, :-1], hidden.new_zeros(rows.numel(), 1, hidden.shape[-1])], 1)
            batch.pend_n = pairs[rows]
        return batch, head(last)[rows], last[rows], hidden

    @staticmethod
    def _uniforms(noise: torch.Tensor | None, batch: _Batch, width: int) -> torch.Tensor | None:
        """``[B, width]`` uniforms of each row's next ``width`` completion positions (None when greedy)."""
        if noise is None:
            return None
        cols = batch.emitted[:, None] + torch.arange(width, device=noise.device)[None, :]
        return noise[batch.ids[:, None], cols.clamp(max=noise.shape[1] - 1)]

    def _autoregressive_step(
        self, batch: _Batch, params: SamplingParams, noise: torch.Tensor | None, stats: GenerationStats
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One target forward over each row's pending token.

        Returns ``[B, 1]`` tokens and log-probs, ``[B]`` counts (ones) and the ``[B, 1, H]`` hidden state of the
        fed token."""
        t0 = time.perf_counter()
        decoder, head = decoder_and_head(self.model)
        hidden = forward_chain(decoder, self.cache, batch.row_len, input_ids=batch.pending[:, None])
        logprobs = process_logits(head(hidden[:, -1]), params)
        uniforms = self._uniforms(noise, batch, 1)
        tokens = sample(logprobs, params, None if uniforms is None else uniforms[:, 0])
        batch.row_len = batch.row_len + 1
        ones = torch.ones_like(tokens)
        if self.draft is not None:
            batch.push_pairs(tokens[:, None], hidden, ones)
        stats.verify_time += time.perf_counter() - t0
        return tokens[:, None], logprobs.gather(1, tokens[:, None]), ones, hidden

    def _draft_catch_up(self, batch: _Batch) -> torch.Tensor:
        """Feed the pending pairs to the draft cache; returns ``[B, H]`` the draft's output for each row's last
        pair (the root of the next tree)."""
        embed = self.model.get_input_embeddings()
        width = int(batch.pend_n.max())
        x = self.draft.features(embed(batch.pend_tok[:, :width]), batch.pend_hid[:, :width])
        out = forward_chain(self.draft.decoder, self.draft_cache, batch.draft_len, inputs_embeds=x, position_offset=1)
        root = out[torch.arange(out.shape[0], device=out.device), batch.pend_n - 1]
        batch.draft_len = batch.draft_len + batch.pend_n
        batch.pend_n = torch.zeros_like(batch.pend_n)
        return root

    def _speculative_step(
        self,
        batch: _Batch,
        shape: TreeShape,
        params: SamplingParams,
        noise: torch.Tensor | None,
        stats: GenerationStats,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft a tree of ``shape`` per row, verify all trees in one target forward, accept a path per row.

        Returns ``[B, D]`` emitted tokens and log-probs, ``[B]`` counts, ``[B, D, H]`` hidden states of the
        accepted path (the tokens now in the cache) and ``[B, D - 1]`` the score rank of each accepted draft node
        (``N`` past the row's accepted ones), from which the controller tells what smaller trees would have
        accepted."""
        t0 = time.perf_counter()
        backlog = float(batch.pend_n.float().mean())
        root_hidden = self._draft_catch_up(batch)
        # After plain steps the catch-up also feeds their tokens: that share is their cost, not this tree's.
        self._backlog_seconds = (time.perf_counter() - t0) * max(0.0, 1.0 - (shape.depth + 1) / backlog)
        embed = self.model.get_input_embeddings()
        decoder, head = decoder_and_head(self.model)
        tree = expand_tree(
            self.draft, embed, head, self.draft_cache, batch.draft_len, batch.pending, root_hidden, batch.row_len, shape
        )
        stats.draft_forwards += shape.levels
        t1 = time.perf_counter()
        n = tree.tokens.shape[1]
        offsets = torch.arange(n, device=tree.tokens.device)
        positions = batch.row_len[:, None] + tree.depth
        hidden = forward_block(
            decoder, self.cache, batch.row_len, offsets, positions, tree.ancestors, input_ids=tree.tokens
        )
        result = accept(tree, head(hidden), params, self._uniforms(noise, batch, int(tree.depth.max()) + 1))
        t2 = time.perf_counter()
        # Move the accepted path's cache entries to contiguous slots right after the row's context.
        path = result.path
        steps = torch.arange(path.shape[1], device=path.device)[None, :]
        src = batch.row_len[:, None] + torch.where(path >= 0, path, steps)
        self.cache.move_slots(src, batch.row_len[:, None] + steps)
        batch.row_len = batch.row_len + result.length
        path_hidden = hidden.gather(1, path.clamp(min=0)[:, :, None].expand(-1, -1, hidden.shape[-1]))
        batch.push_pairs(result.tokens, path_hidden, result.length)
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        stats.tree_nodes.append(n)
        stats.record_depths(tree.depth.max(dim=1).values, result.length - 1)
        drafted = path[:, 1:]
        path_rank = torch.where(drafted >= 0, tree.rank.gather(1, drafted.clamp(min=0)), n)
        return result.tokens, result.logprobs, result.length, path_hidden, path_rank

    def _emit(
        self,
        batch: _Batch,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        count: torch.Tensor,
        params: SamplingParams,
        out: GenerationOutput,
    ) -> _Batch:
        """Append the first ``count[b]`` of ``[B, E]`` tokens to each row's completion, stopping a row at EOS, a
        stop string or the length limit (even inside an accepted path); drop finished rows from the batch."""
        is_eos = torch.isin(tokens, self.eos.to(tokens.device)).tolist()
        keep = []
        emitted = 0
        for pos, (i, toks, lps, n) in enumerate(
            zip(batch.ids.tolist(), tokens.tolist(), logprobs.tolist(), count.tolist(), strict=True)
        ):
            ids, done = out.completion_ids[i], False
            for j in range(n):
                ids.append(toks[j])
                out.logprobs[i].append(lps[j])
                emitted += 1
                if is_eos[pos][j] or (params.stop and self._hit_stop(ids, params.stop)):
                    out.finish_reasons[i] = "stop"
                    done = True
                if done or len(ids) >= params.max_new_tokens:
                    done = True
                    break
            if not done:
                keep.append(pos)
        out.stats.tokens_emitted += emitted
        last = tokens.gather(1, (count - 1).clamp(min=0)[:, None]).squeeze(1)
        batch.pending = last
        batch.emitted = batch.emitted + count
        if len(keep) == batch.ids.numel():
            return batch
        rows = torch.tensor(_fill_holes(keep), dtype=torch.long, device=batch.ids.device)
        if keep:
            self.cache.select_rows(rows, upto=int(batch.row_len.max()))
            if self.draft is not None:
                self.draft_cache.select_rows(rows, upto=int(batch.draft_len.max()))
        return batch.select(rows)

    def _hit_stop(self, completion: list[int], stop: tuple[str, ...]) -> bool:
        """Whether the decoded tail of a completion contains a stop string."""
        window = max(len(s) for s in stop) + 8
        text = self.tokenizer.decode(completion[-window:], skip_special_tokens=False)
        return any(s in text for s in stop)
