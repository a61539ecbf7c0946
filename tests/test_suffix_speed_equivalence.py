"""The suffix drafter's batched search proposes the trees of a straightforward implementation, field for field: the
reference below searches each row in Python (a dictionary of place lists, a backwards comparison per place), builds
each row's trie with dictionaries and cuts the batch's tries with `best_subtree`. Both are driven through the same
random calls: rows that finish at different steps and are reordered by `select`, trees of every size, memories learnt
across calls within a small budget (prompts evicted, completions trimmed), saved and restored."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from fastgrpo.rollout.drafter import Emitted, Prefill
from fastgrpo.rollout.host import host_to_device, read_back
from fastgrpo.rollout.sequence import ActiveRows, Sequence, fill_holes
from fastgrpo.rollout.tree import DraftTree, TreeShape, best_subtree
from fastgrpo.speculative.suffix.drafter import SuffixDrafter
from fastgrpo.speculative.suffix.store import TokenStore

# -- the reference ---------------------------------------------------------------------------------------------------

KEY, PREFIX, MAX_MATCH, SCAN, CANDIDATES = 2, 8, 32, 64, 16
SHIFT, POS = 21, 1 << 24


class RefMemory:
    """One prompt's sequences as lists, and its index: key -> places (sequence << 24 | position), oldest first."""

    def __init__(self, prompt: list[int]):
        self.prompt = prompt
        self.seqs: list[list[int]] = []
        self.indexed: list[int] = []
        self.index: dict[int, list[int]] = {}
        self.last_used = -1
        self.add(prompt, prefix=0)

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.seqs)

    def add(self, tokens: list[int], prefix: int = PREFIX) -> int:
        head = self.prompt[-prefix:] if prefix else []
        self.seqs.append(list(head))
        self.indexed.append(max(len(head) - 1, 0))
        self.extend(len(self.seqs) - 1, tokens)
        return len(self.seqs) - 1

    def extend(self, sid: int, tokens: list[int]) -> None:
        seq = self.seqs[sid]
        seq.extend(tokens)
        start = max(self.indexed[sid], KEY - 1)
        for pos in range(start, len(seq) - 1):
            self.index.setdefault(seq[pos - 1] << SHIFT | seq[pos], []).append(sid * POS + pos)
        self.indexed[sid] = max(len(seq) - 1, start)

    def trim(self, tokens: int) -> None:
        kept, total = [], len(self.prompt)
        head = min(PREFIX, len(self.prompt))
        for seq in reversed(self.seqs[1:]):
            if total + len(seq) > tokens:
                break
            kept.append(seq[head:])
            total += len(seq)
        self.seqs, self.indexed, self.index = [], [], {}
        self.add(self.prompt, prefix=0)
        for completion in reversed(kept):
            self.add(completion)

    def continuations(self, context: list[int], depth: int) -> list[tuple[int, list[int]]]:
        """The `CANDIDATES` longest matches of the end of ``context`` among the key's `SCAN` newest places (the
        newest first on ties): (match length, the next ``depth`` tokens)."""
        if len(context) < KEY:
            return []
        places = self.index.get(context[-2] << SHIFT | context[-1], [])
        found = []
        tail = context[-MAX_MATCH:][::-1]
        for place in reversed(places[-SCAN:]):
            sid, pos = divmod(place, POS)
            seq = self.seqs[sid]
            m = KEY
            while m < min(len(tail), pos + 1) and seq[pos - m] == tail[m]:
                m += 1
            found.append((m, -len(found), seq[pos + 1 : pos + 1 + depth]))
        found.sort(reverse=True)
        return [(m, list(nxt)) for m, _, nxt in found[:CANDIDATES]]


def ref_trie(root: int, found: list[tuple[int, list[int]]]) -> tuple[list[int], list[int], list[int], list[float]]:
    """A row's trie: its nodes' tokens, parents, depths and log-weights, in the order the continuations meet them."""
    children: dict[tuple[int, int], int] = {}
    weight, token, parent, depth = [0.0], [root], [-1], [0]
    total = 1.0
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


class RefRow:
    def __init__(self, completion: list[int], memory: RefMemory, sid: int):
        self.completion, self.memory, self.sid, self.read = completion, memory, sid, 0

    def catch_up(self) -> None:
        new = self.completion[self.read :]
        if new:
            self.memory.extend(self.sid, new)
            self.read += len(new)


class RefLearner:
    """The memories within a budget: the prompts used most recently dropped first (not the current call's), then
    the largest prompts' oldest completions."""

    def __init__(self, budget: int):
        self.budget, self.prompts, self.calls, self.rows = budget, {}, 0, []

    def read_rows(self) -> None:
        for row in self.rows:
            row.catch_up()

    def memory(self, prompt: list[int]) -> RefMemory:
        mem = self.prompts.get(tuple(prompt))
        if mem is None:
            mem = self.prompts[tuple(prompt)] = RefMemory(list(prompt))
        mem.last_used = self.calls
        return mem

    @property
    def tokens(self) -> int:
        return sum(m.tokens for m in self.prompts.values())

    def evict(self) -> None:
        total = self.tokens
        for mem in sorted((m for m in self.prompts.values() if m.last_used < self.calls), key=lambda m: -m.last_used):
            if total <= self.budget:
                break
            total -= mem.tokens
            del self.prompts[tuple(mem.prompt)]

    def learn(self) -> dict[str, float]:
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
            prompts.append((m.prompt, [s[head:] for s in m.seqs[1:]], m.last_used))
        return {"calls": self.calls, "prompts": prompts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts, self.rows, self.calls = {}, [], state["calls"]
        for prompt, completions, last_used in state["prompts"]:
            mem = self.memory(prompt)
            for tokens in completions:
                mem.add(tokens)
            mem.last_used = last_used


class RefDrafter:
    """The suffix drafter row by row: each row reads its new tokens, then searches (so that it sees what the rows
    before it read in the step), and the batch's tries are cut by `best_subtree`."""

    def __init__(self, budget: int, max_depth: int = 16):
        self.learner, self.max_depth, self.rows = RefLearner(budget), max_depth, []

    def begin(self) -> None:
        self.learner.read_rows()
        self.learner.rows, self.rows = [], []
        self.learner.calls += 1

    def start(self, prompts: list[list[int]], row_prompt: list[int], seqs: list[Sequence]) -> None:
        memories = [self.learner.memory(p) for p in prompts]
        self.rows = [
            RefRow(s.completion_ids, memories[p], memories[p].add([])) for s, p in zip(seqs, row_prompt, strict=True)
        ]
        self.learner.rows = list(self.rows)
        self.learner.evict()

    def select(self, order: list[int]) -> None:
        for i, row in enumerate(self.rows):
            if i not in set(order):
                row.catch_up()
        self.rows = [self.rows[i] for i in order]

    def propose(self, shape: TreeShape) -> DraftTree:
        n, depth = shape.nodes, min(shape.nodes - 1, self.max_depth)
        tries = []
        for row in self.rows:
            row.catch_up()
            context = row.memory.prompt[-MAX_MATCH:] + row.completion[-MAX_MATCH:]
            tries.append(ref_trie(row.completion[-1], row.memory.continuations(context, depth)))
        width = max(n, *(len(tokens) for tokens, *_ in tries))
        ints, scores, deepest = [], [], 1
        for tokens, parents, depths, weights in tries:
            pad = width - len(tokens)
            ints += tokens + [0] * pad + parents + [0] * pad + depths + [1] * pad
            scores += weights + [-math.inf] * pad
            deepest = max(deepest, *depths)
        tokens, parent, node_depth = host_to_device(ints, torch.device("cpu")).view(len(self.rows), 3, width).unbind(1)
        score = torch.tensor(scores, dtype=torch.float64).view(len(self.rows), width)
        return best_subtree(tokens, parent, node_depth, score, n, min(depth, 1 << (deepest - 1).bit_length()))


# -- the drive -------------------------------------------------------------------------------------------------------

FIELDS = ("tokens", "parent", "node_depth", "ancestors", "rank", "score")


def assert_same(tree: DraftTree, ref: DraftTree, where: str) -> None:
    assert tree.levels == ref.levels, where
    for f in FIELDS:
        assert torch.equal(getattr(tree, f), getattr(ref, f)), f"{where}: {f}\n{getattr(tree, f)}\n{getattr(ref, f)}"


def completion(rng: random.Random, vocab: int, pool: list[list[int]]) -> list[int]:
    """Random tokens from a small vocabulary, often copying stretches of earlier completions (long matches)."""
    out: list[int] = []
    for _ in range(rng.randint(1, 6)):
        if pool and rng.random() < 0.6:
            src = rng.choice(pool)
            i = rng.randrange(len(src))
            out += src[i : i + rng.randint(1, 40)]
        else:
            out += [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
    return out[: rng.randint(1, 90)]


def run_call(rng, drafter: SuffixDrafter, ref: RefDrafter, prompts, completions, sizes, call: int) -> None:
    """One generation call, engine-like: propose, emit what the tree accepts (or a random count), drop the rows
    that finished (`fill_holes` order), until every row is done; every tree compared with the reference's."""
    rows = len(completions)
    row_prompt = [i * len(prompts) // rows for i in range(rows)]
    seqs = [Sequence(i, len(prompts[p]), [completions[i][0]]) for i, p in enumerate(row_prompt)]
    empty = torch.zeros(0)
    drafter.begin(rows, 1, TreeShape(16, 1, 16))
    drafter.start(Prefill(empty, empty, empty, empty, empty, empty, prompts, row_prompt, seqs))
    ref.begin()
    ref.start(prompts, row_prompt, seqs)
    live = list(range(rows))
    step = 0
    while True:
        keep = [k for k, i in enumerate(live) if len(seqs[i].completion_ids) < len(completions[i])]
        if len(keep) < len(live):
            order = fill_holes(keep)
            drafter.select(order, torch.tensor(order, dtype=torch.long))  # (as the engine does when none is left too)
            ref.select(order)
            live = [live[k] for k in order]
            if not keep:
                break
        shape = TreeShape(rng.choice(sizes), 1, 16, "suffix")
        active = [seqs[i] for i in live]
        zeros = torch.zeros(len(live), dtype=torch.long)
        rows_now = ActiveRows(active, zeros, zeros, [0] * len(live), zeros, zeros)
        tree = drafter.propose(rows_now, shape).tree
        assert_same(tree, ref.propose(shape), f"call {call} step {step} N={shape.nodes}")
        tokens, parents = read_back(tree.tokens, tree.parent)
        counts = []
        for b, i in enumerate(live):
            done, target = len(seqs[i].completion_ids), completions[i]
            children = {(p, t): j for j, (t, p) in enumerate(zip(tokens[b], parents[b], strict=True))}
            node, accepted = 0, 0
            while done + accepted < len(target) and (node, target[done + accepted]) in children:
                node, accepted = children[(node, target[done + accepted])], accepted + 1
            counts.append(min(accepted + 1 if rng.random() < 0.8 else rng.randint(1, 3), len(target) - done))
        drafter.accepted(rows_now, Emitted(empty, empty, torch.tensor(counts), counts))
        for i, count in zip(live, counts, strict=True):
            seq = seqs[i]
            seq.completion_ids.extend(completions[i][len(seq.completion_ids) :][:count])
        step += 1


@pytest.mark.parametrize("seed", range(12))
def test_the_batched_drafter_proposes_the_reference_trees(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12, 40])
    budget = rng.choice([300, 2_000, 100_000])
    max_depth = rng.choice([16, 16, 5])
    sizes = [2, 3, 4, 8, 16, 40] if seed % 2 else [4, 16]
    drafter, ref = SuffixDrafter(budget, max_depth), RefDrafter(budget, max_depth)
    drafter.learner.store = TokenStore(cells=rng.choice([200, 1 << 12]))  # a small store grows and moves its runs
    prompts = [[rng.randrange(vocab) for _ in range(rng.choice([1, 2, 5, 20, 40]))] for _ in range(6)]
    pool: list[list[int]] = []
    for call in range(6):
        chosen = rng.sample(prompts, rng.randint(1, 3))
        generations = rng.choice([1, 3, 8])
        completions = [completion(rng, vocab, pool) for _ in range(len(chosen) * generations)]
        pool += completions
        run_call(rng, drafter, ref, chosen, completions, sizes, call)
        proposed = drafter.price.sums[0] > 0
        assert (drafter.cost(8, TreeShape(16, 1, 16, "suffix")) > 0) == proposed, "priced by its measured proposals"
        assert drafter.learner.learn([]) == ref.learner.learn()
        assert drafter.learner.state_dict() == ref.learner.state_dict()
        if call == 2:  # a checkpoint: both drafters restored from it
            state = ref.learner.state_dict()
            drafter, ref = SuffixDrafter(budget, max_depth), RefDrafter(budget, max_depth)
            drafter.learner.load_state_dict(state)
            ref.learner.load_state_dict(state)


def test_a_prompt_memory_finds_the_reference_continuations() -> None:
    """`PromptMemory.continuations` against the reference's, for random contexts over random sequences, with
    short prompts (a context shorter than a match) and sequences that end right after a key."""
    from fastgrpo.speculative.suffix.drafter import PromptMemory

    rng = random.Random(0)
    for trial in range(40):
        vocab = rng.choice([2, 4, 9])
        prompt = [rng.randrange(vocab) for _ in range(rng.choice([1, 3, 12, 50]))]
        mem, ref = PromptMemory(prompt, TokenStore(cells=128)), RefMemory(prompt)
        for _ in range(rng.randint(0, 8)):
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
            sid = mem.add(tokens[:10])
            assert sid == ref.add(tokens[:10])
            mem.extend(sid, tokens[10:])
            ref.extend(sid, tokens[10:])
        for _ in range(5):
            context = [rng.randrange(vocab) for _ in range(rng.randint(1, 45))]
            depth = rng.choice([1, 3, 16])
            assert mem.continuations(context, depth) == ref.continuations(context, depth), (trial, context)


def test_the_store_keeps_sequences_across_moves_and_released_slots() -> None:
    store = TokenStore(cells=100)
    a = store.new([1, 2, 3], capacity=3)
    b = store.new([4])
    store.append(a, list(range(10, 90)))  # outgrows its run: moves, and the buffer grows
    store.release(b)
    c = store.new([7, 8])  # the released slot again
    assert c == b
    for _ in range(50):
        store.append(c, [9] * 5)
    assert store.read(a) == [1, 2, 3, *range(10, 90)]
    assert store.read(c) == [7, 8] + [9] * 250
    tokens, base, size, before, written = store.arrays()
    assert tokens[base[a] - 1] == -1 and tokens[base[c] - 1] == -1, "a gap before every sequence"
    assert (size[c], before[c], written[c]) == (252, 247, store.clock), "the slot as it was before its last append"
    assert written[a] < written[c]
