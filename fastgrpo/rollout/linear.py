"""The linear layers the rollout engine runs the model with on CPU (float32, float64 and bfloat16).

Decoding multiplies each weight ``W`` ``[out, in]`` by a few rows ``x`` ``[m, in]``, so it should run at the speed
at which the weights stream from memory. Which kernel does that best depends on the CPU. Four routes compute the
same product:

- ``linear``: ``F.linear``, MKL's ``x @ W.T`` (the only one autograd and autocast follow);
- ``transposed``: ``(W @ x.T).T``, one row padded to two;
- ``onednn``: oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``, on the layer's own weight, no packed copy;
  float32 only; in bfloat16 it is what ``linear`` runs already);
- ``vector``: ``W @ x`` for a single row, a matrix-vector product with no padding, transposes or copies (one row
  only). In bfloat16 on the AMX Xeon the 30 x 7 SmolLM2 matrices took 13.8 ms that way against 15.7 ms for
  ``transposed`` and 19.1 ms for ``linear``, and a one-token forward 30.5 against 32.5 ms; in float32 it ties with
  ``linear`` there (16.4 and 16.3 ms), and ``transposed`` takes 41 ms.

On SmolLM2-135M's 30 x 7 decoder matrices in float32, 2 threads: on an AMD EPYC (avx512_bf16) ``linear`` took 27 to
46 ms for 1 to 12 rows, ``transposed`` 13 to 16 ms for 1 to 4 rows and ``onednn`` 20 to 25 ms for 5 to 16; on an Intel
Xeon with AMX, ``linear`` took 16 to 27 ms for 1 to 8 rows, ``onednn`` 24 to 32 and ``transposed`` 35 to 39. In
bfloat16 on that Xeon, a whole decoder forward took 30 to 43 ms for 1 to 16 rows with ``transposed`` against 36 to 47
ms with ``linear``, but 93 against 81 ms at 64 rows. So the route is measured, not assumed: the first time
`rollout_linears` patches layers of a dtype in a process, it times each route on those layers' own weights for a few row
counts (`TIMED_ROWS`, interleaved rounds, medians; 1 s in bfloat16 and 3 s in float32 for SmolLM2; the layers' first
`CALIBRATION_ELEMENTS` weight elements, on a bigger model) and routes every later product by the fastest for the nearest
timed row count at or above its own (``linear`` unless another route is `CALIBRATION_MARGIN` faster). Products beyond
the largest timed count (prefills, wide verification trees) take its route, so that count is past the crossover: at 64
rows the two routes tie in bfloat16 on the AMX Xeon and the timing fell either way from one process to the next, and a
process that timed ``transposed`` there ran a 64-row prefill 2.2x slower (5.9 against 2.7 s) and speculative decoding at
16 rows 13 % slower; at 128 rows ``linear`` wins by a wide margin. Before the first timing the AMD table applies:
``transposed`` up to `FEW_ROWS` rows, ``onednn`` beyond (``linear`` in float64 and bfloat16, where that route does not
exist); with the environment variable ``FASTGRPO_LINEAR_ROUTES=default`` it always does, so that two processes (a run
and its resume) round every product alike. Where autograd needs the product, or under autocast, ``F.linear`` runs; other
dtypes (float16) and devices keep ``nn.Linear``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

FEW_ROWS = 4
ROUTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
TIMED_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
CALIBRATION_ROUNDS = 3
CALIBRATION_MARGIN = 0.03  # another route replaces ``linear`` only when it times at least this much faster
CALIBRATION_ELEMENTS = 64 * 2**20  # weights timed per route and row count (256 MB in float32)
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_TIMED_AT_OR_ABOVE = [next(t for t in TIMED_ROWS if t >= m) for m in range(TIMED_ROWS[-1] + 1)]  # per row count
_measured: dict[torch.dtype, dict[int, str]] = {}  # dtype -> {timed row count: fastest route}
_defaults_only = False  # set inside `default_routes`


def _has_onednn(dtype: torch.dtype) -> bool:
    return _ONEDNN and dtype == torch.float32


def routes_for(dtype: torch.dtype, rows: int) -> list[str]:
    """The routes that can compute a product of ``rows`` rows of this dtype."""
    names = ["linear", "transposed", "onednn"] if _has_onednn(dtype) else ["linear", "transposed"]
    return names + ["vector"] if rows == 1 else names


def _default_route(dtype: torch.dtype, rows: int) -> str:
    if rows <= FEW_ROWS:
        return "transposed"
    return "onednn" if _has_onednn(dtype) else "linear"


def route(dtype: torch.dtype, rows: int) -> str:
    """The route a product of ``rows`` rows of this dtype takes: the measured fastest for the nearest timed row
    count at or above ``rows`` (the largest beyond it), or the default table before any measurement. An empty
    product has no speed to gain and takes ``linear``."""
    if rows < 1:
        return "linear"
    table = None if _defaults_only else _measured.get(dtype)
    if table is None:
        return _default_route(dtype, rows)
    return table[_TIMED_AT_OR_ABOVE[min(rows, TIMED_ROWS[-1])]]


def _pinned_to_defaults() -> bool:
    value = os.environ.get("FASTGRPO_LINEAR_ROUTES", "measured")
    if value not in ("measured", "default"):
        raise ValueError(f"FASTGRPO_LINEAR_ROUTES must be 'measured' or 'default', got {value!r}")
    return value == "default"


@contextmanager
def default_routes() -> Iterator[None]:
    """Route by the default table inside the block, whatever was measured (to compare the two)."""
    global _defaults_only
    before, _defaults_only = _defaults_only, True
    try:
        yield
    finally:
        _defaults_only = before


def _product(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``[m, in] -> [m, out]`` (contiguous) by one route."""
    if name == "linear":
        return F.linear(x, weight, bias)
    if name == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if name == "vector":
        out = weight @ x[0]
        return (out if bias is None else out + bias)[None]
    m = x.shape[0]
    rows = torch.cat([x, x]) if m == 1 else x
    out = (weight @ rows.T).T[:m]
    out = out if bias is None else out + bias
    return out.contiguous()  # a strided product: its copy to rows is part of the route's cost when routes are timed


def rollout_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the fastest route for a CPU weight of a routed dtype (see the module's
    docstring); other weights, and products autograd must differentiate, go through ``F.linear``.

    Args:
        x: ``[..., in]``.
        weight: ``[out, in]``.
        bias: ``[out]`` or None.

    Returns:
        ``[..., out]``.
    """
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    autocast = torch.is_autocast_enabled(x.device.type)  # only F.linear follows autocast's casts
    if needs_grad or autocast or x.dtype != weight.dtype or not _runs_rollout_linear(weight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = _product(route(weight.dtype, rows.shape[0]), rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def calibrate(weights: list[torch.Tensor]) -> dict[int, str]:
    """Time every route over ``weights`` (one dtype, ``[out, in]`` each) at each of `TIMED_ROWS` rows, in
    `CALIBRATION_ROUNDS` interleaved rounds after a warm-up, and return the fastest route per row count (medians).

    ``linear`` keeps a row count unless another route is `CALIBRATION_MARGIN` faster, so that timing noise between
    near-equal routes does not move products off ``F.linear``. A route's time includes making its product
    contiguous: without that copy ``transposed`` timed 24 % faster than ``linear`` at 64 bfloat16 rows on the AMX
    Xeon and made the whole forward 15 % slower; with it, 3 to 8 % slower."""
    dtype = weights[0].dtype
    names = {m: routes_for(dtype, m) for m in TIMED_ROWS}
    inputs = {(m, w.shape[1]): torch.randn(m, w.shape[1], dtype=dtype) for m in TIMED_ROWS for w in weights}
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


def _runs_rollout_linear(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in ROUTED_DTYPES


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return rollout_linear(x, module.weight, module.bias)


@contextmanager
def rollout_linears(*modules: nn.Module | None) -> Iterator[None]:
    """Run the CPU ``nn.Linear`` layers of a routed dtype (float32, float64, bfloat16) inside ``modules`` (None
    entries are skipped) with `rollout_linear` inside the block, then restore them. The first time layers of a dtype
    are patched in this process, the routes are timed on their weights (`calibrate`)."""
    found = (m for module in modules if module is not None for m in module.modules())
    # Keyed by identity: a layer reachable from two of the modules is patched (and restored) once.
    patched = list({id(m): m for m in found if type(m) is nn.Linear and _runs_rollout_linear(m.weight)}.values())
    pinned = _pinned_to_defaults()
    for dtype in () if pinned else {m.weight.dtype for m in patched} - set(_measured):
        _measured[dtype] = calibrate(_calibration_weights([m.weight for m in patched if m.weight.dtype == dtype]))
    for m in patched:
        m.forward = partial(_forward, m)
    try:
        with default_routes() if pinned else nullcontext():
            yield
    finally:
        for m in patched:
            del m.forward
