"""Batched EAGLE-2 style draft trees: expand the top-K children of the best K nodes per level, then keep the best
``N - 1`` nodes by cumulative log-probability. Every row of the batch is expanded at once (no loop over rows).

A child's cumulative log-probability never exceeds its parent's, so the kept nodes always form a tree rooted at the
row's pending token (node 0). Ties are broken towards shallower nodes for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.runner import forward_block
from fastgrpo.spec.draft import DraftHead


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
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    rank: torch.Tensor


def ancestor_mask(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[B, N] -> [B, N, N]`` ancestor-or-self mask from parent indices (-1 for roots)."""
    b, n = parent.shape
    anc = torch.eye(n, dtype=torch.bool, device=parent.device).expand(b, n, n).clone()
    cur = parent.clone()
    rows = torch.arange(b, device=parent.device)[:, None].expand(b, n)
    cols = torch.arange(n, device=parent.device)[None, :].expand(b, n)
    for _ in range(max_depth):
        ok = cur >= 0
        anc[rows[ok], cols[ok], cur[ok]] = True
        cur = torch.where(ok, parent.gather(1, cur.clamp(min=0)), cur)
    return anc


def _topk_logprobs(draft: DraftHead, lm_head: nn.Module, hidden: torch.Tensor, k: int):
    """Top-``k`` draft tokens (target ids) and their log-probabilities for ``[..., H]`` hidden states."""
    logp = torch.log_softmax(draft.logits(hidden, lm_head).float(), dim=-1)
    values, ids = logp.topk(k, dim=-1)
    return draft.to_target_ids(ids), values


@torch.no_grad()
def expand_tree(
    draft: DraftHead,
    embed: nn.Module,
    lm_head: nn.Module,
    cache: RowCache,
    draft_len: torch.Tensor,
    root_token: torch.Tensor,
    root_hidden: torch.Tensor,
    root_position: torch.Tensor,
    shape: TreeShape,
) -> DraftTree:
    """Draft a tree per row.

    Args:
        cache: the draft's cache; its first ``draft_len[b]`` slots hold the row's context, the root pair last.
        root_token: ``[B]`` the pending token. root_hidden: ``[B, H]`` the draft's output for the root pair.
        root_position: ``[B]`` position of the root token.
        shape: N, K, L; uses ``min(L, N - 1) - 1`` draft forwards (the root's output was computed by the caller;
            no node deeper than ``N - 1`` can be kept, because a child never outscores its parent).
    """
    b, dev = root_token.shape[0], root_token.device
    k = shape.top_k
    tok, score = _topk_logprobs(draft, lm_head, root_hidden, k)  # [B, K]
    cand_tok, cand_score = [tok], [score]
    cand_parent = [torch.full((b, k), -1, device=dev)]
    cand_depth = [torch.ones(b, k, dtype=torch.long, device=dev)]
    frontier = torch.arange(k, device=dev).expand(b, k)  # candidate index of each frontier node
    frontier_feat = root_hidden[:, None, :].expand(b, k, -1)
    levels = shape.levels
    width = (levels - 1) * k
    seen = torch.zeros(b, k, max(width, 1), dtype=torch.bool, device=dev)  # window slots each frontier node sees
    n_cand = k
    for level in range(1, levels):
        offsets = torch.arange((level - 1) * k, level * k, device=dev)
        seen[:, torch.arange(k), offsets] = True
        x = draft.features(embed(tok), frontier_feat)
        positions = (root_position + level)[:, None].expand(b, k)
        out = forward_block(
            draft.decoder, cache, draft_len, offsets, positions, seen[:, :, : level * k], inputs_embeds=x
        )
        child_tok, child_lp = _topk_logprobs(draft, lm_head, out, k)  # [B, K, K]
        child_score = (score[:, :, None] + child_lp).reshape(b, k * k)
        cand_tok.append(child_tok.reshape(b, k * k))
        cand_score.append(child_score)
        cand_parent.append(frontier[:, :, None].expand(b, k, k).reshape(b, k * k))
        cand_depth.append(torch.full((b, k * k), level + 1, device=dev))
        score, best = child_score.topk(k, dim=-1)  # next frontier: the best K children
        tok = child_tok.reshape(b, k * k).gather(1, best)
        parent_slot = best // k
        frontier = n_cand + best
        frontier_feat = out.gather(1, parent_slot[:, :, None].expand(b, k, out.shape[-1]))
        seen = seen.gather(1, parent_slot[:, :, None].expand(b, k, seen.shape[-1]))
        n_cand += k * k
    return _select(root_token, cand_tok, cand_score, cand_parent, cand_depth, shape.nodes, levels)


def _select(
    root_token: torch.Tensor,
    cand_tok: list[torch.Tensor],
    cand_score: list[torch.Tensor],
    cand_parent: list[torch.Tensor],
    cand_depth: list[torch.Tensor],
    nodes: int,
    levels: int,
) -> DraftTree:
    """Keep the best ``N - 1`` candidates (by score, shallower first on ties) and index them as a tree."""
    tok, score = torch.cat(cand_tok, 1), torch.cat(cand_score, 1)
    parent, depth = torch.cat(cand_parent, 1), torch.cat(cand_depth, 1)
    b, m = tok.shape
    keep = min(nodes - 1, m)
    rank = score.double() - 1e-9 * depth
    # Sorted by candidate index, parents precede children; ``place[b, j]`` is chosen node j's place by score.
    chosen, place = rank.topk(keep, dim=-1).indices.sort(dim=-1)
    node_of = torch.zeros(b, m + 1, dtype=torch.long, device=tok.device)  # candidate -> node (slot m: the root)
    node_of.scatter_(1, chosen, torch.arange(1, keep + 1, device=tok.device).expand(b, keep))
    cand_parent = parent.gather(1, chosen)
    tree_parent = node_of.gather(1, torch.where(cand_parent < 0, m, cand_parent))
    minus_one = torch.full((b, 1), -1, dtype=torch.long, device=tok.device)
    tree_parent = torch.cat([minus_one, tree_parent], 1)
    tokens = torch.cat([root_token[:, None], tok.gather(1, chosen)], 1)
    depths = torch.cat([torch.zeros_like(minus_one), depth.gather(1, chosen)], 1)
    ranks = torch.cat([torch.zeros_like(minus_one), place + 1], 1)
    return DraftTree(tokens, tree_parent, depths, ancestor_mask(tree_parent, levels), ranks)
