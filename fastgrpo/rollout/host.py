"""Moving a decoding step's small tensors between the host and the device.

A step on a GPU is fast only while the host runs ahead of the device, queueing kernels; every read of a device value
(``int(t)``, ``t.tolist()``, a boolean mask's compaction) waits until the device has finished everything queued. The
engine therefore reads the device once per step, with `read_back` (the emitted tokens, how many per row, which ended),
and keeps every length it needs on the host from then on. Index lists that the host decided go the other way with
`host_to_device`, which does not wait for the device.
"""

from __future__ import annotations

import torch


def read_back(*tensors: torch.Tensor) -> list[list]:
    """The values of ``tensors`` on the host, in one copy (one synchronisation on a GPU).

    Each tensor comes back as a nested list of its shape: ``int`` values for integer and boolean tensors, ``float``
    for floating ones (read in float64, which holds every token id and float32 log-probability exactly)."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    host = flat.cpu().numpy()
    out, start = [], 0
    for t in tensors:
        part = host[start : start + t.numel()].reshape(t.shape)
        start += t.numel()
        out.append(part.tolist() if t.is_floating_point() else part.astype("int64").tolist())
    return out


def host_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``[len(values)]`` int64 on ``device``; from pinned memory without waiting for the device when it is a GPU."""
    host = torch.tensor(values, dtype=torch.long, device="cpu")
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
