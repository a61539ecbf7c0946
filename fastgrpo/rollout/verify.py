"""Lossless acceptance of draft trees.

At the root, draw the target's token ``y`` from the processed target distribution (argmax when greedy). If ``y``
is the token of one of the node's children, move to that child and draw again from the target's distribution
there; otherwise stop. Every emitted token is drawn from the target's own distribution given the tokens before
it, and the tree is a deterministic function of the context, so the output is distributed exactly as
autoregressive sampling from the target; under greedy decoding it is the target's greedy output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgrpo.rollout.sampling import SamplingParams, sample
from fastgrpo.spec.tree import DraftTree


@dataclass
class Acceptance:
    """Per row: ``path`` ``[B, D]`` accepted nodes (root first, -1 after the end); ``tokens`` and
    ``logprobs`` ``[B, D]`` the emitted tokens (the one drawn at each path node); ``length`` ``[B]`` how many."""

    path: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    length: torch.Tensor


def accept(
    tree: DraftTree, logprobs: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None = None
) -> Acceptance:
    """Walk each row's tree. ``logprobs``: ``[B, N, V]`` processed target log-probabilities at every node;
    ``uniforms``: ``[B, D]`` the uniforms of the row's next ``D`` positions (None when greedy), ``D`` at least the
    deepest node's depth plus one."""
    b, n, _ = logprobs.shape
    rows = torch.arange(b, device=logprobs.device)
    node = torch.zeros(b, dtype=torch.long, device=logprobs.device)
    active = torch.ones(b, dtype=torch.bool, device=logprobs.device)
    path, tokens, lps = [], [], []
    max_steps = int(tree.depth.max()) + 1
    for step in range(max_steps):
        here = logprobs[rows, node]  # [B, V]
        y = sample(here, params, None if uniforms is None else uniforms[:, step])
        path.append(torch.where(active, node, -1))
        tokens.append(y)
        lps.append(here.gather(1, y[:, None]).squeeze(1))
        is_child = (tree.parent == node[:, None]) & (tree.tokens == y[:, None])  # [B, N]
        active = active & is_child.any(dim=1)
        if not bool(active.any()):
            break
        node = torch.where(active, is_child.int().argmax(dim=1), node)
    path_t = torch.stack(path, 1)
    return Acceptance(path_t, torch.stack(tokens, 1), torch.stack(lps, 1), (path_t >= 0).sum(dim=1))
