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

from fastgrpo.rollout import sampling
from fastgrpo.rollout.graph_sampling import GraphSampling
from fastgrpo.rollout.sampling import policy_logprobs, process_logits, sample
from fastgrpo.rollout.tree import DraftTree
from fastgrpo.sampling_params import SamplingParams


@dataclass
class Acceptance:
    """Per row: ``path`` ``[B, D]`` accepted nodes (root first, -1 after the end); ``tokens`` and
    ``logprobs`` ``[B, D]`` the emitted tokens (the one drawn at each path node) and their log-probabilities
    (`sampling.policy_logprobs`); ``length`` ``[B]`` how many."""

    path: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    length: torch.Tensor


def accept(
    tree: DraftTree,
    logits: torch.Tensor,
    params: SamplingParams | GraphSampling,
    uniforms: torch.Tensor | None = None,
) -> Acceptance:
    """Walk each row's tree. ``logits``: ``[B, N, V]`` raw target logits at every node; ``uniforms``: ``[B, D]`` the
    uniforms of the row's next ``D = tree.levels + 1`` positions (None when greedy).

    The walk takes up to ``D`` steps of fixed shape over every row; a row that stopped keeps its node and its later
    draws are discarded. Nothing is read back from the device, so the walk is one static graph. A node's draw depends
    only on its logits and the uniform of its depth, so every node's draw is made at once, before the walk
    (`process_logits`, the same function an autoregressive step applies to its one row, over ``B * N`` rows), and
    each walk step only follows them: the walk then costs little whatever ``D``, and one graph walks every tree as
    deep as the deepest may go. Where reading a value back costs nothing (`sampling.host_reads_are_free`: a CPU,
    eagerly) only the nodes the walk stands on are drawn, step by step, and the walk ends when every row has stopped;
    the results are then as many columns wide as it took steps."""
    if sampling.host_reads_are_free(logits):
        return _walk_drawing(tree, logits, params, uniforms)
    b, n, vocab = logits.shape
    steps = tree.levels + 1
    noise = None if uniforms is None else uniforms.gather(1, tree.node_depth.clamp(max=steps - 1)).reshape(-1)
    raw = logits.reshape(b * n, vocab)
    here = process_logits(raw, params)
    drawn = sample(here, params, noise)  # [B * N]
    scores = policy_logprobs(raw, here, drawn, params).view(b, n)
    drawn = drawn.view(b, n)
    node = torch.zeros(b, 1, dtype=torch.long, device=logits.device)
    walking = torch.ones(b, dtype=torch.bool, device=logits.device)
    path, tokens, lps = [], [], []
    for _ in range(steps):
        y = drawn.gather(1, node)  # [B, 1]
        path.append(torch.where(walking, node[:, 0], -1))
        tokens.append(torch.where(walking, y[:, 0], 0))
        lps.append(torch.where(walking, scores.gather(1, node)[:, 0], 0.0))
        is_child = (tree.parent == node) & (tree.tokens == y)  # [B, N]
        walking = walking & is_child.any(dim=1)
        node = torch.where(walking[:, None], is_child.int().argmax(dim=1, keepdim=True), node)
    path = torch.stack(path, 1)
    return Acceptance(path, torch.stack(tokens, 1), torch.stack(lps, 1), (path >= 0).sum(dim=1))


def _walk_drawing(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None
) -> Acceptance:
    """`accept` drawing at the node each row stands on, step by step, until every row has stopped."""
    b = logits.shape[0]
    dev = logits.device
    rows = torch.arange(b, device=dev)
    node = torch.zeros(b, dtype=torch.long, device=dev)
    walking = torch.ones(b, dtype=torch.bool, device=dev)
    path, tokens, lps = [], [], []
    for step in range(tree.levels + 1):
        raw = logits[rows, node]  # [B, V]
        here = process_logits(raw, params)
        y = sample(here, params, None if uniforms is None else uniforms[:, step])
        path.append(torch.where(walking, node, -1))
        tokens.append(torch.where(walking, y, 0))
        lps.append(torch.where(walking, policy_logprobs(raw, here, y, params), 0.0))
        is_child = (tree.parent == node[:, None]) & (tree.tokens == y[:, None])  # [B, N]
        walking = walking & is_child.any(dim=1)
        node = torch.where(walking, is_child.int().argmax(dim=1), node)
        if not walking.any():
            break
    path = torch.stack(path, 1)
    return Acceptance(path, torch.stack(tokens, 1), torch.stack(lps, 1), (path >= 0).sum(dim=1))
