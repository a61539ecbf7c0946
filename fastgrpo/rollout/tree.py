"""Draft trees as the engine verifies them: a shape (how many nodes, how wide, how deep) and, per row, the nodes'
tokens, parents, depths and ancestor mask. A drafter proposes them (`fastgrpo.rollout.drafter`); `verify.accept`
walks them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeShape:
    """``nodes`` = N verified tokens per row (root included), ``top_k`` = K, ``max_levels`` = L draft levels at most
    (the option ``speculation.depth``); ``drafter``
    names who drafts it (`fastgrpo.rollout.drafter`): ``""`` the engine's only drafter, several names joined by
    ``+`` their trees merged into one of ``nodes`` nodes (`merge_trees`)."""

    nodes: int
    top_k: int
    max_levels: int
    drafter: str = ""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.top_k < 1 or self.max_levels < 1:
            raise ValueError(f"tree shape needs nodes, top_k, max_levels >= 1, got {self}")
        # hashed once: the adaptive controller looks shapes up in dicts many times a step
        object.__setattr__(self, "_hash", hash((self.nodes, self.top_k, self.max_levels, self.drafter)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:  # made anew on unpickling: a string's hash differs between processes
        return TreeShape, (self.nodes, self.top_k, self.max_levels, self.drafter)

    def fits_in(self, other: TreeShape) -> bool:
        """Whether its nodes, top_k and max_levels are each at most ``other``'s."""
        return self.nodes <= other.nodes and self.top_k <= other.top_k and self.max_levels <= other.max_levels

    @property
    def speculative(self) -> bool:
        return self.nodes > 1

    @property
    def levels(self) -> int:
        """Draft forwards a step of this shape costs (the catch-up included): none for a plain step, and no deeper
        than ``nodes - 1``, since a child never outscores its parent and no deeper node can be kept."""
        return 0 if self.nodes == 1 else min(self.max_levels, self.nodes - 1)


@dataclass
class DraftTree:
    """Per-row draft trees of ``N`` nodes; node 0 is the root (the row's pending, already-emitted token).

    tokens: ``[B, N]`` target token ids. parent: ``[B, N]`` parent node (-1 for the root).
    node_depth: ``[B, N]`` each node's depth (root 0). ancestors: ``[B, N, N]`` bool, ``[b, i, j]`` when node j is i
    or an ancestor of i.
    rank: ``[B, N]`` place of each node by score (root 0, best draft node 1): the best ``n - 1`` draft nodes of a row
    are those of rank ``1..n - 1``, the tree a shape of ``n`` nodes would have kept from the same candidates.
    levels: the deepest any node may be (known on the host: the shape's draft levels), so that the acceptance walk
    has a fixed number of steps.
    score: ``[B, N]`` float64 the drafter's log-probability of reaching each node (root 0, a padding node ``-inf``),
    never higher than its parent's; `merge_trees` ranks the nodes of several trees by it.
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    node_depth: torch.Tensor
    ancestors: torch.Tensor
    rank: torch.Tensor
    levels: int
    score: torch.Tensor | None = None


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


SCORE_FLOOR = -1e4  # a log-probability below it is no draft worth verifying (`merge_trees` ranks below it alike)


def empty_tree(rows: int, nodes: int, levels: int, device: torch.device) -> DraftTree:
    """``[rows, nodes]`` trees whose draft nodes are all children of the root and score ``-inf``: `merge_trees` keeps
    none of them over a drafted node scoring above `SCORE_FLOOR`, so that merging a tree with it gives that tree (a
    compiled proposal that merges another drafter's tree runs the same graph alone), filled up to ``nodes`` nodes with
    them where it holds fewer (each a draft of token 0, verified as any other)."""
    index = torch.arange(nodes, device=device).expand(rows, nodes)
    parent = torch.where(index > 0, 0, -1)
    ancestors = (index[:, :, None] == index[:, None, :]) | (index[:, None, :] == 0)
    score = torch.where(index > 0, -torch.inf, 0.0).double()
    return DraftTree(torch.zeros_like(index), parent, (index > 0).long(), ancestors, index.clone(), levels, score)


def pad_tree(tree: DraftTree, empty: DraftTree) -> DraftTree:
    """``tree`` ``[B, N]`` widened to the ``[B, W]`` of ``empty`` (`empty_tree`'s, its ``levels`` kept) by its
    padding nodes after ``tree``'s own (children of the root scoring ``-inf``): merged with another tree
    (`merge_trees`), it gives what ``tree`` gives."""
    n, width = tree.tokens.shape[1], empty.tokens.shape[1]

    def widen(own: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return torch.cat([own, padding[:, n:]], 1)

    ancestors = torch.nn.functional.pad(tree.ancestors, (0, width - n))
    return DraftTree(
        widen(tree.tokens, empty.tokens),
        widen(tree.parent, empty.parent),
        widen(tree.node_depth, empty.node_depth),
        widen(ancestors, empty.ancestors),
        widen(tree.rank, empty.rank),
        empty.levels,
        None if tree.score is None else widen(tree.score, empty.score),
    )


def cut_trees(tree: DraftTree, sizes: tuple[int, ...]) -> tuple[DraftTree, ...]:
    """The tree of every size of ``sizes`` (at most ``N``) that `best_subtree` cuts from ``tree`` ``[B, N]`` (with
    scores): for each, its best ``size - 1`` nodes, the tree a drafter would have kept of that size from the same
    candidates. Fixed shapes: one graph gives the trees of every size."""
    n = tree.tokens.shape[1]
    return tuple(
        tree if size == n else best_subtree(tree.tokens, tree.parent, tree.node_depth, tree.score, size, tree.levels)
        for size in sizes
    )


def _path_keys(tree: DraftTree) -> torch.Tensor:
    """``[B, N]`` int64 a hash of each node's path from the root (the set of its ancestors' (depth, token) pairs):
    equal paths get equal keys, different ones different keys but for a collision of 64-bit hashes."""
    x = (tree.tokens + 1) * -7046029254386353131 + tree.node_depth * -4417276706812531889  # odd 64-bit constants
    x = (x ^ (x >> 31)) * -4658895280553007687
    x = x ^ (x >> 29)
    return (tree.ancestors.long() * x[:, None, :]).sum(dim=2)


def merge_trees(first: DraftTree, second: DraftTree, nodes: int) -> DraftTree:
    """One tree of ``nodes`` nodes per row from two trees rooted at the same token: the nodes of the highest
    ``score`` of both (`best_subtree`), a path that both hold kept once (at the higher of its scores). Fixed shapes
    throughout (no value is read back)."""
    if first.score is None or second.score is None:
        raise ValueError("merging draft trees needs their node scores (DraftTree.score)")
    n1 = first.tokens.shape[1]
    same = _path_keys(second)[:, 1:, None] == _path_keys(first)[:, None, 1:]  # [B, N2 - 1, N1 - 1]
    duplicate = same.any(dim=2)
    twin = same.int().argmax(dim=2) + 1  # the first tree's node with the same path
    first_score = first.score.scatter_reduce(
        1, twin, torch.where(duplicate, second.score[:, 1:], -torch.inf), reduce="amax", include_self=True
    )
    # The second tree's nodes go after the first's; a child of a duplicate hangs from its twin in the first tree.
    parent2 = second.parent[:, 1:]
    parent_is_twin = duplicate.gather(1, (parent2 - 1).clamp(min=0)) & (parent2 > 0)
    moved = torch.where(parent2 > 0, parent2 - 1 + n1, 0)
    parent2 = torch.where(parent_is_twin, twin.gather(1, (parent2 - 1).clamp(min=0)), moved)
    tokens = torch.cat([first.tokens, second.tokens[:, 1:]], 1)
    parent = torch.cat([first.parent, parent2], 1)
    depth = torch.cat([first.node_depth, second.node_depth[:, 1:]], 1)
    score = torch.cat([first_score, torch.where(duplicate, -torch.inf, second.score[:, 1:])], 1)
    return best_subtree(tokens, parent, depth, score, nodes, max(first.levels, second.levels))


def best_subtree(
    tokens: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor, score: torch.Tensor, nodes: int, levels: int
) -> DraftTree:
    """The tree of the best ``nodes - 1`` candidates per row, re-indexed: the rule every drafter's trees are cut by.

    ``tokens``, ``parent``, ``depth`` and ``score`` (float64) are ``[B, M + 1]`` candidate nodes, the root at index 0
    (its parent -1) and every other node after its parent. A node never scores above its parent, so the best nodes
    always form a tree: scores below `SCORE_FLOOR` (padding's ``-inf`` among them) count as the floor, and ties go to
    the shallower node, a parent before its child. ``levels`` bounds the kept nodes' depth (`DraftTree.levels`)."""
    b, m = tokens.shape[0], tokens.shape[1] - 1
    keep = min(nodes - 1, m)
    score = score.clamp(min=SCORE_FLOOR)
    rank = score[:, 1:] - 1e-9 * depth[:, 1:]
    chosen, place = rank.topk(keep, dim=-1).indices.sort(dim=-1)  # ``place[b, j]``: chosen node j's place by score
    chosen = chosen + 1
    node_of = torch.zeros(b, m + 1, dtype=torch.long, device=tokens.device)
    node_of.scatter_(1, chosen, torch.arange(1, keep + 1, device=tokens.device).expand(b, keep))
    new_parent = torch.cat([parent[:, :1], node_of.gather(1, parent.gather(1, chosen))], 1)
    order = torch.cat([torch.zeros_like(chosen[:, :1]), chosen], 1)
    ranks = torch.cat([torch.zeros_like(place[:, :1]), place + 1], 1)
    return DraftTree(
        tokens.gather(1, order),
        new_parent,
        depth.gather(1, order),
        ancestor_mask(new_parent, levels),
        ranks,
        levels,
        score.gather(1, order),
    )
