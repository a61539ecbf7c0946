"""The EAGLE drafter's tree as functions of tensors (`fastgrpo.speculative.eagle.drafter` runs them): the catch-up
of a row's pending (token, target hidden state) pairs into the draft's cache, the expansion of an EAGLE-2 tree from
the last one, and both, with a merge into another drafter's tree, as one graph for ``torch.compile``
(`draft_step`)."""

from __future__ import annotations

import torch
from torch import nn

from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.forward import forward_block, forward_chain
from fastgrpo.rollout.tree import DraftTree, TreeShape, best_subtree, cut_trees, merge_trees
from fastgrpo.speculative.eagle.head import DraftHead


def catch_up(
    draft: DraftHead,
    embed: nn.Module,
    cache: RowCache,
    draft_len: torch.Tensor,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    count: torch.Tensor,
    extent: int,
) -> torch.Tensor:
    """Feed each row's first ``count[b]`` pending pairs (``tokens`` ``[B, W]``, the target's hidden states before
    them ``[B, W, H]``) into the draft cache after its ``draft_len`` ``[B]`` filled slots (the columns past
    ``count[b]`` write slots that later pairs overwrite and no query reads), reading ``extent`` slots; returns
    ``[B, H]`` the draft's output for each row's last pair read."""
    x = draft.features(embed(tokens), hidden)
    out = forward_chain(draft.decoder, cache, draft_len, inputs_embeds=x, position_offset=1, extent=extent)
    return out[torch.arange(out.shape[0], device=out.device), count - 1]


@torch.no_grad()
def draft_step(
    draft: DraftHead,
    embed: nn.Module,
    lm_head: nn.Module,
    cache: RowCache,
    draft_len: torch.Tensor,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    count: torch.Tensor,
    root_token: torch.Tensor,
    root_position: torch.Tensor,
    shape: TreeShape,
    longest: int,
    other: DraftTree,
    sizes: tuple[int, ...],
) -> tuple[tuple[DraftTree, ...], torch.Tensor]:
    """A compiled proposal in one graph: `catch_up` the pending pairs (``tokens``, ``hidden``, ``count`` as there,
    reading ``longest`` slots), `expand_tree` from each row's last one, `merge_trees` this drafter's tree with
    ``other`` (``[B, N]`` trees of another drafter, or `fastgrpo.rollout.tree.empty_tree`'s: the tree alone) and cut
    the merged tree to every size of ``sizes`` (`cut_trees`: one graph for the trees of every size). Returns the
    trees and ``[B]`` the filled draft slots after the catch-up."""
    root_hidden = catch_up(draft, embed, cache, draft_len, tokens, hidden, count, longest)
    draft_len = draft_len + count
    tree = expand_tree(draft, embed, lm_head, cache, draft_len, root_token, root_hidden, root_position, shape, longest)
    return cut_trees(merge_trees(tree, other, shape.nodes), sizes), draft_len


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
    longest: int,
) -> DraftTree:
    """Draft a tree per row.

    Args:
        cache: the draft's cache; its first ``draft_len[b]`` slots hold the row's context, the root pair last.
        longest: at least ``max(draft_len)``, known on the host (level ``l`` reads ``longest + l * K`` slots).
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
        seen[:, torch.arange(k, device=dev), offsets] = True
        x = draft.features(embed(tok), frontier_feat)
        positions = (root_position + level)[:, None].expand(b, k)
        out = forward_block(
            draft.decoder,
            cache,
            draft_len,
            offsets,
            positions,
            seen[:, :, : level * k],
            inputs_embeds=x,
            extent=longest + level * k,
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
    """The expansion's candidates (their parents as candidate indices, -1 for the root) as `best_subtree` takes them:
    the root first, every candidate one place on."""
    root = torch.full_like(root_token[:, None], -1)
    parent = torch.cat(cand_parent, 1)
    return best_subtree(
        torch.cat([root_token[:, None], *cand_tok], 1),
        torch.cat([root, torch.where(parent < 0, 0, parent + 1)], 1),
        torch.cat([torch.zeros_like(root), *cand_depth], 1),
        torch.cat([torch.zeros_like(root, dtype=torch.float64), *(s.double() for s in cand_score)], 1),
        nodes,
        levels,
    )
