"""The linear layers the rollout engine runs the model with on CPU (float32, float64 and bfloat16).

Decoding multiplies each weight ``W`` ``[out, in]`` by a few rows ``x`` ``[m, in]``, so it should run at the speed
at which the weights stream from memory. Which kernel comes closest depends on the CPU, the dtype and the row count,
and the differences are large (on some CPUs MKL's ``x @ W.T`` streams few-row products at a fraction of the memory's
speed while ``W @ x.T`` does not; on others the reverse; on some a matrix-vector product runs on one core however
many threads torch has). Five routes compute the same product (up to the rounding of their summation order):

- ``linear``: ``F.linear``, MKL's ``x @ W.T`` (the only one autograd and autocast follow);
- ``transposed``: ``(W @ x.T).T``, one row padded to two;
- ``onednn``: oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``, on the layer's own weight, no packed copy;
  float32 only; in bfloat16 it is what ``linear`` runs already);
- ``vector``: ``W @ x`` for a single row, a matrix-vector product with no padding, transposes or copies;
- ``split``: for a single row, ``W``'s output rows cut into one block per thread (a view) and multiplied by ``x`` in
  one ``torch.bmm``, which runs the blocks in parallel (``vector`` where the blocks would not be equal, or on one
  thread).

So the route is measured, not assumed: `calibrate` times each route on the layers' own weights (the first
`CALIBRATION_ELEMENTS` weight elements on a big model) at each of `TIMED_ROWS` row counts, in interleaved rounds, and
every later product takes the fastest route of the nearest timed row count at or above its own (``linear`` unless
another route is `CALIBRATION_MARGIN` faster, so that noise between near-equal routes does not move products off it).
Products beyond the largest timed count (prefills, wide verification trees) take its route, so that count lies past
every crossover. The measurement takes seconds, so it is made once per machine and model shape: saved under the cache
directory (`routes_path`, keyed by CPU, thread count, torch version, dtype and the weights' shapes) and read by every
later process, which also makes a run and its ``--resume`` round every product alike.

A `LinearRoutes` object holds the routes of one model (and its drafts): the rollout engine owns one, measured by
`LinearRoutes.measure` (its owner calls it before the first rollout; a call measures what is not measured yet), and
runs the model's layers with it inside `LinearRoutes.applied`. Before any measurement a fixed table applies:
``transposed`` up to `FEW_ROWS` rows, ``onednn`` beyond (``linear`` in float64 and bfloat16). The environment variable
``FASTGRPO_LINEAR_ROUTES`` is ``measured`` (the default), ``default`` (that table, nothing measured) or ``off``
(``F.linear`` everywhere, nothing measured). Where autograd needs the product, or under autocast, ``F.linear`` runs;
other dtypes (float16) and devices keep ``nn.Linear``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fastgrpo.machine import device_key, file_key, write_atomically
from fastgrpo.models import cache_root

FEW_ROWS = 4
ROUTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
TIMED_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
CALIBRATION_ROUNDS = 3
CALIBRATION_MARGIN = 0.03  # another route replaces ``linear`` only when it times at least this much faster
CALIBRATION_ELEMENTS = 64 * 2**20  # weights timed per route and row count (256 MB in float32)
ROUTES_VERSION = 2  # raised when the routes or their timing change, so that cached tables are measured again
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_TIMED_AT_OR_ABOVE = [next(t for t in TIMED_ROWS if t >= m) for m in range(TIMED_ROWS[-1] + 1)]  # per row count
ROUTE_MODES = ("measured", "default", "off")


def _has_onednn(dtype: torch.dtype) -> bool:
    return _ONEDNN and dtype == torch.float32


def routes_for(dtype: torch.dtype, rows: int) -> list[str]:
    """The routes that can compute a product of ``rows`` rows of this dtype."""
    names = ["linear", "transposed", "onednn"] if _has_onednn(dtype) else ["linear", "transposed"]
    return names + ["vector", "split"] if rows == 1 else names


def _default_route(dtype: torch.dtype, rows: int) -> str:
    if rows <= FEW_ROWS:
        return "transposed"
    return "onednn" if _has_onednn(dtype) else "linear"


def _mode_from_environment() -> str:
    value = os.environ.get("FASTGRPO_LINEAR_ROUTES", "measured")
    if value not in ROUTE_MODES:
        raise ValueError(f"FASTGRPO_LINEAR_ROUTES must be one of {list(ROUTE_MODES)}, got {value!r}")
    return value


class LinearRoutes:
    """The route each product of one model's layers takes on this machine (its drafts' layers of a dtype take the
    routes measured for the model's).

    ``mode``: ``measured`` (each dtype's fastest routes, `measure`), ``default`` (the fixed table, nothing measured)
    or ``off`` (``F.linear`` everywhere); None reads ``FASTGRPO_LINEAR_ROUTES``."""

    def __init__(self, mode: str | None = None):
        if mode is not None and mode not in ROUTE_MODES:
            raise ValueError(f"mode must be one of {list(ROUTE_MODES)}, got {mode!r}")
        self.mode = mode or _mode_from_environment()
        self.tables: dict[torch.dtype, dict[int, str]] = {}  # dtype -> {timed row count: fastest route}

    def measure(self, *modules: nn.Module | None) -> None:
        """Measure the routes of each dtype of the routed layers inside ``modules`` not measured yet (read from the
        cache directory where this machine measured layers of these shapes before, `load_or_calibrate`)."""
        if self.mode != "measured":
            return
        layers = routed_layers(*modules)
        for dtype in {m.weight.dtype for m in layers} - set(self.tables):
            self.tables[dtype] = load_or_calibrate(
                _calibration_weights([m.weight for m in layers if m.weight.dtype == dtype])
            )

    def route(self, dtype: torch.dtype, rows: int) -> str:
        """The route a product of ``rows`` rows of this dtype takes: the measured fastest for the nearest timed row
        count at or above ``rows`` (the largest beyond it), or the default table before any measurement. An empty
        product has no speed to gain and takes ``linear``."""
        if rows < 1 or self.mode == "off":
            return "linear"
        table = self.tables.get(dtype) if self.mode == "measured" else None
        if table is None:
            return _default_route(dtype, rows)
        return table[_TIMED_AT_OR_ABOVE[min(rows, TIMED_ROWS[-1])]]

    @contextmanager
    def applied(self, *modules: nn.Module | None) -> Iterator[None]:
        """Run the CPU ``nn.Linear`` layers of a routed dtype (float32, float64, bfloat16) inside ``modules`` (None
        entries are skipped), and every `rollout_linear` call, with these routes inside the block (measured first,
        `measure`), then restore the layers."""
        self.measure(*modules)
        layers = routed_layers(*modules)
        outer = [m.__dict__.get("forward") for m in layers]  # an enclosing block's, for blocks nested on one model
        for m in layers:
            m.forward = partial(_forward, m)
        active = _active.set(self)
        try:
            yield
        finally:
            _active.reset(active)
            for m, forward in zip(layers, outer, strict=True):
                if forward is None:
                    del m.forward
                else:
                    m.forward = forward


_DEFAULT_ROUTES = LinearRoutes("default")  # outside any `LinearRoutes.applied` block
_active: ContextVar[LinearRoutes] = ContextVar("fastgrpo_linear_routes", default=_DEFAULT_ROUTES)  # see `applied`


def _product(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``[m, in] -> [m, out]`` (contiguous) by one route."""
    if name == "linear":
        return F.linear(x, weight, bias)
    if name == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if name == "split":
        parts = math.gcd(weight.shape[0], torch.get_num_threads())
        if parts > 1 and weight.is_contiguous():
            out = torch.bmm(weight.view(parts, -1, weight.shape[1]), x.T.expand(parts, -1, -1)).view(1, -1)
            return out if bias is None else out + bias
        return _product("vector", x, weight, bias)
    if name == "vector":
        out = weight @ x[0]
        return (out if bias is None else out + bias)[None]
    m = x.shape[0]
    rows = torch.cat([x, x]) if m == 1 else x
    out = (weight @ rows.T).T[:m]
    out = out if bias is None else out + bias
    return out.contiguous()  # a strided product: its copy to rows is part of the route's cost when routes are timed


def rollout_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the fastest route for a CPU weight of a routed dtype (the routes applied
    around the call, `LinearRoutes.applied`, else the default table); other weights, and products autograd must
    differentiate, go through ``F.linear``.

    Args:
        x: ``[..., in]``.
        weight: ``[out, in]``.
        bias: ``[out]`` or None.

    Returns:
        ``[..., out]``.
    """
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    autocast = torch.is_autocast_enabled(x.device.type)  # only F.linear follows autocast's casts
    routed = _runs_rollout_linear(weight) and not torch.compiler.is_compiling()  # compiled: the compiler's choice
    if needs_grad or autocast or x.dtype != weight.dtype or not routed:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = _product(_active.get().route(weight.dtype, rows.shape[0]), rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def calibrate(weights: list[torch.Tensor]) -> dict[int, str]:
    """Time every route over ``weights`` (one dtype, ``[out, in]`` each) at each of `TIMED_ROWS` rows, in
    `CALIBRATION_ROUNDS` interleaved rounds after a warm-up, and return the fastest route per row count (medians).

    ``linear`` keeps a row count unless another route is `CALIBRATION_MARGIN` faster, so that timing noise between
    near-equal routes does not move products off ``F.linear``. A route's time includes making its product
    contiguous, as the model needs it: timed without that copy, a strided product looks faster than it is."""
    dtype = weights[0].dtype
    names = {m: routes_for(dtype, m) for m in TIMED_ROWS}
    # Its own generator: timing must not move the process's random state.
    gen = torch.Generator(device="cpu").manual_seed(0)
    inputs = {
        (m, w.shape[1]): torch.randn(m, w.shape[1], dtype=dtype, generator=gen, device="cpu")
        for m in TIMED_ROWS
        for w in weights
    }
    seconds: dict[tuple[int, str], list[float]] = {(m, n): [] for m in TIMED_ROWS for n in names[m]}
    with torch.no_grad():
        for round_ in range(CALIBRATION_ROUNDS + 1):
            for m in TIMED_ROWS:
                for name in names[m]:
                    start = time.perf_counter()
                    for w in weights:
                        _product(name, inputs[(m, w.shape[1])], w, None)
                    if round_:  # round 0 warms every kernel up
                        seconds[(m, name)].append(time.perf_counter() - start)
    table = {}
    for m in TIMED_ROWS:
        median = {n: statistics.median(seconds[(m, n)]) for n in names[m]}
        fastest = min(names[m], key=median.__getitem__)
        table[m] = fastest if median[fastest] < (1 - CALIBRATION_MARGIN) * median["linear"] else "linear"
    return table


def _calibration_weights(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The first weights (distinct tensors, detached) up to `CALIBRATION_ELEMENTS` elements, at least one."""
    chosen, total, seen = [], 0, set()
    for w in weights:
        if w.data_ptr() in seen:
            continue
        if chosen and total + w.numel() > CALIBRATION_ELEMENTS:
            break
        seen.add(w.data_ptr())
        chosen.append(w.detach())
        total += w.numel()
    return chosen


def routes_path(weights: list[torch.Tensor]) -> Path:
    """Where the routes measured for these weights (one dtype) on this machine are kept: keyed by the CPU, thread
    count and torch version (`fastgrpo.machine.device_key`), the dtype and the weights' shapes."""
    shapes = sorted({tuple(w.shape) for w in weights})
    digest = hashlib.sha1(repr(shapes).encode()).hexdigest()[:12]
    key = file_key(device_key(weights[0].device), str(weights[0].dtype), digest)
    return cache_root() / "linear_routes" / f"{key}-v{ROUTES_VERSION}.json"


def load_or_calibrate(weights: list[torch.Tensor]) -> dict[int, str]:
    """The routes of these weights (one dtype) measured on this machine: read from the cache when a process measured
    them before (`routes_path`), else measured by `calibrate` and saved there (atomically)."""
    path = routes_path(weights)
    try:
        table = {int(rows): name for rows, name in json.loads(path.read_text()).items()}
        if set(table) == set(TIMED_ROWS) and all(table[m] in routes_for(weights[0].dtype, m) for m in table):
            return table
    except (OSError, ValueError, AttributeError):  # none yet, or unreadable: measure again
        pass
    table = calibrate(weights)
    write_atomically(path, json.dumps(table))
    return table


def _runs_rollout_linear(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in ROUTED_DTYPES


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return rollout_linear(x, module.weight, module.bias)


def routed_layers(*modules: nn.Module | None) -> list[nn.Linear]:
    """The CPU ``nn.Linear`` layers of a routed dtype inside ``modules`` (None entries skipped), each once."""
    found = (m for module in modules if module is not None for m in module.modules())
    # Keyed by identity: a layer reachable from two of the modules is patched (and restored) once.
    return list({id(m): m for m in found if type(m) is nn.Linear and _runs_rollout_linear(m.weight)}.values())


def rollout_linears(*modules: nn.Module | None) -> contextlib.AbstractContextManager[None]:
    """`LinearRoutes.applied` with routes of their own (read from the cache directory, or measured the first time on
    this machine): for code that runs ``modules`` once, outside an engine."""
    return LinearRoutes().applied(*modules)
