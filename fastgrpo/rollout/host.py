"""Moving a decoding step's small tensors between the host and the device.

A step on a GPU is fast only while the host runs ahead of the device, queueing kernels; every read of a device value
(``int(t)``, ``t.tolist()``, a boolean mask's compaction) waits until the device has finished everything queued. The
engine therefore reads the device once per step, with `read_back` (the emitted tokens, how many per row, which ended),
and keeps every length it needs on the host from then on. Index lists that the host decided go the other way with
`host_to_device`, which does not wait for the device. `Verified` is what a step computed on the device, `HostStep`
what the host reads of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def read_back(*tensors: torch.Tensor, arrays: int = 0) -> list:
    """The values of ``tensors`` on the host, in one copy (one synchronisation on a GPU).

    Each tensor comes back as a nested list of its shape: ``int`` values for integer and boolean tensors, ``float``
    for floating ones (read in float64, which holds every token id and float32 log-probability exactly); the last
    ``arrays`` integer tensors as int64 numpy arrays instead (for arithmetic over them on the host)."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    host = flat.cpu().numpy()
    out, start = [], 0
    for i, t in enumerate(tensors):
        part = host[start : start + t.numel()].reshape(t.shape)
        start += t.numel()
        if t.is_floating_point():
            out.append(part.tolist())
        else:
            part = part.astype("int64")
            out.append(part if i >= len(tensors) - arrays else part.tolist())
    return out


def host_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``[len(values)]`` int64 on ``device``; from pinned memory without waiting for the device when it is a GPU."""
    host = torch.tensor(values, dtype=torch.long, device="cpu")
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class Verified:
    """What a step's target forward accepted: ``tokens`` and ``logprobs`` ``[B, E]`` of which each row emits the first
    ``count[b]``; ``hidden`` ``[B, E, H]`` the target's hidden state each was sampled from (the fed tokens' states);
    for a tree, ``path_rank`` ``[B, E - 1]`` the score rank of each accepted draft node (`DraftTree.rank`, ``N``
    past the row's accepted ones), from which the controller tells what smaller trees would have accepted, and
    ``deepest`` ``[B]`` the deepest node of each row's tree."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    count: torch.Tensor
    hidden: torch.Tensor
    path_rank: torch.Tensor | None = None
    deepest: torch.Tensor | None = None


@dataclass
class HostStep:
    """What the host reads of a step, in one copy (`read_back`): per row the emitted ``tokens``, their ``logprobs``,
    which are ``eos`` and how many (``count``) the row emits; for a tree, ``path_rank`` and ``deepest`` (`Verified`)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    eos: list[list[int]]
    count: list[int]
    path_rank: np.ndarray | None = None
    deepest: list[int] | None = None

    @classmethod
    def read(cls, verified: Verified, eos: torch.Tensor) -> HostStep:
        tensors = [verified.tokens, verified.logprobs, torch.isin(verified.tokens, eos), verified.count]
        if verified.path_rank is None:
            return cls(*read_back(*tensors))
        *read, deepest, path_rank = read_back(*tensors, verified.deepest, verified.path_rank, arrays=1)
        return cls(*read, path_rank, deepest)
