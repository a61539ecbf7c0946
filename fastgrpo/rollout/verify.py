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
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None = None
) -> Acceptance:
    """Walk each row's tree. ``logits``: ``[B, N, V]`` raw target logits at every node; ``uniforms``: ``[B, D]`` the
    uniforms of the row's next ``D = tree.levels + 1`` positions (None when greedy).

    The walk takes up to ``D`` steps of fixed shape over every row: at each, the node each row stands on is processed
    into a sampling distribution (`process_logits`, the same function an autoregressive step applies to its one row)
    and drawn from; a row that stopped keeps its node and its later draws are discarded. Nothing is read back from the
    device, so the walk is one static graph; a row that stops early costs ``D`` rows' processing, not a stall. Where
    reading a value back costs nothing (`sampling.host_reads_are_free`: a CPU, eagerly) the walk ends when every row
    has stopped, and the results are as many columns wide as it took steps."""
    b = logits.shape[0]
    dev = logits.device
    steps = tree.levels + 1
    rows = torch.arange(b, device=dev)
    node = torch.zeros(b, dtype=torch.long, device=dev)
    walking = torch.ones(b, dtype=torch.bool, device=dev)
    path, tokens, lps = [], [], []
    for step in range(steps):
        raw = logits[rows, node]  # [B, V]
        here = process_logits(raw, params)
        y = sample(here, params, None if uniforms is None else uniforms[:, step])
        path.append(torch.where(walking, node, -1))
        tokens.append(torch.where(walking, y, 0))
        lps.append(torch.where(walking, policy_logprobs(raw, here, y, params), 0.0))
        is_child = (tree.parent == node[:, None]) & (tree.tokens == y[:, None])  # [B, N]
        walking = walking & is_child.any(dim=1)
        node = torch.where(walking, is_child.int().argmax(dim=1), node)
        if sampling.host_reads_are_free(walking) and not walking.any():
            break
    path = torch.stack(path, 1)
    return Acceptance(path, torch.stack(tokens, 1), torch.stack(lps, 1), (path >= 0).sum(dim=1))
