"""Running a decoding function compiled: ``torch.compile(fullgraph=True)`` with a chosen backend (inductor, captured
as CUDA graphs on a GPU) or eagerly, with the shapes it meets kept to a few (rows padded to a power of two, the keys
read over the whole cache under a mask whose empty blocks flex attention skips) and the time its compilations took
added up.

The compiled graphs read the modules' own parameters, so an optimizer step or a LoRA merge, which write them in
place, reaches the next call without compiling again. Inductor keeps what it compiled in its on-disk cache, so a
second process compiles faster.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from fastgrpo.config.grpo import COMPILE_CHOICES
from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.host import host_to_device

# Graphs a compiled function may hold (torch's default is 8): one per set of sampling filters (and a drafter's per tree
# shape: its loops are unrolled), each first for the shapes met first and then for symbolic ones; past it a call runs
# eagerly.
RECOMPILE_LIMIT = 64
logger = logging.getLogger(__name__)


def compile_backend(choice: str, device: torch.device) -> str | None:
    """The ``torch.compile`` backend the ``compile`` option asks for on ``device``: ``on`` compiles with inductor,
    ``off`` runs eagerly, ``auto`` compiles on a GPU only (on a CPU the compiled step measured slower at 8 rows
    than the eager one with the engine's linear routes, `benchmarks/bench_compile.py`)."""
    if choice not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_CHOICES)}, got {choice!r}")
    if choice == "auto":
        return "inductor" if device.type == "cuda" else None
    return "inductor" if choice == "on" else None


def row_bucket(rows: int) -> int:
    """The smallest power of two at or above ``rows``, at least 2: a compiled step's rows are a symbolic size, which
    torch specialises when it is 1 (a graph of its own)."""
    return max(2, 1 << (rows - 1).bit_length())


class Compiled:
    """``fn`` compiled by ``torch.compile`` with ``backend`` and ``fullgraph=True``, or ``fn`` itself when ``backend``
    is None. On CUDA, inductor captures each shape as a CUDA graph (``mode="reduce-overhead"``) and the outputs are
    copied out of the graph's memory, which its next replay overwrites. ``graphs`` counts the graphs it compiled and
    ``seconds`` adds up the wall time of the calls that compiled them.

    ``cold_calls`` counts the calls that were not a replay of a graph ready before them: those that compiled a graph,
    and the first `warm_calls` calls of every shape key (`shape_key`; on CUDA inductor's first run of a new graph
    warms it up and the second records it). Their wall time is the compiler's, not the step's: whoever times steps
    leaves them out. ``shapes`` counts the shape keys met: on CUDA, the graphs captured.

    A call that would compile more than `RECOMPILE_LIMIT` graphs runs eagerly, with a warning the first time; a graph
    that cannot be compiled (a graph break under ``fullgraph``, a backend failure) makes the function run eagerly from
    then on, with one warning that gives the exception: a model with an operation the compiler cannot capture decodes,
    only slower. ``eager_calls`` counts the calls that ran eagerly so (``compile/eager_fallbacks`` in the rollout
    metrics, under its ``name``), and each warning's record carries the ``name`` as ``eager_fallback``."""

    def __init__(self, fn: Callable, backend: str | None, name: str | None = None):
        self.fn = fn
        self.backend = backend
        self.name = name or fn.__name__
        self.graphs = 0
        self.seconds = 0.0
        self.cold_calls = 0
        self.eager_calls = 0
        self._seen: dict[tuple, int] = {}  # calls so far per (mode, shape key)
        self._by_mode: dict[str | None, Callable] = {}
        self._eager = False  # compiling failed: every call runs ``fn`` eagerly
        self._warned = False

    @property
    def compiled(self) -> bool:
        return self.backend is not None

    @property
    def shapes(self) -> int:
        """Shape keys met so far (`shape_key`): on CUDA with inductor, the CUDA graphs recorded."""
        return len(self._seen)

    def warm_calls(self, device: torch.device) -> int:
        """Calls of a new shape key that run before its graph replays: compiling (and on CUDA, capture's warm-up and
        recording)."""
        return 2 if self._captured(device) else 1

    def _captured(self, device: torch.device) -> bool:
        return device.type == "cuda" and self.backend == "inductor"

    def __call__(self, device: torch.device, *args):
        if self.backend is None:
            return self.fn(*args)
        if self._eager:
            self.eager_calls += 1
            return self.fn(*args)
        captured = self._captured(device)
        mode = "reduce-overhead" if captured else None
        if mode not in self._by_mode:
            self._by_mode[mode] = torch.compile(self.fn, fullgraph=True, dynamic=True, backend=self.backend, mode=mode)
        key = (mode, shape_key(args))
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        cold = seen <= self.warm_calls(device)
        if captured:
            torch.compiler.cudagraph_mark_step_begin()
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        try:
            # floats are constants: a module's float attributes (an attention scale), traced as symbols, would make
            # every compile start its analysis over to specialise them, tracing each graph twice
            with (
                torch._dynamo.config.patch(
                    recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True, specialize_float=True
                ),
                torch.fx.experimental._config.patch(use_duck_shape=False),  # equal sizes stay distinct symbols
            ):
                out = self._by_mode[mode](*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # raised before the graph ran: nothing happened twice
            self._warn(f"compiled {RECOMPILE_LIMIT} graphs already; new shapes run eagerly")
            self.cold_calls += 1
            self.eager_calls += 1
            return self.fn(*args)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed) as error:  # while compiling
            self._eager = True
            self._warn(f"cannot be compiled and runs eagerly from now on: {describe(error)}")
            self.cold_calls += 1
            self.eager_calls += 1
            return self.fn(*args)
        compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        if compiled:
            self.graphs += compiled
            self.seconds += time.perf_counter() - t0
        self.cold_calls += bool(cold or compiled)
        return map_tensors(torch.clone, out) if captured else out

    def _warn(self, message: str) -> None:
        """Log ``message`` about this function the first time anything falls back."""
        if not self._warned:
            logger.warning("%s %s", self.name, message, extra={"eager_fallback": self.name})
            self._warned = True


def describe(error: BaseException, head: int = 8, tail: int = 4) -> str:
    """``error``'s type and the first ``head`` and last ``tail`` lines of its message (a backend's error may hold a
    whole generated source file between what failed and why)."""
    text = str(error).strip().splitlines()
    if len(text) > head + tail:
        text = [*text[:head], f"... ({len(text) - head - tail} lines)", *text[-tail:]]
    return f"{type(error).__name__}: " + "\n".join(text)


def shape_key(value: object) -> object:
    """What a compiled function's graph depends on in ``value`` (its arguments), as a hashable key: the shape and
    dtype of every tensor, the identity of every module and other object (of a cache, its `RowCache.serial`: a new
    cache's buffers are at new addresses), and scalars and tuples as they are."""
    if isinstance(value, RowCache):
        return ("cache", value.serial)
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(shape_key(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, *(shape_key(getattr(value, f.name)) for f in dataclasses.fields(value)))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    return id(value)


class RowPadding:
    """The rows of a compiled call padded up to their bucket (`row_bucket`): padded rows repeat the last live row, and
    only the live rows of the outputs are kept. A target step's padded rows write their keys and values into the
    cache's scratch row (`cache_rows`), never into the rows past the live ones, where rows waiting on tools keep
    theirs; a draft's may write those rows (a drafter keeps a waiting row's draft state aside, `Drafter.park`)."""

    def __init__(self, live: int, device: torch.device):
        self.live = live
        self.rows = row_bucket(live)
        self.device = device
        pads = self.rows - live
        self.index = None if not pads else host_to_device(list(range(live)) + [live - 1] * pads, device)

    def cache_rows(self, cache: RowCache) -> torch.Tensor:
        """``[row_bucket(live)]`` the cache row each padded row writes: its own for the live rows, ``cache``'s
        scratch row (`RowCache.scratch`) for the others."""
        return host_to_device(list(range(self.live)) + [cache.scratch] * (self.rows - self.live), self.device)

    def pad(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` ``[live, ...]`` -> ``[row_bucket(live), ...]`` (None stays None)."""
        return t if t is None or self.index is None else t[self.index]

    def cut(self, out):
        """The live rows of ``out`` (a tensor, or a tuple or dataclass of them, rows first)."""
        return map_tensors(lambda t: t[: self.live], out)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], out):
    """``out`` (a tensor, or a tuple or dataclass of them; other fields kept) with ``fn`` applied to every tensor."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple):
        return tuple(map_tensors(fn, t) for t in out)
    if dataclasses.is_dataclass(out):
        fields = {f.name: map_tensors(fn, getattr(out, f.name)) for f in dataclasses.fields(out)}
        return dataclasses.replace(out, **fields)
    return out
