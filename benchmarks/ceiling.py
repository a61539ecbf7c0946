"""How many tokens per target forward a speculative step could get accepted, measured along sampled completions.

Each position of a completion the target sampled is taken as the root of a speculative step, and the tokens the
target sampled next are the continuation that step would have emitted. Two facts make the accepted length a
function of that continuation's ranks and probabilities alone, so averaging over roots estimates it without bias:

- With the engine's rule (a child is accepted when the target's sampled token equals it) a step accepts as deep as
  the sampled continuation stays inside its tree. A full tree of K children per node and L levels holds the
  continuation to depth d exactly when each of its first d tokens ranks below K at its node: under the target's
  distribution for a perfect draft, under the draft's for a trained one (`depth_in_full_tree`).
- Whatever the draft and the lossless rule, a step that accepts a node emits that node's path, so an N-node tree
  accepts on average at most 1 plus the sum of its path probabilities, which the N - 1 most probable continuations
  maximise. Those hold the continuation's node at depth d only together with every node more probable than it:
  its d - 1 ancestors and, at each depth i <= d, every sibling ``v`` of the path with ``p_i(v)`` above the path's
  probability from depth i to d. Counting them bounds the depth any N-node tree reaches (`nodes_needed`,
  `depth_bound`).

Tensors describe one completion of ``C`` tokens; a *root* ``r < C - 1`` is the step after completion token ``r``,
whose path is completion tokens ``r + 1, r + 2, ...``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_RANK = 1 << 30  # a token no tree holds (outside a reduced draft vocabulary, or past the completion's end)


def ranks_against(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[C]`` rank of ``tokens`` ``[C]`` in each row of ``scores`` ``[C, V]`` (0: the highest score)."""
    chosen = scores.gather(-1, tokens[:, None])
    return (scores > chosen).sum(-1)


@dataclass
class CompletionRanks:
    """How one sampled completion ranks under the target's sampling distribution.

    target: ``[C]`` rank of completion token ``c`` at its position.
    target_logp: ``[C]`` its log-probability there.
    target_top: ``[C, M]`` the position's ``M`` largest log-probabilities, descending (``M`` at least the node
        budgets asked of `nodes_needed`).
    """

    target: torch.Tensor
    target_logp: torch.Tensor
    target_top: torch.Tensor

    @classmethod
    def from_logprobs(cls, logprobs: torch.Tensor, tokens: torch.Tensor, keep: int) -> CompletionRanks:
        """From ``[C, V]`` sampling log-probabilities at each completion position and the ``[C]`` tokens drawn."""
        return cls(
            ranks_against(logprobs, tokens),
            logprobs.gather(-1, tokens[:, None]).squeeze(-1),
            logprobs.topk(min(keep, logprobs.shape[-1]), dim=-1).values,
        )


def depth_in_full_tree(ranks: torch.Tensor, k: int, levels: int) -> torch.Tensor:
    """``[C - 1]`` draft tokens accepted at each root by a full tree of ``k`` children and ``levels`` levels.

    Args:
        ranks: ``[levels, C]`` row ``s``: each completion token's rank among the children a depth-``s + 1`` node
            proposes (the same row repeated for a perfect draft).
    """
    c = ranks.shape[1]
    depth = torch.zeros(c - 1, dtype=torch.long, device=ranks.device)
    alive = torch.ones(c - 1, dtype=torch.bool, device=ranks.device)
    for s in range(min(levels, c - 1)):
        hit = torch.zeros(c - 1, dtype=torch.bool, device=ranks.device)
        hit[: c - 1 - s] = ranks[s, 1 + s :] < k  # root r reaches depth s + 1 through token r + 1 + s
        alive &= hit
        depth += alive
    return depth


def nodes_needed(ranks: CompletionRanks, max_depth: int) -> torch.Tensor:
    """``[C - 1, max_depth]`` entry ``(r, d - 1)``: the fewest nodes (root included) of a tree of the most probable
    continuations that holds root ``r``'s path to depth ``d``; `NO_RANK` past the completion's end."""
    c = ranks.target.shape[0]
    cum = torch.cat(
        [torch.zeros(1, dtype=torch.float64, device=ranks.target_logp.device), ranks.target_logp.double().cumsum(0)]
    )
    need = torch.full((c - 1, max_depth), NO_RANK, dtype=torch.long, device=ranks.target.device)
    for d in range(1, min(max_depth, c - 1) + 1):
        roots = torch.arange(c - d, device=ranks.target.device)
        total = torch.full_like(roots, 1 + d)  # the root and the path's d nodes
        for i in range(1, d + 1):
            tail = (cum[roots + d + 1] - cum[roots + i]).to(ranks.target_top.dtype)  # log-prob of depths i..d
            above = (ranks.target_top[roots + i] > tail[:, None]).sum(-1)
            total += above - (ranks.target_logp[roots + i] > tail).long()  # the path's own token is counted
        need[: c - d, d - 1] = total
    return need


def depth_bound(need: torch.Tensor, nodes: int) -> torch.Tensor:
    """``[C - 1]`` the deepest depth of each root's path that a tree of ``nodes`` nodes can hold (from
    `nodes_needed`); the mean plus one bounds the accepted length of every such tree."""
    return (need <= nodes).long().cumprod(dim=1).sum(dim=1)
