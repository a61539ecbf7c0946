"""What the adaptive controller prices several drafters by: each drafter alone, and their trees merged into one
(`fastgrpo.rollout.tree.merge_trees`) as one more candidate."""

from __future__ import annotations

from fastgrpo.rollout.drafter import Drafter
from fastgrpo.rollout.tree import TreeShape


class MergedDrafters(Drafter):
    """The pricing of several drafters whose trees are merged into one: each proposes a tree of the shape."""

    def __init__(self, parts: list[Drafter]):
        self.parts = parts
        self.name = "+".join(p.name for p in parts)

    def cost(self, rows: int, shape: TreeShape, backlog: int = 1) -> float:
        return sum(p.cost(rows, shape, backlog) for p in self.parts)

    def deepest(self, shape: TreeShape) -> int:
        return max(p.deepest(shape) for p in self.parts)


def priced(drafters: list[Drafter]) -> dict[str, Drafter]:
    """What the adaptive controller chooses among, by name: each drafter and, with several, their merged trees."""
    named = {d.name: d for d in drafters}
    if len(drafters) > 1:
        merged = MergedDrafters(drafters)
        named[merged.name] = merged
    return named
