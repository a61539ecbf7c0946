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
from fastgrpo.rollout.tree import DraftTree, TreeShape, empty_tree, pad_tree
from fastgrpo.speculative.eagle.expansion import catch_up, draft_step, expand_tree
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.eagle.pending import PendingPairs
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
        seconds = self._trees.get((rows, shape))
        if seconds is None:  # looked up once: the controller prices every candidate at every step
            level = self.profile.drafter_time(NAME, rows * shape.top_k)
            seconds = self._trees[rows, shape] = shape.levels * level
        if backlog > 1:
            level = partial(self.profile.drafter_time, NAME)
            seconds += level(rows * backlog) - level(rows)
        return seconds


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
        self._groups: dict[TreeShape, tuple[TreeShape, tuple[int, ...]]] = {}  # see `expansion`
        self._expanded: dict[TreeShape, tuple[TreeShape, tuple[int, ...]]] = {}  # `expansion`'s, by shape asked

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
        self.state = self._pairs(prefill)

    def admit(self, prefill: Prefill) -> None:
        """The new rows' pairs after the live rows' (their draft cache rows are read from slot 0 on)."""
        self.state = self.state.joined(self._pairs(prefill))

    @staticmethod
    def _pairs(prefill: Prefill) -> PendingPairs:
        """The prompt's pairs (x_{j+1}, h_j), then the first sampled token's, of each row of ``prefill``."""
        rows, prompt_ids = prefill.rows, prefill.prompt_ids
        n = rows.numel()
        spare = torch.zeros(n, 1, dtype=prompt_ids.dtype, device=prompt_ids.device)
        hidden = prefill.hidden[rows, :-1]
        pairs = PendingPairs(
            draft_len=torch.zeros_like(rows),
            tokens=torch.cat([prompt_ids[rows, 1:], spare], 1),
            hidden=torch.cat([hidden, hidden.new_zeros(n, 1, hidden.shape[-1])], 1),
            count=(prefill.prompt_len - 1)[rows],
            host_len=[0] * n,
            host_count=[len(prefill.prompts[p]) - 1 for p in prefill.row_prompt],
        )
        first = prefill.first
        pairs.push(first[:, None], prefill.first_hidden[:, None], torch.ones_like(first), [1] * n)
        return pairs

    def backlog(self) -> int:
        return max(self.state.host_count)

    def cost(self, rows: int, shape: TreeShape, backlog: int = 1) -> float:
        """The profiled draft forwards: the levels of the tree it expands (`expansion`), and the catch-up beyond one
        token per row."""
        return 0.0 if self.price is None else self.price(rows, self.expansion(shape)[0], backlog)

    def deepest(self, shape: TreeShape) -> int:
        return min(self.expansion(shape)[0].levels, shape.nodes - 1)

    def expansion(self, shape: TreeShape) -> tuple[TreeShape, tuple[int, ...]]:
        """The tree a proposal of ``shape`` expands, and the sizes its graph cuts that tree to (`draft_step`): the
        shape itself eagerly, or compiled before `settle` has met it. Compiled, the shapes `settle` ran share two
        graphs: those of one draft level (the root's children) expand the widest of them, and the others the
        widest, deepest tree of any (EAGLE-2's fixed expansion, cut to the size asked for); every tree of a size is
        then the best nodes of the next larger one's, and a run compiles and records two proposals per row bucket
        instead of one per tree size."""
        found = self._expanded.get(shape)  # looked up once per shape: the controller prices trees at every step
        if found is None:
            bare = dataclasses.replace(shape, drafter="")
            found = self._expanded[shape] = self._groups.get(bare, (bare, (bare.nodes,)))
        return found

    def _plan(self, shapes: list[TreeShape]) -> None:
        """Group ``shapes`` by `expansion`'s rule."""
        self._expanded.clear()
        kinds = {dataclasses.replace(s, drafter="") for s in shapes if s.speculative}
        for shallow in (True, False):
            group = [s for s in kinds if (s.levels == 1) == shallow]
            if not group:
                continue
            # as deep as the deepest of them: no tree deeper than the engine's walk (`fastgrpo.rollout.shape_menu`)
            widest = TreeShape(*(max(getattr(s, f) for s in group) for f in ("nodes", "top_k", "levels")))
            sizes = tuple(sorted({s.nodes for s in group}))
            self._groups.update({s: (widest, sizes) for s in group})

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
        # Compiled: one graph reads each row's pending pairs (`CATCH_UP_WIDTH` columns), expands the tree of
        # `expansion`, merges ``earlier``'s (or an empty tree's) and cuts the result to every size of its group, over
        # rows padded to their bucket and the most slots the expansion may read (`_expansion_slots`), as the target's
        # steps are; the shape without its drafter's name.
        expansion, sizes = self.expansion(shape)
        backlog_seconds = 0.0
        if max(state.host_count) > CATCH_UP_WIDTH:  # a long backlog (the prompt, plain steps) read first
            self._catch_up(state, embed, keep_last=True)
            backlog_seconds = (time.perf_counter() - t0) * share
        longest = self._expansion_slots(expansion)  # `cache_slots` leaves the room
        padding = RowPadding(rows.size, rows.pending.device)
        tokens, hidden = state.window(CATCH_UP_WIDTH)
        inputs = (state.draft_len, tokens, hidden, state.count, rows.pending, rows.row_len)
        padded = [padding.pad(t) for t in inputs]
        # alone, the tree merges with an empty one: one graph, merged or alone, whatever the other's size
        empty = self._empty_tree(padding.rows, expansion.nodes, depth_bucket(expansion.nodes - 1), padding.device)
        other = empty if earlier is None else pad_tree(map_tensors(padding.pad, earlier.tree), empty)
        trees, draft_len = self._step(
            rows.pending.device, self.draft, embed, head, self.cache, *padded, expansion, longest, other, sizes
        )
        state.consumed(padding.cut(draft_len))
        proposal = Proposal(padding.cut(trees[sizes.index(shape.nodes)]), expansion.levels, backlog_seconds)
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
        """Group ``shapes`` by the trees they expand (`expansion`) and run the compiled proposal of each group
        (merged with another drafter's tree: alone it merges with an empty one), at every row count of ``rows``,
        from dummy pairs, as many times as a new shape runs before its graph replays."""
        if not self._step.compiled:
            return
        self._plan(shapes)
        embed, head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        param = next(self.draft.parameters())
        dev, hidden_size = param.device, self.draft.body.config.hidden_size
        warm = self._step.warm_calls(dev)  # calls of a new shape before its graph replays
        groups = {self.expansion(s) for s in shapes if s.speculative}
        for (expansion, sizes), count in itertools.product(groups, rows):
            slots = self._expansion_slots(expansion)
            other = star_tree(count, expansion.nodes, depth_bucket(expansion.nodes - 1), dev)
            # distinct tensors, as a proposal's are (torch guards on which arguments are the same object)
            draft_len, root, position = (torch.zeros(count, dtype=torch.long, device=dev) for _ in range(3))
            tokens = torch.zeros(count, CATCH_UP_WIDTH, dtype=torch.long, device=dev)
            hidden = torch.zeros(count, CATCH_UP_WIDTH, hidden_size, dtype=param.dtype, device=dev)
            inputs = (draft_len, tokens, hidden, torch.ones_like(draft_len), root, position)
            for _ in range(warm):
                self._step(dev, self.draft, embed, head, self.cache, *inputs, expansion, slots, other, sizes)

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
