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

from fastgrpo.rollout.sampling import process_logits, sample
from fastgrpo.rollout.tree import DraftTree
from fastgrpo.sampling_params import SamplingParams


@dataclass
class Acceptance:
    """Per row: ``path`` ``[B, D]`` accepted nodes (root first, -1 after the end); ``tokens`` and
    ``logprobs`` ``[B, D]`` the emitted tokens (the one drawn at each path node); ``length`` ``[B]`` how many."""

    path: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    length: torch.Tensor


def accept(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None = None
) -> Acceptance:
    """Walk each row's tree. ``logits``: ``[B, N, V]`` raw target logits at every node; ``uniforms``: ``[B, D]`` the
    uniforms of the row's next ``D`` positions (None when greedy), ``D`` at least the deepest node's depth plus one.

    Only the nodes the walk reaches are processed into sampling distributions (`process_logits`, the same function an
    autoregressive step applies to its one row), one batch of still-active rows per step: a row that stops early
    costs nothing more, so the cost follows the accepted length, not the tree size."""
    b = logits.shape[0]
    dev = logits.device
    node = torch.zeros(b, dtype=torch.long, device=dev)
    live = torch.arange(b, device=dev)  # rows still walking
    path = torch.full((b, int(tree.depth.max()) + 1), -1, dtype=torch.long, device=dev)
    tokens = torch.zeros_like(path)
    lps = torch.zeros(path.shape, dtype=torch.promote_types(logits.dtype, torch.float32), device=dev)
    for step in range(path.shape[1]):
        here = process_logits(logits[live, node[live]], params)  # [A, V]
        y = sample(here, params, None if uniforms is None else uniforms[live, step])
        path[live, step] = node[live]
        tokens[live, step] = y
        lps[live, step] = here.gather(1, y[:, None]).squeeze(1)
        is_child = (tree.parent[live] == node[live, None]) & (tree.tokens[live] == y[:, None])  # [A, N]
        goes_on = is_child.any(dim=1)
        node[live] = torch.where(goes_on, is_child.int().argmax(dim=1), node[live])
        live = live[goes_on]
        if live.numel() == 0:
            break
    steps = step + 1
    return Acceptance(path[:, :steps], tokens[:, :steps], lps[:, :steps], (path >= 0).sum(dim=1))
