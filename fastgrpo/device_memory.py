"""How much memory a phase of a run took on its device."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory since the last `reset_peak_memory`: allocated device memory on CUDA; on CPU the process's maximum
    resident set size over its whole life (it cannot be reset)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak on CUDA (a no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
