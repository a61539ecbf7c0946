"""The suffix drafter: trees from what a row's prompt has already been answered with, no neural forward.

GRPO samples a group of completions per prompt, and a prompt comes back in every epoch; completions of one prompt
share long stretches. The drafter keeps, per prompt, a `PromptMemory`: the prompt, the completions of the group
being generated (read as they grow) and earlier completions of the same prompt, their tokens in a `TokenStore` shared
by all prompts. To draft for a row it finds the places in that memory whose preceding tokens match the row's last
tokens longest (`PromptMemory.continuations`), merges what followed them into a trie, each path weighted by how many
matches continue along it (longer matches weigh more), and proposes the best nodes by that weight. A step reads each
row's new tokens and its places in Python, then searches and builds the trees of all rows at once with array
operations (`fastgrpo.speculative.suffix.search`, `fastgrpo.speculative.suffix.trees`). Verification is the
engine's lossless tree acceptance: the tree is a function of the context and of earlier outputs only, so the output
distribution stays the target's.

Earlier completions are kept within a budget of tokens (`SuffixMemory`). A run visits its prompts epoch by epoch, so
a prompt just used is the last to come back: over budget, the memory drops the prompts used most recently (those of
the current call excepted), keeping those that wait to return.
"""

from __future__ import annotations

import time
from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch

from fastgrpo.rollout.drafter import Drafter, Emitted, Prefill, Proposal, Rollout
from fastgrpo.rollout.sequence import ActiveRows
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.speculative.suffix.search import KEY, POS, SHIFT, Queries, search
from fastgrpo.speculative.suffix.store import TokenStore
from fastgrpo.speculative.suffix.trees import draft_tree, log_shares

PREFIX = 8  # prompt tokens kept before each completion, so that a completion's first tokens can be matched
ROW_CELLS = 128  # completion tokens a row's sequence has room for at first (it moves to a larger run past them)
DEFAULT_MEMORY_TOKENS = 2_000_000
KEEP = 0.99  # how much a proposal's timing weighs in the price against the next one's


def _places() -> array:
    """An index entry: the places of a key, oldest first."""
    return array("q")


class PromptMemory:
    """One prompt's token sequences (the prompt, then completions, each after the prompt's last `PREFIX` tokens),
    kept in slots of a `TokenStore`, and the index of the places each pair of tokens ends at (key -> places, oldest
    first), a place indexed once a token follows it (so that the places of the group's rows, which grow together,
    are found only where they lead somewhere)."""

    def __init__(self, prompt: list[int], store: TokenStore | None = None):
        self.prompt = prompt
        self.store = store if store is not None else TokenStore()
        self.slots: list[int] = []  # the store's slot of each sequence
        self.indexed: list[int] = []  # per sequence, the first position not indexed yet
        self.index: defaultdict[int, array] = defaultdict(_places)
        self.last_used = -1
        self.add(prompt, prefix=0)

    @property
    def tokens(self) -> int:
        return sum(self.store.size[s] for s in self.slots)

    def add(self, tokens: list[int], prefix: int = PREFIX, room: int = 0) -> int:
        """A new sequence: ``tokens`` after the prompt's last ``prefix`` tokens, with room for ``room`` more at
        first; returns its id."""
        head = self.prompt[-prefix:] if prefix else []
        self.slots.append(self.store.new(head, len(head) + len(tokens) + room))
        self.indexed.append(max(len(head) - 1, KEY - 1))  # a key ending at the prompt's last token leads into it
        sid = len(self.slots) - 1
        if tokens:
            self.extend(sid, tokens)
        return sid

    def extend(self, sid: int, tokens: list[int]) -> None:
        """Append ``tokens`` to sequence ``sid`` and index every place with a complete key and a next token."""
        slot, store, start = self.slots[sid], self.store, self.indexed[sid]
        store.append(slot, tokens)
        run = store.read(slot, start - 1)  # the tokens ending the keys of positions start..size-2, and the last
        place, index = slot * POS + start, self.index
        for first, second in pairwise(run[:-1]):
            index[first << SHIFT | second].append(place)
            place += 1
        self.indexed[sid] = max(start, len(run) + start - 2)

    def completions(self) -> list[list[int]]:
        """The completions' tokens, oldest first."""
        head = min(PREFIX, len(self.prompt))
        return [self.store.read(slot, head) for slot in self.slots[1:]]

    def release(self) -> None:
        """Give the sequences' slots back to the store (the memory is not used after)."""
        for slot in self.slots:
            self.store.release(slot)

    def trim(self, tokens: int) -> None:
        """Keep the prompt and the newest completions within ``tokens`` tokens (the index made anew)."""
        kept, total = [], len(self.prompt)
        completions = self.completions()
        for slot, completion in zip(reversed(self.slots[1:]), reversed(completions), strict=True):
            if total + self.store.size[slot] > tokens:
                break
            kept.append(completion)
            total += self.store.size[slot]
        self.release()
        self.slots, self.indexed, self.index = [], [], defaultdict(_places)
        self.add(self.prompt, prefix=0)
        for completion in reversed(kept):
            self.add(completion)

    def continuations(self, context: list[int], depth: int) -> list[tuple[int, list[int]]]:
        """``(match length, next tokens)`` of the `CANDIDATES` places whose preceding tokens match the end of
        ``context`` longest (the most recent first on ties), at most ``depth`` tokens each: what a tree for a row
        with that context is drawn from."""
        if not context:
            return []
        queries = Queries()
        queries.add(self.index, [], context, self.store.clock)
        found = search(self.store, queries, depth)
        if not len(found.rows):
            return []
        lengths, ahead = found.length[0].tolist(), found.ahead[0].tolist()
        return [(m, found.tokens[0, i, :n].tolist()) for i, (m, n) in enumerate(zip(lengths, ahead, strict=True)) if m]


@dataclass
class _Row:
    """A row of the current call: its completion's tokens (the engine's own list, which grows as the row decodes; not
    its `Sequence`, which holds captured hidden states), its prompt's memory and its own sequence there."""

    completion: list[int]
    memory: PromptMemory
    sid: int
    read: int = 0  # completion tokens read into the memory
    done: bool = False  # it left the call's rows (ended, or waits on a tool)

    def catch_up(self) -> None:
        if len(self.completion) > self.read:
            self.memory.extend(self.sid, self.completion[self.read :])
            self.read = len(self.completion)


@dataclass
class SuffixMemory:
    """Every prompt's memory, within ``budget`` tokens; the suffix drafter's online state (`learn` applies the budget,
    `state_dict` holds the completions, not the index, which `load_state_dict` rebuilds). ``rows`` are the rows of
    the last call, whose newest tokens are read in (`read_rows`) before the memory is learnt from or saved."""

    budget: int = DEFAULT_MEMORY_TOKENS
    prompts: dict[tuple[int, ...], PromptMemory] = field(default_factory=dict)
    store: TokenStore = field(default_factory=TokenStore)  # every prompt memory's sequences
    calls: int = 0  # generation calls so far (the clock of `PromptMemory.last_used`)
    rows: list[_Row] = field(default_factory=list)

    captures_hidden = False

    def read_rows(self) -> None:
        """Read the last call's rows up to their last token (a row's tokens are read as trees are drafted for it)."""
        for row in self.rows:
            row.catch_up()

    def memory(self, prompt: list[int]) -> PromptMemory:
        """The prompt's memory (a new one for a prompt not seen yet or dropped), marked used by this call."""
        key = tuple(prompt)
        mem = self.prompts.get(key)
        if mem is None:
            mem = self.prompts[key] = PromptMemory(list(prompt), self.store)
        mem.last_used = self.calls
        return mem

    @property
    def tokens(self) -> int:
        return sum(m.tokens for m in self.prompts.values())

    def evict(self) -> None:
        """Drop the prompts used most recently, those used since the call began or the last `learn` excepted, until
        within the budget."""
        total = self.tokens
        order = sorted((m for m in self.prompts.values() if m.last_used < self.calls), key=lambda m: -m.last_used)
        for mem in order:
            if total <= self.budget:
                break
            total -= mem.tokens
            mem.release()
            del self.prompts[tuple(mem.prompt)]

    def learn(self, rollouts: list[Rollout]) -> dict[str, float]:
        """The completions are in the memory already (read while they were generated): apply the budget, to the last
        call's prompts too (their oldest completions go first). In a call that goes on (it spans generations,
        `fastgrpo.rollout.decoding.Decoding.hand_over`), the prompts of its live rows are kept whole, and the others
        it used count as used before them."""
        self.read_rows()
        self.rows = [row for row in self.rows if not row.done]
        live = {id(row.memory) for row in self.rows}
        if live:
            self.calls += 1
            for row in self.rows:
                row.memory.last_used = self.calls
        self.evict()
        over = self.tokens - self.budget
        for mem in sorted(self.prompts.values(), key=lambda m: -m.tokens):
            if over <= 0:
                break
            if id(mem) in live:
                continue
            before = mem.tokens
            mem.trim(max(before - over, len(mem.prompt)))
            over -= before - mem.tokens
        return {"suffix/memory_tokens": float(self.tokens), "suffix/memory_prompts": float(len(self.prompts))}

    def state_dict(self) -> dict[str, Any]:
        self.read_rows()
        prompts = [(m.prompt, m.completions(), m.last_used) for m in self.prompts.values()]
        return {"calls": self.calls, "prompts": prompts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.clear()
        self.store = TokenStore()
        self.rows = []
        self.calls = state["calls"]
        for prompt, completions, last_used in state["prompts"]:
            mem = self.memory(prompt)
            for tokens in completions:
                mem.add(tokens)
            mem.last_used = last_used


class SuffixDrafter(Drafter):
    """Drafts trees of up to ``max_depth`` levels from each row's `PromptMemory` (see the module); the memory of
    earlier completions, its `learner`, holds at most ``memory_tokens`` tokens. With ``reads_tool_results`` (the
    default) a tool's results enter the memory with the completion around them; without, the memory keeps the
    model's turns only, each turn after a tool's results a sequence of its own, after the prompt's end as a
    completion is."""

    name = "suffix"

    def __init__(
        self, memory_tokens: int = DEFAULT_MEMORY_TOKENS, max_depth: int = 16, reads_tool_results: bool = True
    ):
        self.learner = SuffixMemory(memory_tokens)
        self.max_depth = max_depth
        self.reads_tool_results = reads_tool_results
        self.rows: list[_Row] = []  # the live rows, in the engine's order
        self.price = Price()  # measured seconds per proposal (see `cost`)
        log_shares()  # the trees' score table, before the first proposal is timed

    def begin(self, rows: int, length: int, bound: TreeShape) -> bool:
        self.learner.read_rows()
        self.learner.rows, self.rows = [], []
        self.learner.calls += 1
        return False

    def start(self, prefill: Prefill) -> None:
        self.rows, self.learner.rows = [], []
        for prompt in prefill.waiting:  # used by this call: not evicted before their rows are taken in
            self.learner.memory(prompt)
        self.admit(prefill)

    def admit(self, prefill: Prefill) -> None:
        memories = [self.learner.memory(p) for p in prefill.prompts]
        for seq, p in zip(prefill.seqs, prefill.row_prompt, strict=True):
            mem = memories[p]
            row = _Row(seq.completion_ids, mem, mem.add([], room=ROW_CELLS))
            self.rows.append(row)
            self.learner.rows.append(row)
        self.learner.evict()

    def deepest(self, shape: TreeShape) -> int:
        return min(shape.nodes - 1, self.max_depth)

    def cost(self, rows: int, shape: TreeShape, backlog: int = 1) -> float:
        return self.price.seconds(rows)

    def cost_state(self) -> dict[str, Any]:
        return {"price": list(self.price.sums)}

    def load_cost_state(self, state: dict[str, Any]) -> None:
        self.price = Price(tuple(state["price"]))

    def accepted(self, rows: ActiveRows, emitted: Emitted) -> None:
        pass  # the rows' tokens are read from their completions when the next tree is drafted

    def select(self, order: list[int], index: torch.Tensor) -> None:
        kept = set(order)
        for i, row in enumerate(self.rows):
            if i not in kept:  # a finished row's last tokens, for its siblings still decoding
                row.catch_up()
                row.done = True
        self.rows = [self.rows[i] for i in order]

    def park(self, positions: list[int]) -> list[Any]:
        parked = [self.rows[p] for p in positions]
        for row in parked:
            row.catch_up()  # its turn, up to the EOS, for its siblings while it waits
        return parked

    def rejoin(self, state: _Row, emitted: Emitted) -> None:
        state.done = False
        if not self.reads_tool_results:  # the next turn starts a sequence of its own (as a completion does)
            state.sid, state.read = state.memory.add([], room=ROW_CELLS), len(state.completion)
        self.rows.append(state)  # otherwise the tool turn is read from its completion, as any of its tokens

    def propose(self, rows: ActiveRows, shape: TreeShape) -> Proposal:
        """Per row, the trie of the continuations of its longest matches, cut to its best ``N - 1`` nodes
        (`draft_tree`). Each row reads its new tokens, then searches: a row sees the tokens its siblings before it
        read in this step, not those of the siblings after it."""
        t0 = time.perf_counter()
        n, depth = shape.nodes, self.deepest(shape)
        queries, store = Queries(), self.learner.store
        for row in self.rows:
            row.catch_up()
            queries.add(row.memory.index, row.memory.prompt, row.completion, store.clock)
        tree = draft_tree(search(store, queries, depth, -(-(n - 1) // depth)), n, depth).to(rows.pending.device)
        self.price.observe(len(self.rows), time.perf_counter() - t0)
        return Proposal(tree, 0)


@dataclass
class Price:
    """The seconds of a proposal as a part per step and a part per row (a step's search and trees are array
    operations over all rows at once, each row's reading is Python): least squares over the proposals so far, each
    weighing `KEEP` times the one after it. ``sums``: the weights, and their sums of rows, rows squared, seconds and
    rows times seconds."""

    sums: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)

    def observe(self, rows: int, seconds: float) -> None:
        n, r, rr, s, rs = (KEEP * x for x in self.sums)
        self.sums = (n + 1.0, r + rows, rr + rows * rows, s + seconds, rs + rows * seconds)

    def seconds(self, rows: int) -> float:
        """Predicted seconds of a proposal for ``rows`` rows (0 before any): the fit when its parts are not negative,
        else the mean time per row times ``rows``."""
        n, r, rr, s, rs = self.sums
        spread = n * rr - r * r
        if spread > 1e-9 * n * rr:
            per_row = (n * rs - r * s) / spread
            per_step = (s - per_row * r) / n
            if per_row >= 0.0 and per_step >= 0.0:
                return per_step + per_row * rows
        return s / r * rows if r else 0.0
