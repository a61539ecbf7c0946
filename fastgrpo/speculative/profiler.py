"""Measures what a forward costs on the hardware at hand, as a function of the tokens in it.

The target curve times one decoder forward plus LM head over ``t`` rows of one token each, every row reading a
context of about ``context_length`` cached tokens (ragged, as in a rollout, so the masked attention path runs). A
drafter whose plugin gives a `CostProbe` (the EAGLE head: one draft tree level) gets a curve of its own, timed over
``t`` tokens alike; a drafter without one (the suffix drafter) prices itself and is not in the profile. The
verification capacity ``C_peak`` is the knee of the target curve: the token count up to which the latency stays
flat, beyond which it grows in proportion to the tokens.

A verification forward is not priced by its token count alone: ``B`` rows of ``N`` tree nodes read ``B`` contexts,
not ``B * N``, and on a CPU one row of 8 tokens can cost what one token costs while 8 rows of one token cost twice
that. So the profile also times a grid of ``B`` rows (the powers of two among the token counts) by ``N`` tokens per
row (`TREE_NODES`, up to the largest token count in all).

With a compile ``backend`` (of ``torch.compile``, as the engine runs its steps with) the forwards are timed compiled
(`fastgrpo.rollout.compiled`; on a GPU captured as CUDA graphs), so that the controller prices the steps the engine
runs. Only a function's steady calls are timed: a compiled function is slow on its first few calls (on a GPU the
first compiles the graph, the second records it as a CUDA graph, and only the later ones replay it), so each is
warmed up until two calls in a row take about the same time (`warm_up`).

Profiles are saved as JSON under ``$FASTGRPO_CACHE/profiles`` keyed by model, device (`fastgrpo.machine.device_key`),
dtype, whether the forwards were compiled and `PROFILE_VERSION`, and reused; a drafter a saved profile lacks is
timed and added to it.
"""

from __future__ import annotations

import bisect
import json
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from fastgrpo.machine import device_key, file_key, write_atomically
from fastgrpo.models import cache_root
from fastgrpo.rollout.attention import rollout_attention
from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.compiled import Compiled
from fastgrpo.rollout.forward import decoder_and_head, forward_chain
from fastgrpo.rollout.linear import rollout_linears

DEFAULT_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
CALIBRATION_TOKENS = (1, 4, 16, 64)
TREE_NODES = (2, 4, 8, 16, 32, 64)
# Part of every saved profile's name: raised when what a forward costs or what a profile holds changes, so that a
# profile of another kind is not reused.
PROFILE_VERSION = 5
# `warm_up`: a function is called at least MIN_WARM_CALLS and at most MAX_WARM_CALLS times before it is timed, until
# two calls in a row are within STEADY_RATIO of each other.
MIN_WARM_CALLS = 3
MAX_WARM_CALLS = 10
STEADY_RATIO = 1.25


@dataclass
class CostProbe:
    """What the profile times of a drafter: ``calls[i]`` runs one unit of its proposals over ``tokens[i]`` tokens
    (the token counts the probe was made for), on the target's device; ``modules`` are its networks, run with the
    rollout's attention and linear routes as the engine runs them."""

    calls: list[Callable[[], object]]
    modules: tuple[nn.Module, ...] = ()


# (token counts, context length, drafters already profiled) -> the other drafters' probes by name
ProbeFactory = Callable[[tuple[int, ...], int, set[str]], dict[str, CostProbe]]


def no_probes(tokens: tuple[int, ...], context_length: int, skip: set[str]) -> dict[str, CostProbe]:
    """The `ProbeFactory` of a run that prices no drafter from the profile."""
    return {}


@dataclass
class LatencyProfile:
    """Median seconds of one target forward (``target_seconds``) and of one unit of each profiled drafter's proposals
    (``drafter_seconds``, by drafter name: see `CostProbe`) at each token count in ``tokens`` (one token per row);
    ``c_peak`` is the knee of the target curve. ``tree_seconds[i][j]``
    is a target forward over ``tree_rows[i]`` rows of ``tree_nodes[j]`` tokens each (None where that grid point was
    not measured); a profile without the grid prices ``B`` rows of ``N`` tokens as ``B * N`` rows of one."""

    model: str
    device: str
    dtype: str
    context_length: int
    tokens: list[int]
    target_seconds: list[float]
    c_peak: int
    drafter_seconds: dict[str, list[float]] = field(default_factory=dict)
    tree_rows: list[int] = field(default_factory=list)
    tree_nodes: list[int] = field(default_factory=list)
    tree_seconds: list[list[float | None]] = field(default_factory=list)

    def target_time(self, tokens: float) -> float:
        """Predicted seconds of a target forward over ``tokens`` rows of one token (interpolated, extrapolated
        linearly)."""
        return interpolate(self.tokens, self.target_seconds, tokens)

    def tree_time(self, rows: int, nodes: int) -> float:
        """Predicted seconds of a target forward over ``rows`` rows of ``nodes`` tokens each: along the nodes of the
        measured row counts around ``rows``, then linearly between them (below the first and past the last, that
        row count's figure scaled as the one-token curve scales)."""
        if nodes == 1 or not self.tree_rows:
            return self.target_time(rows * nodes)
        i = bisect.bisect_left(self.tree_rows, rows)
        if i < len(self.tree_rows) and self.tree_rows[i] == rows:
            return self._grid_row(i, nodes)
        if i in (0, len(self.tree_rows)):
            j = min(i, len(self.tree_rows) - 1)
            return self._grid_row(j, nodes) * self.target_time(rows) / self.target_time(self.tree_rows[j])
        r0, r1 = self.tree_rows[i - 1], self.tree_rows[i]
        y0, y1 = self._grid_row(i - 1, nodes), self._grid_row(i, nodes)
        return y0 + (y1 - y0) * (rows - r0) / (r1 - r0)

    def tree_points(self, i: int) -> list[tuple[int, float]]:
        """The measured ``(tokens per row, seconds)`` points of ``tree_rows[i]`` rows."""
        return [(n, s) for n, s in zip(self.tree_nodes, self.tree_seconds[i], strict=True) if s is not None]

    def _grid_row(self, i: int, nodes: int) -> float:
        """Seconds of ``tree_rows[i]`` rows of ``nodes`` tokens, along that row count's measured curve (from its
        one-token point); a row count with no tree measured is priced as ``rows * nodes`` one-token rows."""
        rows = self.tree_rows[i]
        measured = self.tree_points(i)
        if not measured:
            return self.target_time(rows * nodes)
        xs = [1] + [n for n, _ in measured]
        ys = [self.target_time(rows)] + [s for _, s in measured]
        return interpolate(xs, ys, nodes)

    def drafter_time(self, name: str, tokens: float) -> float:
        """Predicted seconds of one unit of drafter ``name``'s proposals over ``tokens`` tokens."""
        return interpolate(self.tokens, self.drafter_seconds[name], tokens)

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON (atomically)."""
        return write_atomically(Path(path), json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        return cls(**json.loads(Path(path).read_text()))


def interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through the points; beyond the ends, the nearest segment's line (never below zero)."""
    if len(xs) == 1:
        return ys[0] * max(x / xs[0], 1.0)
    i = 1
    while i < len(xs) - 1 and xs[i] < x:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


def find_knee(tokens: list[int], seconds: list[float]) -> int:
    """The token count where a latency curve stops being flat and starts growing in proportion to tokens.

    Fits ``latency = a`` up to the knee ``k`` and ``a * t / k`` beyond it (flat, then proportional: the roofline of a
    forward that is first bound by reading the weights, then by compute) for every measured ``k``, by least squares
    on relative errors, and returns the best ``k``.
    """
    if len(tokens) != len(seconds) or len(tokens) < 2:
        raise ValueError("find_knee needs at least two (tokens, seconds) points of equal count")
    t = torch.tensor(tokens, dtype=torch.float64, device="cpu")
    y = torch.tensor(seconds, dtype=torch.float64, device="cpu")
    best, best_err = tokens[0], float("inf")
    for k in tokens:
        shape = torch.clamp(t / k, min=1.0)  # latency = a * shape
        a = (shape / y).sum() / (shape * shape / (y * y)).sum()  # minimises sum(((a * shape - y) / y)^2)
        err = float((((a * shape - y) / y) ** 2).sum())
        if err < best_err:
            best, best_err = k, err
    return best


def profile_path(
    model_name: str,
    device: torch.device,
    dtype: torch.dtype,
    cache_dir: str | Path | None = None,
    backend: str | None = None,
) -> Path:
    """Where the profile of this model on this device (`fastgrpo.machine.device_key`) and dtype, with its forwards
    compiled by ``backend`` or eager, is kept."""
    root = Path(cache_dir or cache_root()) / "profiles"
    compiled = f"-compiled-{backend}" if backend else ""
    return root / f"{file_key(model_name, device_key(device), str(dtype))}{compiled}-v{PROFILE_VERSION}.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one call of ``fn``, its device work included."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def warm_up(fn: Callable[[], object], device: torch.device) -> None:
    """Call ``fn`` until its calls take a steady time: at least `MIN_WARM_CALLS` times, then until two calls in a row
    are within `STEADY_RATIO` of each other, at most `MAX_WARM_CALLS` times.

    A function that is slow on its first ``k`` calls (a compiled one: compiling, then on a GPU recording its CUDA
    graph, before the calls that replay it) is past them once two calls in a row take about the same time, unless
    two of its slow calls in a row happen to; with ``k`` up to `MIN_WARM_CALLS` it is past them in any case."""
    calls, last = 1, _seconds(fn, device)
    while calls < MAX_WARM_CALLS:
        now = _seconds(fn, device)
        calls += 1
        if calls >= MIN_WARM_CALLS and max(now, last) <= STEADY_RATIO * min(now, last):
            return
        last = now


def interleaved_medians(
    fns: list[Callable[[], object]], repeats: int, device: torch.device, progress: bool
) -> list[float]:
    """Median seconds of every function, timed in ``repeats`` rounds that each run all of them once (after each is
    warmed up to its steady calls, `warm_up`), so that a slow spell of a shared machine spreads over every point
    instead of bending one."""
    from tqdm.auto import tqdm

    for fn in fns:
        warm_up(fn, device)
    times: list[list[float]] = [[] for _ in fns]
    for _ in tqdm(range(repeats), desc="profile", disable=not progress):
        for fn, seen in zip(fns, times, strict=True):
            seen.append(_seconds(fn, device))
    return [statistics.median(seen) for seen in times]


@torch.inference_mode()
def measure(
    model: PreTrainedModel,
    model_name: str,
    probes: ProbeFactory = no_probes,
    tokens: tuple[int, ...] = DEFAULT_TOKENS,
    context_length: int = 256,
    repeats: int = 5,
    progress: bool = False,
    backend: str | None = None,
) -> LatencyProfile:
    """Time target forwards and the ``probes``' drafters at each token count; returns the profile with its knee.

    With a ``backend``, the forwards run compiled by ``torch.compile`` with it. The model is left in the training
    mode it had."""
    _check(tokens, context_length)
    was_training = model.training
    model.eval()
    try:
        return _measure(
            model, model_name, probes(tokens, context_length, set()), tokens, context_length, repeats, progress, backend
        )
    finally:
        model.train(was_training)


def _check(tokens: tuple[int, ...], context_length: int) -> None:
    if not tokens or min(tokens) < 1 or list(tokens) != sorted(set(tokens)):
        raise ValueError(f"token counts must be increasing positive integers, got {tokens}")
    if context_length < 2:
        raise ValueError(f"context_length must be >= 2, got {context_length}")


def _measure(
    model: PreTrainedModel,
    model_name: str,
    probes: dict[str, CostProbe],
    tokens: tuple[int, ...],
    context_length: int,
    repeats: int,
    progress: bool,
    backend: str | None,
) -> LatencyProfile:
    param = next(model.parameters())
    dev = param.device
    decoder, head = decoder_and_head(model)
    rows = max(tokens)
    grid_rows = [r for r in tokens if r & (r - 1) == 0]
    grid = [(r, n) for r in grid_rows for n in TREE_NODES if r * n <= rows]
    compiled = backend is not None
    cache = RowCache(model.config, rows, context_length + max(TREE_NODES) + 2, param.dtype, dev, compiled)
    target = partial(Compiled(_target_forward, backend), dev)
    gen = torch.Generator(device="cpu").manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    target_fns = []
    for t in tokens:
        base = context_length - torch.randint(0, 2, (t,), generator=gen, device="cpu").to(dev)  # ragged: masked path
        ids = torch.randint(0, vocab, (t, 1), generator=gen, device="cpu").to(dev)
        target_fns.append(partial(target, decoder, head, cache, base, ids, context_length + 1))
    tree_fns = []
    for r, n in grid:
        base = context_length - torch.randint(0, 2, (r,), generator=gen, device="cpu").to(dev)
        ids = torch.randint(0, vocab, (r, n), generator=gen, device="cpu").to(dev)
        tree_fns.append(partial(target, decoder, head, cache, base, ids, context_length + n))
    drafter_fns = [fn for probe in probes.values() for fn in probe.calls]
    modules = tuple(m for probe in probes.values() for m in probe.modules)
    with rollout_attention(model, *modules), nullcontext() if compiled else rollout_linears(model, *modules):
        seconds = interleaved_medians(target_fns + tree_fns + drafter_fns, repeats, dev, progress)
    target_s = seconds[: len(tokens)]
    measured = dict(zip(grid, seconds[len(tokens) : len(tokens) + len(grid)], strict=True))
    drafter_s = seconds[len(tokens) + len(grid) :]
    return LatencyProfile(
        model=model_name,
        device=device_key(dev),
        dtype=str(param.dtype).removeprefix("torch."),
        context_length=context_length,
        tokens=list(tokens),
        target_seconds=target_s,
        c_peak=find_knee(list(tokens), target_s),
        drafter_seconds=_split(drafter_s, probes, len(tokens)),
        tree_rows=grid_rows,
        tree_nodes=list(TREE_NODES),
        tree_seconds=[[measured.get((r, n)) for n in TREE_NODES] for r in grid_rows],
    )


def _split(seconds: list[float], probes: dict[str, CostProbe], count: int) -> dict[str, list[float]]:
    """The probes' timings, ``count`` per probe in order, by drafter name."""
    return {name: seconds[i * count : (i + 1) * count] for i, name in enumerate(probes)}


def _target_forward(decoder, head, cache: RowCache, base: torch.Tensor, ids: torch.Tensor, extent: int) -> torch.Tensor:
    """One target forward plus LM head over ``[B, N]`` tokens per row after ``base`` cached ones, the keys spanning
    ``extent`` slots (N = 1: a decoding step; a causal block of N costs what a draft tree of as many nodes costs)."""
    return head(forward_chain(decoder, cache, base, input_ids=ids, extent=extent))


@torch.inference_mode()
def add_drafters(
    profile: LatencyProfile,
    model: PreTrainedModel,
    probes: ProbeFactory,
    backend: str | None = None,
    repeats: int = 2,
) -> list[str]:
    """Time the drafters of ``probes`` that ``profile`` lacks, at its token counts and context length (compiled by
    ``backend`` as the profile's forwards were), into it; returns their names."""
    made = probes(tuple(profile.tokens), profile.context_length, set(profile.drafter_seconds))
    if not made:
        return []
    dev = next(model.parameters()).device
    modules = tuple(m for probe in made.values() for m in probe.modules)
    linears = nullcontext() if backend is not None else rollout_linears(model, *modules)
    with rollout_attention(model, *modules), linears:
        seconds = interleaved_medians([fn for probe in made.values() for fn in probe.calls], repeats, dev, False)
    profile.drafter_seconds |= _split(seconds, made, len(profile.tokens))
    return list(made)


def calibrate(
    model: PreTrainedModel, model_name: str, probes: ProbeFactory = no_probes, backend: str | None = None
) -> LatencyProfile:
    """A short profile of a few forwards, for a first run with no saved profile (the adaptive controller corrects
    it online from the step times it observes)."""
    return measure(model, model_name, probes, CALIBRATION_TOKENS, context_length=128, repeats=2, backend=backend)


def load_or_calibrate(
    model: PreTrainedModel, model_name: str, probes: ProbeFactory = no_probes, backend: str | None = None
) -> LatencyProfile:
    """The saved profile of this model, device and dtype (and compile ``backend``) when there is one, with the
    drafters of ``probes`` it lacks timed into it; else a short calibration. Either is saved there, so that the next
    run on this machine starts at once (`fastgrpo profile` replaces it)."""
    param = next(model.parameters())
    path = profile_path(model_name, param.device, param.dtype, backend=backend)
    if path.is_file():
        profile = LatencyProfile.load(path)
        if add_drafters(profile, model, probes, backend):
            profile.save(path)
        return profile
    profile = calibrate(model, model_name, probes, backend)
    profile.save(path)
    return profile
