"""How much memory a phase of a run took on its device, and when its queued work ended."""

from __future__ import annotations

import resource
import sys
import time

import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory since the last `reset_peak_memory`: allocated device memory on CUDA (what live tensors held); on
    CPU the process's maximum resident set size over its whole life (it cannot be reset)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _max_rss_mb()


def peak_reserved_mb(device: torch.device) -> float:
    """Peak memory taken from the device since the last `reset_peak_memory`: on CUDA what the caching allocator
    reserved (live tensors, its cached free blocks, and the private pools CUDA graphs replay in, which allocated
    memory does not show between recordings; at least what it held when the peak was reset, since cached blocks stay
    reserved until ``empty_cache``); on CPU the same as `peak_memory_mb`, the process's maximum resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    return _max_rss_mb()


def _max_rss_mb() -> float:
    """The process's maximum resident set size over its whole life, in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def reset_peak_memory(device: torch.device) -> None:
    """Start new peaks on CUDA, allocated and reserved (a no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def synchronized(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device``'s current stream has finished (a GPU's; a CPU's is
    done already): not the other streams', such as NCCL's, where an asynchronous run's weights may still be leaving
    for the rollout processes."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()
