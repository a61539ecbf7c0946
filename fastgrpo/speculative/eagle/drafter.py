"""The EAGLE drafter: a learned draft head (`DraftHead`) that reads the target's hidden states and proposes
EAGLE-2 style trees: expand the top-K children of the best K nodes per level, then keep the best ``N - 1`` nodes by
cumulative log-probability. Every row of the batch is expanded at once (no loop over rows).

A child's cumulative log-probability never exceeds its parent's, so the kept nodes always form a tree rooted at the
row's pending token (node 0). Ties are broken towards shallower nodes for the same reason.

The draft runs with a KV cache of its own, one row per engine row. It reads a row's tokens lazily: each emitted
token and the target hidden state before it form a pair that waits in `PendingPairs` until the next tree, whose first
draft forward reads them all (the catch-up); plain steps therefore cost the draft nothing.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from fastgrpo.rollout.cache import SLOT_ALIGN, RowCache, aligned, read_slots
from fastgrpo.rollout.compiled import Compiled, RowPadding, map_tensors
from fastgrpo.rollout.drafter import Drafter, Emitted, Learner, Prefill, Proposal
from fastgrpo.rollout.sequence import ActiveRows
from fastgrpo.rollout.shape_menu import depth_bucket, star_tree
from fastgrpo.rollout.tree import DraftTree, TreeShape, empty_tree
from fastgrpo.speculative.eagle.expansion import catch_up, draft_step, expand_tree
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.profiler import LatencyProfile

NAME = "eagle"
# Pending pairs per row a compiled proposal reads in its own graph, always this many columns (a row's unused ones cost
# one draft layer's work on padding, one shape instead of several); a longer backlog, after a prompt or a run of plain
# steps, is read by an eager catch-up first.
CATCH_UP_WIDTH = 8


@dataclass
class EagleCost:
    """What the EAGLE head's trees cost, from the latency profile's timing of one draft level (`CostProbe` of
    `fastgrpo.speculative.eagle.plugin.EaglePlugin`): a tree of ``shape`` over ``rows`` rows runs one level over
    ``rows * K`` tokens per level, plus reading ``backlog`` pending tokens per row beyond the one a tree always
    reads."""

    profile: LatencyProfile
    _trees: dict[tuple[int, TreeShape], float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __call__(self, rows: int, shape: TreeShape, backlog: int = 1) -> float:
        if not shape.speculative:
            return 0.0
        level = partial(self.profile.drafter_time, NAME)
        seconds = self._trees.get((rows, shape))
        if seconds is None:  # looked up once: the controller prices every candidate at every step
            seconds = self._trees[rows, shape] = shape.levels * level(rows * shape.top_k)
        if backlog > 1:
            seconds += level(rows * backlog) - level(rows)
        return seconds


@dataclass
class PendingPairs:
    """The draft's per-row state: ``draft_len`` ``[B]`` filled draft cache slots, and the (token, preceding target
    hidden state) pairs ``tokens``/``hidden`` ``[B, C + 1]``/``[B, C + 1, H]`` that the draft cache has not read yet,
    the first ``count[b]`` of row ``b``; the capacity ``C`` grows by doubling and the last column is a spare one that
    writes of nothing go to. ``host_len`` and ``host_count`` hold ``draft_len`` and ``count`` on the host."""

    draft_len: torch.Tensor
    tokens: torch.Tensor
    hidden: torch.Tensor
    count: torch.Tensor
    host_len: list[int]
    host_count: list[int]

    def select(self, order: list[int], index: torch.Tensor) -> PendingPairs:
        return PendingPairs(
            self.draft_len[index],
            self.tokens[index],
            self.hidden[index],
            self.count[index],
            [self.host_len[p] for p in order],
            [self.host_count[p] for p in order],
        )

    def joined(self, other: PendingPairs) -> PendingPairs:
        """These rows followed by ``other``'s (capacities widened to the larger one)."""
        cap = max(self.tokens.shape[1], other.tokens.shape[1])

        def widen(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(t.shape[0], cap - t.shape[1], *t.shape[2:])], 1)

        return PendingPairs(
            torch.cat([self.draft_len, other.draft_len]),
            torch.cat([widen(self.tokens), widen(other.tokens)]),
            torch.cat([widen(self.hidden), widen(other.hidden)]),
            torch.cat([self.count, other.count]),
            self.host_len + other.host_len,
            self.host_count + other.host_count,
        )

    def window(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, width]`` tokens and ``[B, width, H]`` hidden states of the first ``width`` columns (zeros past the
        capacity), contiguous (a compiled graph guards on its inputs' strides)."""
        missing = width - self.tokens.shape[1]
        if missing <= 0:
            return self.tokens[:, :width].contiguous(), self.hidden[:, :width].contiguous()
        b, h = self.hidden.shape[0], self.hidden.shape[-1]
        tokens = torch.cat([self.tokens, self.tokens.new_zeros(b, missing)], 1)
        return tokens, torch.cat([self.hidden, self.hidden.new_zeros(b, missing, h)], 1)

    def consumed(self, draft_len: torch.Tensor) -> None:
        """The draft cache read every pending pair: it now fills ``draft_len`` ``[B]`` slots."""
        self.draft_len, self.count = draft_len, torch.zeros_like(self.count)
        self.host_len = [n + c for n, c in zip(self.host_len, self.host_count, strict=True)]
        self.host_count = [0] * len(self.host_count)

    def push(self, tokens: torch.Tensor, hidden: torch.Tensor, count: torch.Tensor, host_count: list[int]) -> None:
        """Append ``count[b]`` (token ``[B, E]``, hidden ``[B, E, H]``) pairs to each row's pending pairs
        (``host_count``: ``count`` on the host)."""
        b, e = tokens.shape
        self.host_count = [c + n for c, n in zip(self.host_count, host_count, strict=True)]
        need, cap = max(self.host_count), self.tokens.shape[1] - 1
        if need > cap:
            grown = max(need, 2 * cap)
            new_tok = self.tokens.new_zeros(b, grown + 1)
            new_hid = self.hidden.new_zeros(b, grown + 1, hidden.shape[-1])
            new_tok[:, :cap], new_hid[:, :cap] = self.tokens[:, :cap], self.hidden[:, :cap]
            self.tokens, self.hidden, cap = new_tok, new_hid, grown
        steps = torch.arange(e, device=tokens.device)[None, :]
        index = torch.where(steps < count[:, None], self.count[:, None] + steps, cap)  # the spare column
        rows = torch.arange(b, device=tokens.device)[:, None]
        self.tokens[rows, index] = tokens  # index assignment, not scatter_ (slow on bfloat16, see cache.py)
        self.hidden[rows, index] = hidden.to(self.hidden.dtype)
        self.count = self.count + count


class EagleDrafter(Drafter):
    """Proposes trees with ``draft`` for the target ``model`` (whose embedding and LM head it shares); with a
    compile ``backend`` (of ``torch.compile``) the tree's expansion runs compiled (`fastgrpo.rollout.compiled`), over
    rows padded and draft-cache extents rounded up to buckets. ``profile`` (the latency profile of the draft's
    forwards) prices its trees (`cost`); ``learner`` trains the draft online
    (`fastgrpo.speculative.eagle.training.EagleLearner`)."""

    name = NAME

    def __init__(
        self,
        draft: DraftHead,
        model: nn.Module,
        backend: str | None = None,
        profile: LatencyProfile | None = None,
        learner: Learner | None = None,
    ):
        self.draft = draft
        self.model = model
        self.price = None if profile is None else EagleCost(profile)
        self.learner = learner
        self.cache: RowCache | None = None
        self.state: PendingPairs | None = None  # the rows of the current call
        self._weights: tuple[tuple[int, int], ...] | None = None  # see `begin`
        self._step = Compiled(draft_step, backend, f"{NAME}_proposal")
        self._empty: dict[tuple, DraftTree] = {}  # `_empty_tree`'s, by size and device

    @property
    def compile_seconds(self) -> float:
        """Wall time of the expansions that compiled a graph."""
        return self._step.seconds

    @property
    def compile_graphs(self) -> int:
        """Graphs the expansion compiled."""
        return self._step.graphs

    @property
    def compile_shapes(self) -> int:
        """Shapes the compiled expansion met (on a GPU, the CUDA graphs recorded)."""
        return self._step.shapes

    @property
    def cold_calls(self) -> int:
        """Expansions that compiled or warmed up a graph."""
        return self._step.cold_calls

    @property
    def eager_calls(self) -> dict[str, int]:
        """Expansions that ran eagerly though compiled."""
        return {self._step.name: self._step.eager_calls}

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        return (self.draft,)

    @staticmethod
    def cache_slots(length: int, bound: TreeShape) -> int:
        """Draft cache slots per row for a call of ``length`` tokens: room for the context, a catch-up block as long
        as the longest row's pending pairs, and a tree no larger than ``bound``, with room to align the extents an
        expansion reads (`_expansion_slots`)."""
        return aligned(2 * length + bound.max_levels * bound.top_k) + 2 * SLOT_ALIGN

    def begin(self, rows: int, length: int, bound: TreeShape) -> bool:
        """Size the draft cache (`cache_slots`). The weights changed when an optimizer step or a load wrote them in
        place, which bumps each tensor's version counter."""
        need = self.cache_slots(length, bound)
        if self.cache is None or not self.cache.holds(rows, need):
            self.cache = None  # freed before the new one is made
            param = next(self.model.parameters())
            compiled = self._step.compiled
            self.cache = RowCache(self.draft.body.config, rows, need, param.dtype, param.device, compiled)
        self.draft.forget_head_rows()  # the target's head may have changed since the last call
        weights = tuple((p.data_ptr(), p._version) for p in self.draft.parameters())
        changed, self._weights = weights != self._weights, weights
        return changed

    def start(self, prefill: Prefill) -> None:
        """The prompt's pairs (x_{j+1}, h_j), then the first sampled token's."""
        rows, prompt_ids = prefill.rows, prefill.prompt_ids
        n = rows.numel()
        spare = torch.zeros(n, 1, dtype=prompt_ids.dtype, device=prompt_ids.device)
        hidden = prefill.hidden[rows, :-1]
        self.state = PendingPairs(
            draft_len=torch.zeros_like(rows),
            tokens=torch.cat([prompt_ids[rows, 1:], spare], 1),
            hidden=torch.cat([hidden, hidden.new_zeros(n, 1, hidden.shape[-1])], 1),
            count=(prefill.prompt_len - 1)[rows],
            host_len=[0] * n,
            host_count=[len(prefill.prompts[p]) - 1 for p in prefill.row_prompt],
        )
        first = prefill.first
        self.state.push(first[:, None], prefill.first_hidden[:, None], torch.ones_like(first), [1] * n)

    def backlog(self) -> int:
        return max(self.state.host_count)

    def cost(self, rows: int, shape: TreeShape, backlog: int = 1) -> float:
        """The profiled draft forwards: the tree's levels, and the catch-up beyond one token per row."""
        return 0.0 if self.price is None else self.price(rows, shape, backlog)

    def accepted(self, rows: ActiveRows, emitted: Emitted) -> None:
        self.state.push(emitted.tokens, emitted.hidden, emitted.count, emitted.host_count)

    def select(self, order: list[int], index: torch.Tensor) -> None:
        self.cache.select_rows(order, upto=max(self.state.host_len))
        self.state = self.state.select(order, index)

    def park(self, positions: list[int]) -> list[Any]:
        """Each row's pending pairs and a copy of its filled draft cache slots (the draft is small: a copy is cheaper
        than keeping its cache rows in step with the target's)."""
        parked = []
        for p in positions:
            index = torch.tensor([p], device=self.state.draft_len.device)
            n = self.state.host_len[p]
            slots = [(layer.keys[p, :, :n].clone(), layer.values[p, :, :n].clone()) for layer in self.cache.layers]
            parked.append((self.state.select([p], index), slots))
        return parked

    def rejoin(self, state: Any, emitted: Emitted) -> None:
        pairs, slots = state
        row = len(self.state.host_len)
        for layer, (keys, values) in zip(self.cache.layers, slots, strict=True):
            layer.keys[row, :, : keys.shape[1]] = keys
            layer.values[row, :, : values.shape[1]] = values
        pairs.push(emitted.tokens, emitted.hidden, emitted.count, emitted.host_count)
        self.state = self.state.joined(pairs)

    def release(self) -> None:
        """Free the draft's KV cache (`begin` makes it again)."""
        self.cache = None
        self.state = None

    def propose(self, rows: ActiveRows, shape: TreeShape) -> Proposal:
        """Read the pending pairs, then expand a tree of ``shape`` from each row's last one."""
        return self._propose(rows, shape, None)

    @property
    def merges_inside(self) -> bool:
        return self._step.compiled

    def propose_merged(self, rows: ActiveRows, shape: TreeShape, earlier: Proposal) -> Proposal:
        if not self._step.compiled:
            return super().propose_merged(rows, shape, earlier)
        return self._propose(rows, shape, earlier)

    def _propose(self, rows: ActiveRows, shape: TreeShape, earlier: Proposal | None) -> Proposal:
        """`propose`, merged with ``earlier`` when given (compiled only: eagerly the engine merges)."""
        t0 = time.perf_counter()
        state = self.state
        backlog = sum(state.host_count) / rows.size
        embed, head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        # The catch-up's share of pairs from plain steps is their cost, not this tree's.
        share = max(0.0, 1.0 - (shape.max_levels + 1) / backlog)
        if not self._step.compiled:
            root_hidden = self._catch_up(state, embed)
            backlog_seconds = (time.perf_counter() - t0) * share
            row_inputs = (state.draft_len, rows.pending, root_hidden, rows.row_len)
            tree = expand_tree(self.draft, embed, head, self.cache, *row_inputs, shape, max(state.host_len))
            return Proposal(tree, shape.levels, backlog_seconds)
        # Compiled: one graph reads each row's pending pairs (`CATCH_UP_WIDTH` columns), expands the trees and merges
        # ``earlier``'s (or an empty tree's), over rows padded to their bucket and the most slots the shape's expansion
        # may read (`_expansion_slots`), as the target's steps are; the shape without its drafter's name.
        shape = dataclasses.replace(shape, drafter="")
        backlog_seconds = 0.0
        if max(state.host_count) > CATCH_UP_WIDTH:  # a long backlog (the prompt, plain steps) read first
            self._catch_up(state, embed, keep_last=True)
            backlog_seconds = (time.perf_counter() - t0) * share
        longest = self._expansion_slots(shape)  # `cache_slots` leaves the room
        padding = RowPadding(rows.size, rows.pending.device)
        tokens, hidden = state.window(CATCH_UP_WIDTH)
        inputs = (state.draft_len, tokens, hidden, state.count, rows.pending, rows.row_len)
        padded = [padding.pad(t) for t in inputs]
        levels = depth_bucket(shape.nodes - 1)  # the merge's walk as deep as any kept node may be
        if earlier is None:  # alone, the tree merges with an empty one: one graph, merged or alone
            other = self._empty_tree(padding.rows, shape.nodes, levels, padding.device)
        else:
            other = map_tensors(padding.pad, dataclasses.replace(earlier.tree, levels=levels))
        tree, draft_len = self._step(
            rows.pending.device, self.draft, embed, head, self.cache, *padded, shape, longest, other
        )
        state.consumed(padding.cut(draft_len))
        proposal = Proposal(padding.cut(tree), shape.levels, backlog_seconds)
        if earlier is not None:
            proposal.forwards += earlier.forwards
            proposal.backlog_seconds += earlier.backlog_seconds
        return proposal

    def _empty_tree(self, rows: int, nodes: int, levels: int, device: torch.device) -> DraftTree:
        """`empty_tree` of ``rows`` rows and ``nodes`` nodes on ``device``, made once per size."""
        key = (rows, nodes, levels, device)
        if key not in self._empty:
            self._empty[key] = empty_tree(rows, nodes, levels, device)
        return self._empty[key]

    def _expansion_slots(self, shape: TreeShape) -> int:
        """The draft cache's slots a row's context may fill before an expansion of ``shape`` (its levels after it),
        a multiple of `SLOT_ALIGN`, its last level reading fewer slots than the cache holds (see
        `fastgrpo.rollout.cache.cache_slots`)."""
        return read_slots(self.cache.max_len - (shape.levels - 1) * shape.top_k) // SLOT_ALIGN * SLOT_ALIGN

    def caches(self) -> tuple[RowCache, ...]:
        return () if self.cache is None else (self.cache,)

    def settle(self, rows: list[int], shapes: list[TreeShape]) -> None:
        """Run the compiled proposal for every shape of ``shapes`` (merged with another drafter's tree where its
        drafters are several), at every row count of ``rows``, from dummy pairs, as many times as a new shape runs
        before its graph replays."""
        if not self._step.compiled:
            return
        embed, head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        param = next(self.draft.parameters())
        dev, hidden_size = param.device, self.draft.body.config.hidden_size
        warm = self._step.warm_calls(dev)  # calls of a new shape before its graph replays
        kinds = {dataclasses.replace(s, drafter="") for s in shapes}
        for shape, count in itertools.product(kinds, rows):
            slots = self._expansion_slots(shape)
            other = star_tree(count, shape.nodes, depth_bucket(shape.nodes - 1), dev)
            # distinct tensors, as a proposal's are (torch guards on which arguments are the same object)
            draft_len, root, position = (torch.zeros(count, dtype=torch.long, device=dev) for _ in range(3))
            tokens = torch.zeros(count, CATCH_UP_WIDTH, dtype=torch.long, device=dev)
            hidden = torch.zeros(count, CATCH_UP_WIDTH, hidden_size, dtype=param.dtype, device=dev)
            inputs = (draft_len, tokens, hidden, torch.ones_like(draft_len), root, position)
            for _ in range(warm):
                self._step(dev, self.draft, embed, head, self.cache, *inputs, shape, slots, other)

    def _catch_up(self, state: PendingPairs, embed: nn.Module, keep_last: bool = False) -> torch.Tensor:
        """Feed the pending pairs to the draft cache; returns ``[B, H]`` the draft's output for each row's last pair
        (the root of the next tree). ``keep_last``: all but each row's last pair, which stays pending (the return
        value is then meaningless)."""
        read = [c - keep_last for c in state.host_count]
        width = max(read)
        count = state.count - int(keep_last)
        root = catch_up(
            self.draft,
            embed,
            self.cache,
            state.draft_len,
            state.tokens[:, :width],
            state.hidden[:, :width],
            count,
            max(state.host_len) + width,
        )
        if not keep_last:
            state.consumed(state.draft_len + count)
            return root
        state.draft_len = state.draft_len + count
        state.host_len = [n + c for n, c in zip(state.host_len, read, strict=True)]
        rows = torch.arange(count.shape[0], device=count.device)  # each row's last pair to the first column
        state.tokens[:, 0], state.hidden[:, 0] = state.tokens[rows, count], state.hidden[rows, count]
        state.count, state.host_count = torch.ones_like(count), [1] * len(read)
        return root
