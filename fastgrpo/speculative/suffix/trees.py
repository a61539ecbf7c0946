"""The suffix drafter's trees: per row, the trie of its candidates' continuations (`fastgrpo.speculative.suffix.search`)
cut to its best nodes, for all rows at once in a fixed number of array operations on the host (`draft_tree`).

A trie node is a prefix that one or more continuations start with, weighted by the match lengths of those that do,
and numbered in the order a walk through the continuations, longest match first, meets new prefixes. Nothing walks
the trie: sorted in lexicographic order, the continuations that share a prefix of ``d + 1`` tokens are a run of
that order (`_Runs`), which gives every node's weight, which candidate makes it and which nodes are its ancestors.

A row's tree holds its trie's best ``N - 1`` nodes by score (log of the weight's share), as `best_subtree` picks them:
from the trie's nodes in the order of their numbers, each row padded to the batch's widest trie, ranked by the same
float64 values with the same `torch.topk`, so that nodes of equal score are picked, and ranked, as it picks them. A
node never scores above its parent, so the best nodes form a tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from fastgrpo.rollout.tree import SCORE_FLOOR, DraftTree
from fastgrpo.speculative.suffix.search import CANDIDATES, MAX_MATCH, Matches

_TOTALS = 2 + CANDIDATES * MAX_MATCH  # the trie weights' totals are below it
_DEEPER = np.float32(1e-9)  # `best_subtree`'s rank: score - 1e-9 * depth, the product in float32 as torch makes it
_PADDING = SCORE_FLOOR - np.float64(_DEEPER * np.float32(1))  # the rank of a padding node (score -inf, depth 1)


@dataclass
class HostTree:
    """Draft trees as built on the host: ``ints`` ``[4, B, N]`` the nodes' tokens, parents, depths and ranks (see
    `DraftTree`), ``ancestors`` ``[B, N, N]`` bool, ``score`` ``[B, N]`` float64 and ``levels``."""

    ints: np.ndarray
    ancestors: np.ndarray
    score: np.ndarray
    levels: int

    def to(self, device: torch.device) -> DraftTree:
        """The `DraftTree` on ``device`` (from pinned memory, without waiting for the device, when it is not the
        host)."""
        ints, ancestors, score = (torch.from_numpy(a) for a in (self.ints, self.ancestors, self.score))
        if device.type != "cpu":
            ints, ancestors, score = (t.pin_memory().to(device, non_blocking=True) for t in (ints, ancestors, score))
        tokens, parent, node_depth, rank = ints.unbind(0)
        return DraftTree(tokens, parent, node_depth, ancestors, rank, self.levels, score)


def draft_tree(matches: Matches, nodes: int, depth: int) -> HostTree:
    """Per row, the tree of the best ``nodes - 1`` nodes of the trie of its candidates' continuations (``depth``
    tokens each at most), rooted at the row's last token. A row with fewer trie nodes is padded with nodes of token
    0 under the root, scored `SCORE_FLOOR`, after its own (a row without candidates has padding only)."""
    b, rows = len(matches.last), matches.rows
    ints, ancestors, score = _padding(nodes)
    ints, ancestors, score = ints.repeat(b, axis=1), ancestors.repeat(b, axis=0), score.repeat(b, axis=0)
    ints[0, :, 0] = matches.last
    width, deepest = nodes, 1
    if len(rows):
        found, width = _trees(matches, nodes, depth)
        ints[:, rows, 1:], ancestors[rows], score[rows, 1:] = found
        deepest = int(matches.ahead.max())
    if len(rows) < b:
        alone = np.ones(b, dtype=bool)
        alone[rows] = False
        ints[3, alone, 1:] = _padding_ranks(nodes, width)
    return HostTree(ints, ancestors, score, min(depth, 1 << (deepest - 1).bit_length()))


def _trees(matches: Matches, nodes: int, depth: int) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], int]:
    """The trees of the rows with candidates: ``[4, F, N - 1]`` their nodes' tokens, parents, depths and ranks (the
    root's left out), ``[F, N, N]`` ancestors and ``[F, N - 1]`` scores; and the width of the batch's tries (the
    largest trie, the root included, or ``nodes``)."""
    length, cont, ahead = matches.length, matches.tokens, matches.ahead
    f, c = length.shape
    keep, cells = nodes - 1, c * depth
    level = np.arange(depth)
    runs = _Runs(cont, ahead, length)
    # Candidate i adds the nodes of its depths from the longest prefix it shares with an earlier candidate on: the
    # nodes are numbered in the order of their cells (candidate, depth).
    shared = runs.shared()  # [F, C]
    is_new = ((level >= shared[:, :, None]) & (level < ahead[:, :, None])).reshape(f, cells)
    number = is_new.cumsum(1)  # [F, C * D] a new node's number (the root is 0)
    width = max(nodes, 1 + int(number[:, -1].max()))
    shares = _TOTALS * (1 + length.sum(1))  # each row's row of `log_shares`, flat
    # The new nodes in the order of their numbers, as `best_subtree` ranks them, each row padded to ``width``.
    new = np.flatnonzero(is_new)
    new_row, new_cell = np.divmod(new, cells)
    new_candidate, new_depth = np.divmod(new_cell, depth)
    at = new_row * (width - 1) + number.ravel().take(new) - 1
    weight = runs.weight(new_row, new_candidate, new_depth)
    rank = np.full((f, width - 1), _PADDING)
    rank.ravel()[at] = log_shares().take(shares.take(new_row) + weight) - _deeper(depth).take(new_depth)
    node_of = np.full(f * (width - 1), len(new))  # the new node of each number (past them: padding)
    node_of[at] = np.arange(len(new))
    chosen, place = torch.from_numpy(rank).topk(keep, dim=1).indices.sort()
    node = node_of.take(chosen.numpy() + np.arange(f)[:, None] * (width - 1))
    real = node < len(new)
    node = np.minimum(node, len(new) - 1)
    row = np.broadcast_to(np.arange(f)[:, None], node.shape)
    candidate, node_depth = new_candidate.take(node), new_depth.take(node)
    # Node k is an ancestor of node j (or j itself) when k is no deeper and j's candidate is in k's run.
    ancestors = np.ones((f, nodes, nodes), dtype=bool)  # the root's column
    ancestors[:, :, 1:] = _eye(nodes)[:, 1:]
    ancestors[:, 1:, 1:] |= runs.within(row, candidate, node_depth) & real[:, :, None] & real[:, None, :]
    out = np.empty((4, f, keep), dtype=np.int64)
    out[0] = np.where(real, cont.ravel().take((row * c + candidate) * depth + node_depth), 0)
    # The parent: the ancestor one level up (the root for padding, which has no such ancestor).
    reach = np.zeros((f, nodes), dtype=np.int64)
    reach[:, 1:] = np.where(real, node_depth + 1, depth + 2)
    out[1] = (ancestors & (reach[:, None, :] == reach[:, :, None] - 1)).argmax(2)[:, 1:]
    out[2] = np.where(real, node_depth + 1, 1)
    out[3] = place.numpy() + 1
    score = np.where(real, log_shares().take(shares.take(row) + weight.take(node)), SCORE_FLOOR)
    return (out, ancestors, score), width


class _Runs:
    """A row's candidates in lexicographic order of their continuations (``cont`` ``[F, C, D]``, of which the first
    ``ahead`` ``[F, C]`` tokens exist, -1 after; ``length`` ``[F, C]`` their match lengths): at each depth ``d``,
    the continuations that share their first ``d + 1`` tokens are a run of that order. A run is a trie node (or a
    continuation that ended before ``d``, alone): its weight is its members' match lengths, its number is given by
    its first member in the order of the candidates."""

    def __init__(self, cont: np.ndarray, ahead: np.ndarray, length: np.ndarray):
        f, c, d = cont.shape
        self.shape = cont.shape
        # Any lexicographic order will do: the tokens' big-endian bytes, compared as one string per continuation.
        self.order = np.argsort(cont.astype(">i4").view(np.dtype((np.void, 4 * d))).reshape(f, c), axis=1)
        flat = self.order + np.arange(f)[:, None] * c
        ordered = cont.reshape(f * c, d).take(flat, axis=0)  # [F, C, D]
        differ = np.ones((f, c, d + 1), dtype=bool)
        differ[:, 1:, :d] = ordered[:, 1:] != ordered[:, :-1]
        following = np.minimum(differ.argmax(2), ahead.take(flat))  # [F, C]: tokens shared with the one before
        following[:, 0] = -1
        # A run starts where a continuation shares less than d + 1 tokens with the one before: [F, D, C] flat.
        starts = (following[:, None, :] <= np.arange(d)[:, None]).ravel()
        self.run = starts.cumsum() - 1  # the run of each (row, depth, place in the order)
        first = np.flatnonzero(starts)
        self.weights = np.add.reduceat(np.broadcast_to(length.take(flat)[:, None, :], (f, d, c)).ravel(), first)
        self.first = np.minimum.reduceat(np.broadcast_to(self.order[:, None, :], (f, d, c)).ravel(), first)
        self.place = np.argsort(self.order, axis=1)  # each candidate's place in the order

    def _cell(self, row: np.ndarray, candidate: np.ndarray, depth: np.ndarray) -> np.ndarray:
        """The flat ``[F, D, C]`` (row, depth, place in the order) index of candidate ``candidate`` of row ``row`` at
        depth ``depth``."""
        f, c, d = self.shape
        return (row * d + depth) * c + self.place.ravel().take(row * c + candidate)

    def shared(self) -> np.ndarray:
        """``[F, C]`` how many first tokens each candidate shares with an earlier candidate at most: the depths at
        which its run has an earlier candidate."""
        f, c, d = self.shape
        earlier = self.first.take(self.run).reshape(f, d, c) < self.order[:, None, :]
        return earlier.sum(1).take(self.place + np.arange(f)[:, None] * c)

    def weight(self, row: np.ndarray, candidate: np.ndarray, depth: np.ndarray) -> np.ndarray:
        """The weight of the node of candidate ``candidate`` of row ``row`` at depth ``depth``."""
        return self.weights.take(self.run.take(self._cell(row, candidate, depth)))

    def within(self, row: np.ndarray, candidate: np.ndarray, depth: np.ndarray) -> np.ndarray:
        """``[F, K, K]`` for nodes ``[F, K]`` (a row, candidate and depth each): ``[f, j, k]`` when node k is node
        j or an ancestor of it (no deeper, and j's candidate in its run)."""
        node_run = self.run.take(self._cell(row, candidate, depth))  # [F, K]
        there = self.run.take(self._cell(row[:, :, None], candidate[:, :, None], depth[:, None, :]))
        return (there == node_run[:, None, :]) & (depth[:, None, :] <= depth[:, :, None])


@cache
def _eye(n: int) -> np.ndarray:
    """``[n, n]`` bool identity (read-only, shared)."""
    eye = np.eye(n, dtype=bool)
    eye.flags.writeable = False
    return eye


@cache
def _padding(nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A row's tree of padding alone (its root token 0): ``[4, 1, N]`` tokens, parents, depths and ranks,
    ``[1, N, N]`` ancestors and ``[1, N]`` scores."""
    ints = np.zeros((4, 1, nodes), dtype=np.int64)
    ints[1, 0, 0] = -1
    ints[2, 0, 1:] = 1
    ints[3, 0] = np.arange(nodes)
    ancestors = np.eye(nodes, dtype=bool)[None]
    ancestors[0, :, 0] = True
    score = np.full((1, nodes), SCORE_FLOOR)
    score[0, 0] = 0.0
    for shared in (ints, ancestors, score):
        shared.flags.writeable = False
    return ints, ancestors, score


@cache
def _deeper(depth: int) -> np.ndarray:
    """``[D]`` float64 what `best_subtree`'s rank takes off a node's score at each depth below the root."""
    deeper = (_DEEPER * np.arange(1, depth + 1, dtype=np.float32)).astype(np.float64)
    deeper.flags.writeable = False
    return deeper


@cache
def _padding_ranks(nodes: int, width: int) -> np.ndarray:
    """``[N - 1]`` the ranks of a tree of padding alone, cut from a trie as wide as ``width`` (all of its nodes
    padding) as `best_subtree` cuts it."""
    rank = torch.full((1, width - 1), _PADDING, dtype=torch.float64, device="cpu")
    ranks = rank.topk(nodes - 1, dim=1).indices.sort().indices[0].numpy() + 1
    ranks.flags.writeable = False
    return ranks


@cache
def log_shares() -> np.ndarray:
    """``[T, T]`` float64 ``log(w / t)`` at ``[t, w]`` (``math.log``'s, bit for bit; `SCORE_FLOOR` for a weight of
    0), for the totals of a trie's weights (``T``: `_TOTALS`). Built once per process, by the first `SuffixDrafter`
    made: built by a proposal, it would take tens of times a proposal's time, which the drafter's price times."""
    shares = np.array(
        [[math.log(w / t) if 0 < w <= t else SCORE_FLOOR for w in range(_TOTALS)] for t in range(_TOTALS)]
    )
    shares.flags.writeable = False
    return shares
