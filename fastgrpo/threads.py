"""How many threads torch's CPU kernels use while a run may share its cores with other processes.

torch's OpenMP pool has each thread spin while it waits for the others. With as many threads as cores and another
busy process on those cores, a thread often waits for one that is not running, and a step can take many times
longer than with one thread fewer (``docs/benchmarks.md``, "Threads on a shared machine", measures it). `ThreadGovernor`
watches, over windows of a few seconds, how many cores the process actually had: its own CPU time plus the idle time
of the CPUs it may run on, per second of wall time. When that falls clearly below its thread count it runs one thread
fewer; when a core comes free again it runs one more, up to the count it started with. Where the CPUs' idle time
cannot be read (no ``/proc/stat``) it keeps its threads.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

WINDOW_S = 2.0  # seconds of wall time over which the cores the process had are measured
LOWER_BELOW = 0.5  # one thread fewer when the process had less than (threads - LOWER_BELOW) cores
RAISE_FROM = 0.75  # one thread more when it had at least (threads + RAISE_FROM) cores


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def idle_cpu_seconds(cpus: Collection[int], stat: Path = Path("/proc/stat")) -> float | None:
    """Seconds the given CPUs have spent idle or waiting for I/O since boot (``/proc/stat``), or None where that
    cannot be read."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    ticks, seen = 0, 0
    for line in lines:
        name, _, fields = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = fields.split()
            ticks += int(values[3]) + int(values[4])  # idle, iowait
            seen += 1
    if seen == 0:
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Sets torch's CPU thread count for the duration of a ``with`` block, and with ``adapt`` follows the cores
    the process has to itself (see the module's docstring).

    Args:
        most: the thread count to start from and never exceed (None: torch's count when the block starts).
        adapt: follow the free cores; False keeps ``most`` threads throughout.
        clock, cpu_time, idle: wall seconds, this process's CPU seconds (all its threads) and the allowed CPUs' idle
            seconds (None: unknown); replaceable so that tests need no real load.
    """

    def __init__(
        self,
        most: int | None = None,
        adapt: bool = True,
        clock: Callable[[], float] = time.monotonic,
        cpu_time: Callable[[], float] = time.process_time,
        idle: Callable[[], float | None] | None = None,
    ):
        if most is not None and most < 1:
            raise ValueError(f"most must be at least 1, got {most}")
        cpus = allowed_cpus()
        if most is not None and most > len(cpus):  # more threads than cores only make them wait for each other
            logger.warning(
                "cpu_threads: %d is more than the %d cores this process may use; using %d", most, len(cpus), len(cpus)
            )
            most = len(cpus)
        self.most = most
        self.adapt = adapt
        self.clock = clock
        self.cpu_time = cpu_time
        self.idle = idle if idle is not None else (lambda: idle_cpu_seconds(cpus))
        self.threads = most or torch.get_num_threads()
        self.cores: float | None = None  # cores the process had over the last full window
        self._before: int | None = None
        self._window: tuple[float, float, float | None] | None = None

    def __enter__(self) -> ThreadGovernor:
        self._before = torch.get_num_threads()
        self.most = self.most or self._before
        self.threads = self.most
        torch.set_num_threads(self.threads)
        self._window = self._mark()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self._before)
        self._window = None

    def _mark(self) -> tuple[float, float, float | None]:
        return self.clock(), self.cpu_time(), self.idle()

    def update(self) -> int:
        """Once a window has passed, measure the cores the process had over it and move the thread count by one
        if they call for it; returns the thread count. Cheap between windows (one clock read): call it often, from
        the thread that runs the kernels (torch's count is that thread's)."""
        if not self.adapt or self._window is None:
            return self.threads
        wall0, cpu0, idle0 = self._window
        now = self.clock()
        if now - wall0 < WINDOW_S:
            return self.threads
        cpu, idle = self.cpu_time(), self.idle()
        self._window = (now, cpu, idle)
        if idle is None or idle0 is None:
            return self.threads
        self.cores = (cpu - cpu0 + idle - idle0) / (now - wall0)
        if self.threads > 1 and self.cores < self.threads - LOWER_BELOW:
            self.threads -= 1
        elif self.threads < self.most and self.cores >= self.threads + RAISE_FROM:
            self.threads += 1
        else:
            return self.threads
        torch.set_num_threads(self.threads)
        return self.threads

    def metrics(self) -> dict[str, float]:
        """``cpu/threads`` now and ``cpu/cores`` the process had over the last window (when measured)."""
        out = {"cpu/threads": float(self.threads)}
        if self.cores is not None:
            out["cpu/cores"] = self.cores
        return out
