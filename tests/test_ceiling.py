"""The acceptance ceiling estimated along sampled paths, against exact values on a Markov chain, where the best tree
of every size can be found by enumeration."""

from __future__ import annotations

import heapq

import pytest
import torch
from ceiling import CompletionRanks, depth_bound, depth_in_full_tree, nodes_needed

VOCAB, LENGTH = 5, 20_000


@pytest.fixture(scope="module")
def chain() -> tuple[torch.Tensor, torch.Tensor]:
    """A Markov chain's ``[V, V]`` transition matrix and ``[LENGTH + 1]`` states sampled from it."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(VOCAB, VOCAB, generator=gen, dtype=torch.float64) ** 4  # peaked, as text is
    transitions = weights / weights.sum(-1, keepdim=True)
    states = [0]
    for u in torch.rand(LENGTH, generator=gen, dtype=torch.float64):
        cdf = transitions[states[-1]].cumsum(0)
        states.append(min(int((cdf < u).sum()), VOCAB - 1))
    return transitions, torch.tensor(states)


def completion(transitions: torch.Tensor, states: torch.Tensor) -> tuple[CompletionRanks, torch.Tensor]:
    """The ranks of completion tokens ``states[1:]``, and the state each root decodes from (``[C - 1]``)."""
    logprobs = transitions[states[:-1]].log()
    tokens = states[1:]
    return CompletionRanks.from_logprobs(logprobs, tokens, VOCAB), tokens[:-1]


def best_tree(transitions: torch.Tensor, state: int, nodes: int) -> float:
    """Expected accepted length of the best ``nodes``-node tree from ``state``: 1 + the sum of the ``nodes - 1``
    most probable continuations' probabilities (best-first enumeration)."""
    heap = [(-float(p), w) for w, p in enumerate(transitions[state])]
    heapq.heapify(heap)
    total = 1.0
    for _ in range(nodes - 1):
        neg, w = heapq.heappop(heap)
        total -= neg
        for v, p in enumerate(transitions[w]):
            heapq.heappush(heap, (neg * float(p), v))
    return total


def greedy_chain(transitions: torch.Tensor, state: int, levels: int) -> float:
    """Expected accepted length of a chain of the target's most probable tokens."""
    total, reach = 1.0, 1.0
    for _ in range(levels):
        reach *= float(transitions[state].max())
        state = int(transitions[state].argmax())
        total += reach
    return total


def by_root_state(values: torch.Tensor, roots: torch.Tensor) -> dict[int, float]:
    """Mean of ``[C - 1]`` per-root values over the roots decoding from each state (states with enough roots)."""
    return {s: float(values[roots == s].double().mean()) for s in range(VOCAB) if (roots == s).sum() >= 500}


@pytest.mark.parametrize("levels", [1, 2, 4])
def test_a_perfect_chain_accepts_what_its_probabilities_say(chain, levels: int) -> None:
    transitions, states = chain
    ranks, roots = completion(transitions, states)
    depth = depth_in_full_tree(ranks.target[None].expand(levels, -1), 1, levels)
    for state, mean in by_root_state(depth, roots).items():
        assert 1 + mean == pytest.approx(greedy_chain(transitions, state, levels), abs=0.05), f"from state {state}"


def test_the_bound_is_exact_for_two_nodes_and_never_below_the_best_tree(chain) -> None:
    transitions, states = chain
    ranks, roots = completion(transitions, states)
    need = nodes_needed(ranks, max_depth=7)
    for nodes in range(2, 9):
        for state, mean in by_root_state(depth_bound(need, nodes), roots).items():
            best = best_tree(transitions, state, nodes)
            if nodes == 2:  # the best tree is the most probable token
                assert 1 + mean == pytest.approx(best, abs=0.05), f"from state {state}"
            assert 1 + mean >= best - 0.05, f"{nodes} nodes from state {state}: bound below the best tree"
            assert 1 + mean <= nodes
