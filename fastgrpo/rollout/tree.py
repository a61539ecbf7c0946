"""Draft trees as the engine verifies them: a shape (how many nodes, how wide, how deep) and, per row, the nodes'
tokens, parents, depths and ancestor mask. A drafter proposes them (`fastgrpo.rollout.drafter`); `verify.accept`
walks them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeShape:
    """``nodes`` = N verified tokens per row (root included), ``top_k`` = K, ``depth`` = L draft levels."""

    nodes: int
    top_k: int
    depth: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.top_k < 1 or self.depth < 1:
            raise ValueError(f"tree shape needs nodes, top_k, depth >= 1, got {self}")

    @property
    def speculative(self) -> bool:
        return self.nodes > 1

    @property
    def levels(self) -> int:
        """Draft forwards a step of this shape costs (the catch-up included): none for a plain step, and no deeper
        than ``nodes - 1``, since a child never outscores its parent and no deeper node can be kept."""
        return 0 if self.nodes == 1 else min(self.depth, self.nodes - 1)


@dataclass
class DraftTree:
    """Per-row draft trees of ``N`` nodes; node 0 is the root (the row's pending, already-emitted token).

    tokens: ``[B, N]`` target token ids. parent: ``[B, N]`` parent node (-1 for the root).
    depth: ``[B, N]`` (root 0). ancestors: ``[B, N, N]`` bool, ``[b, i, j]`` when node j is i or an ancestor of i.
    rank: ``[B, N]`` place of each node by score (root 0, best draft node 1): the best ``n - 1`` draft nodes of a row
    are those of rank ``1..n - 1``, the tree a shape of ``n`` nodes would have kept from the same candidates.
    levels: the deepest any node may be (known on the host: the shape's draft levels), so that the acceptance walk
    has a fixed number of steps.
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    rank: torch.Tensor
    levels: int


def ancestor_mask(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[B, N] -> [B, N, N]`` ancestor-or-self mask from parent indices (-1 for roots), in fixed-shape steps."""
    n = parent.shape[1]
    nodes = torch.arange(n, device=parent.device)
    anc = parent[:, :, None] == nodes  # [B, N, N]: the parent of each node
    anc |= nodes[:, None] == nodes  # and itself
    cur = parent
    for _ in range(max_depth - 1):
        cur = torch.where(cur >= 0, parent.gather(1, cur.clamp(min=0)), cur)
        anc |= cur[:, :, None] == nodes
    return anc
