"""glibc malloc settings for CPU rollouts and training: keep freed memory in the process instead of giving it back.

A CPU forward allocates and frees the same large tensors at every step (logits, MLP activations, attention masks,
a step's cache views). glibc serves allocations above its mmap threshold (128 KB, raised on the fly up to 32 MB)
with fresh ``mmap`` pages and returns them on ``free``, and it trims the top of the heap whenever more than 128 KB of
it is free; either way the next step faults the pages in and the kernel zeroes them again, which shows as system
time in a rollout and makes one engine's speed depend on what was allocated before it.

`keep_freed_memory` raises both thresholds once per process. It is a process-wide setting, so no library object
makes it: the ``fastgrpo`` command line calls it before a command that runs a model, and a Python program may call
it itself. The cost: memory a step frees stays mapped to the process (reused by the next step) instead of returning
to the system, so the resident size stays near its peak. ``FASTGRPO_MALLOC=system`` leaves glibc's settings alone.
Elsewhere than glibc on Linux nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 30  # bytes
_applied: bool | None = None  # the outcome of the first call in this process


def _wanted() -> bool:
    value = os.environ.get("FASTGRPO_MALLOC", "keep")
    if value not in ("keep", "system"):
        raise ValueError(f"FASTGRPO_MALLOC must be 'keep' or 'system', got {value!r}")
    return value == "keep"


def _set_thresholds() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD))


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to `THRESHOLD` (once per process). Returns whether they are set.
    ``ValueError`` naming ``FASTGRPO_MALLOC`` at every call while it holds a value other than keep or system."""
    global _applied
    wanted = _wanted()
    if _applied is None:
        _applied = wanted and _set_thresholds()
    return _applied
