"""What the adaptive controller (`fastgrpo.speculative.controller`) reads of acceptance: per depth, the fraction of
a step's rows that accepted a draft token (`depth_fractions`), what each smaller tree of the same draft candidates
would have accepted on that step (`nested_acceptance`), and every shape's estimate from the measured ones
(`estimates`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from fastgrpo.rollout.tree import TreeShape


def depth_fractions(accepted: list[int], depth_cap: int) -> list[float]:
    """Draft tokens each of ``B`` rows accepted -> per depth up to ``depth_cap``, the fraction of rows that accepted
    a token at that depth."""
    rows, counts = max(len(accepted), 1), [0] * (depth_cap + 1)
    for a in accepted:
        counts[min(a, depth_cap)] += 1
    above = list(itertools.accumulate(reversed(counts[1:])))[::-1]  # above[d]: rows that accepted more than d
    return [n / rows for n in above]


def nested_acceptance(
    candidates: list[TreeShape],
    levels: Callable[[TreeShape], int],
    path_rank: np.ndarray | list[list[int]],
    depth_cap: int,
) -> list[list[float]]:
    """For each of ``candidates`` (trees of the same draft candidates, no bigger than the one verified), per depth up
    to ``depth_cap``, the fraction of rows that would have accepted a draft token at that depth on this step: a tree
    of ``n`` nodes keeps the best ``n - 1`` candidates down to its own depth (``levels``), so a row accepts the
    leading nodes of its path (``path_rank`` ``[B, D]`` int: the score ranks of its accepted path, the tree's size
    past it) of rank below ``n``: those whose running maximum rank is below ``n``. (EAGLE-2 expands only the best K
    nodes of each level, so a smaller K can expand a node a larger one does not; the estimate ignores that.)"""
    highest = np.maximum.accumulate(np.asarray(path_rank)[:, :depth_cap], axis=1)  # [B, D]
    sizes = np.array([c.nodes for c in candidates], dtype=highest.dtype)
    reached = ((highest[:, :, None] < sizes).sum(axis=0) / max(len(highest), 1)).T.tolist()  # [C, D]
    padding = [0.0] * depth_cap
    return [(r[: levels(c)] + padding)[:depth_cap] for c, r in zip(candidates, reached, strict=True)]


def estimates(
    shapes: set[TreeShape],
    measured: dict[TreeShape, list[float]],
    pooled: list[float],
    levels: Callable[[TreeShape], int],
) -> dict[TreeShape, list[float]]:
    """Per-depth fractions of every one of one drafter's ``shapes``, smallest first: a ``measured`` shape's own
    averages, raised at each depth to those of the smaller measured shapes (a bigger tree accepts at least what a
    smaller one drafted from the same candidates does: the rare steps of a big tree, on other text, must not rank it
    below a small one); a shape never measured takes the biggest smaller measured one's, and the ``pooled`` averages
    deeper."""
    result: dict[TreeShape, list[float]] = {}
    floor: list[float] = []  # the biggest measured shape so far, down to its depth
    for shape in sorted(shapes, key=lambda s: (s.nodes, s.max_levels, s.top_k)):
        own = measured.get(shape)
        if own is None:
            result[shape] = floor + pooled[len(floor) :]
            continue
        fractions = [max(o, floor[d]) if d < len(floor) else o for d, o in enumerate(own)]
        result[shape] = fractions
        floor = fractions[: levels(shape)]
    return result
