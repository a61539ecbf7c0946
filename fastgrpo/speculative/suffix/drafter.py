"""The suffix drafter: trees from what a row's prompt has already been answered with, no neural forward.

GRPO samples a group of completions per prompt, and a prompt comes back in every epoch; completions of one prompt
share long stretches. The drafter keeps, per prompt, a `PromptMemory`: the prompt, the completions of the group
being generated (read as they grow) and earlier completions of the same prompt. To draft for a row it finds the
places in that memory whose preceding tokens match the row's last tokens longest (`PromptMemory.continuations`),
merges what followed them into a trie, each path weighted by how many matches continue along it (longer matches
weigh more), and proposes the best nodes by that weight. Verification is the engine's lossless tree acceptance: the
tree is a function of the context and of earlier outputs only, so the output distribution stays the target's.

Earlier completions are kept within a budget of tokens (`SuffixMemory`). A run visits its prompts epoch by epoch, so
a prompt just used is the last to come back: over budget, the memory drops the prompts used most recently (those of
the current call excepted), keeping those that wait to return.
"""

from __future__ import annotations

import math
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from fastgrpo.rollout.drafter import Drafter, Emitted, Prefill, Proposal, Rollout
from fastgrpo.rollout.host import host_to_device
from fastgrpo.rollout.sequence import ActiveRows
from fastgrpo.rollout.tree import TreeShape, best_subtree

KEY = 2  # tokens a match must share at least (the index's key)
PREFIX = 8  # prompt tokens kept before each completion, so that a completion's first tokens can be matched
MAX_MATCH = 32  # a match is extended backwards this far at most
SCAN = 64  # the most recent places of a key that are compared
CANDIDATES = 16  # the longest matches whose continuations form the trie
DEFAULT_MEMORY_TOKENS = 2_000_000
_SHIFT = 21  # key = first token << _SHIFT | second token (vocabularies below 2M tokens)
_POS = 1 << 24  # place = sequence << 24 | position (sequences below 16M tokens)


class PromptMemory:
    """One prompt's token sequences (the prompt, then completions, each after the prompt's last `PREFIX` tokens) and
    the index of the places each pair of tokens ends at, a place indexed once a token follows it (so that the
    places of the group's rows, which grow together, are found only where they lead somewhere)."""

    def __init__(self, prompt: list[int]):
        self.prompt = prompt
        self.seqs: list[array] = []
        self.indexed: list[int] = []  # positions indexed so far, per sequence
        self.index: dict[int, list[int]] = {}
        self.last_used = -1
        self.add(prompt, prefix=0)

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.seqs)

    def add(self, tokens: list[int], prefix: int = PREFIX) -> int:
        """A new sequence: ``tokens`` after the prompt's last ``prefix`` tokens; returns its id."""
        head = self.prompt[-prefix:] if prefix else []
        self.seqs.append(array("l", head))
        self.indexed.append(max(len(head) - 1, 0))  # a key ending at the prompt's last token leads into the sequence
        sid = len(self.seqs) - 1
        self.extend(sid, tokens)
        return sid

    def extend(self, sid: int, tokens: list[int]) -> None:
        """Append ``tokens`` to sequence ``sid`` and index every place with a complete key and a next token."""
        seq = self.seqs[sid]
        seq.extend(tokens)
        start = max(self.indexed[sid], KEY - 1)
        base, index = sid * _POS, self.index
        for pos in range(start, len(seq) - 1):
            key = seq[pos - 1] << _SHIFT | seq[pos]
            places = index.get(key)
            if places is None:
                index[key] = [base + pos]
            else:
                places.append(base + pos)
        self.indexed[sid] = max(len(seq) - 1, start)

    def trim(self, tokens: int) -> None:
        """Keep the prompt and the newest completions within ``tokens`` tokens (the index made anew)."""
        kept, total = [], len(self.prompt)
        head = min(PREFIX, len(self.prompt))
        for seq in reversed(self.seqs[1:]):
            if total + len(seq) > tokens:
                break
            kept.append(seq[head:].tolist())
            total += len(seq)
        self.seqs, self.indexed, self.index = [], [], {}
        self.add(self.prompt, prefix=0)
        for completion in reversed(kept):
            self.add(completion)

    def continuations(self, context: list[int], depth: int) -> list[tuple[int, list[int]]]:
        """``(match length, next tokens)`` of the `CANDIDATES` places whose preceding tokens match the end of
        ``context`` longest (the most recent first on ties), at most ``depth`` tokens each."""
        if len(context) < KEY:
            return []
        places = self.index.get(context[-2] << _SHIFT | context[-1])
        if not places:
            return []
        found = []
        tail = context[-MAX_MATCH:][::-1]
        for place in reversed(places[-SCAN:]):
            sid, pos = divmod(place, _POS)
            seq = self.seqs[sid]
            nxt = seq[pos + 1 : pos + 1 + depth]  # never empty: a place is indexed once a token follows it
            m = KEY
            limit = min(len(tail), pos + 1)
            while m < limit and seq[pos - m] == tail[m]:
                m += 1
            found.append((m, -len(found), nxt))
        found.sort(reverse=True)
        return [(m, list(nxt)) for m, _, nxt in found[:CANDIDATES]]


@dataclass
class _Row:
    """A row of the current call: its completion's tokens (the engine's own list, which grows as the row decodes; not
    its `Sequence`, which holds captured hidden states), its prompt's memory and its own sequence there."""

    completion: list[int]
    memory: PromptMemory
    sid: int
    read: int = 0  # completion tokens read into the memory

    def catch_up(self) -> None:
        new = self.completion[self.read :]
        if new:
            self.memory.extend(self.sid, new)
            self.read += len(new)


@dataclass
class SuffixMemory:
    """Every prompt's memory, within ``budget`` tokens; the suffix drafter's online state (`learn` applies the budget,
    `state_dict` holds the completions, not the index, which `load_state_dict` rebuilds). ``rows`` are the rows of
    the last call, whose newest tokens are read in (`read_rows`) before the memory is learnt from or saved."""

    budget: int = DEFAULT_MEMORY_TOKENS
    prompts: dict[tuple[int, ...], PromptMemory] = field(default_factory=dict)
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
            mem = self.prompts[key] = PromptMemory(list(prompt))
        mem.last_used = self.calls
        return mem

    @property
    def tokens(self) -> int:
        return sum(m.tokens for m in self.prompts.values())

    def evict(self) -> None:
        """Drop the prompts used most recently, those of the current call excepted, until within the budget."""
        total = self.tokens
        order = sorted((m for m in self.prompts.values() if m.last_used < self.calls), key=lambda m: -m.last_used)
        for mem in order:
            if total <= self.budget:
                break
            total -= mem.tokens
            del self.prompts[tuple(mem.prompt)]

    def learn(self, rollouts: list[Rollout]) -> dict[str, float]:
        """The completions are in the memory already (read while they were generated): apply the budget, to the last
        call's prompts too (their oldest completions go first)."""
        self.read_rows()
        self.rows = []
        self.evict()
        over = self.tokens - self.budget
        for mem in sorted(self.prompts.values(), key=lambda m: -m.tokens):
            if over <= 0:
                break
            before = mem.tokens
            mem.trim(max(before - over, len(mem.prompt)))
            over -= before - mem.tokens
        return {"suffix/memory_tokens": float(self.tokens), "suffix/memory_prompts": float(len(self.prompts))}

    def state_dict(self) -> dict[str, Any]:
        self.read_rows()
        prompts = []
        for m in self.prompts.values():
            head = min(PREFIX, len(m.prompt))
            prompts.append((m.prompt, [s[head:].tolist() for s in m.seqs[1:]], m.last_used))
        return {"calls": self.calls, "prompts": prompts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.clear()
        self.rows = []
        self.calls = state["calls"]
        for prompt, completions, last_used in state["prompts"]:
            mem = self.memory(prompt)
            for tokens in completions:
                mem.add(tokens)
            mem.last_used = last_used


class SuffixDrafter(Drafter):
    """Drafts trees of up to ``max_depth`` levels from each row's `PromptMemory` (see the module); the memory of
    earlier completions, its `learner`, holds at most ``memory_tokens`` tokens."""

    name = "suffix"

    def __init__(self, memory_tokens: int = DEFAULT_MEMORY_TOKENS, max_depth: int = 16):
        self.learner = SuffixMemory(memory_tokens)
        self.max_depth = max_depth
        self.rows: list[_Row] = []  # the live rows, in the engine's order
        self.row_seconds = 0.0  # measured seconds to propose for one row (an average, see `cost`)
        self._proposals = 0

    def begin(self, rows: int, length: int, bound: TreeShape) -> bool:
        self.learner.read_rows()
        self.learner.rows, self.rows = [], []
        self.learner.calls += 1
        return False

    def start(self, prefill: Prefill) -> None:
        memories = [self.learner.memory(p) for p in prefill.prompts]
        self.rows = []
        for seq, p in zip(prefill.seqs, prefill.row_prompt, strict=True):
            mem = memories[p]
            self.rows.append(_Row(seq.completion_ids, mem, mem.add([])))
        self.learner.rows = list(self.rows)
        self.learner.evict()

    def deepest(self, shape: TreeShape) -> int:
        return min(shape.nodes - 1, self.max_depth)

    def cost(self, rows: int, shape: TreeShape, backlog: int = 1) -> float:
        return self.row_seconds * rows

    def accepted(self, rows: ActiveRows, emitted: Emitted) -> None:
        pass  # the rows' tokens are read from their completions when the next tree is drafted

    def select(self, order: list[int], index: torch.Tensor) -> None:
        kept = set(order)
        for i, row in enumerate(self.rows):
            if i not in kept:  # a finished row's last tokens, for its siblings still decoding
                row.catch_up()
        self.rows = [self.rows[i] for i in order]

    def propose(self, rows: ActiveRows, shape: TreeShape) -> Proposal:
        """Per row, a trie of the continuations of its longest matches, cut to its best ``N - 1`` nodes by weight
        (`best_subtree`)."""
        t0 = time.perf_counter()
        n, depth = shape.nodes, self.deepest(shape)
        tries = []
        for row in self.rows:
            row.catch_up()
            context = row.memory.prompt[-MAX_MATCH:] + row.completion[-MAX_MATCH:]
            tries.append(_trie(row.completion[-1], row.memory.continuations(context, depth)))
        width = max(n, *(len(tokens) for tokens, *_ in tries))
        ints: list[int] = []
        scores: list[float] = []
        deepest = 1
        for tokens, parents, depths, weights in tries:
            pad = width - len(tokens)
            ints += tokens + [0] * pad + parents + [0] * pad + depths + [1] * pad
            scores += weights + [-math.inf] * pad
            deepest = max(deepest, *depths)
        dev = rows.pending.device
        b = len(self.rows)
        tokens, parent, node_depth = host_to_device(ints, dev).view(b, 3, width).unbind(1)
        score = torch.tensor(scores, dtype=torch.float64, device="cpu").view(b, width)
        score = score if dev.type == "cpu" else score.pin_memory().to(dev, non_blocking=True)
        # The acceptance walk takes levels + 1 steps: as deep as the deepest trie, rounded up to a power of two (a
        # compiled step meets a few depths only).
        levels = min(depth, 1 << (deepest - 1).bit_length())
        tree = best_subtree(tokens, parent, node_depth, score, n, levels)
        seconds = time.perf_counter() - t0
        self._proposals += 1
        rate = max(0.1, 1.0 / self._proposals)
        self.row_seconds += rate * (seconds / max(b, 1) - self.row_seconds)
        return Proposal(tree, 0)


def _trie(root: int, found: list[tuple[int, list[int]]]) -> tuple[list[int], list[int], list[int], list[float]]:
    """One row's trie from ``(match length, continuation)`` pairs, root first and every node after its parent: its
    nodes' tokens, parents, depths and log-weights (the share of the matches' weight that continues along each node's
    path, a match weighing its length)."""
    children: dict[tuple[int, int], int] = {}
    weight, token, parent, depth = [0.0], [root], [-1], [0]
    total = 1.0  # a pseudo-match that continues nowhere: one match alone is not certain
    for m, continuation in found:
        total += m
        node = 0
        for t in continuation:
            child = children.get((node, t))
            if child is None:
                child = children[(node, t)] = len(token)
                token.append(t)
                parent.append(node)
                depth.append(depth[node] + 1)
                weight.append(0.0)
            weight[child] += m
            node = child
    return token, parent, depth, [0.0] + [math.log(w / total) for w in weight[1:]]
