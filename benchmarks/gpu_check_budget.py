"""What `gpu_check`'s compiling work is expected to cost, so that work which cannot end inside ``--budget`` does not
start: the graphs each section compiles (counted on a CPU with ``aot_eager``, which compiles the same dynamo graphs as
inductor without generating code) times the seconds one graph takes to compile.

The seconds per graph are assumptions until this run has compiled a graph of a model of that depth; from then on they
are the mean this run measured (`CompileClock`). The assumption scales with the model's layers (a decoding graph holds
every layer; its width changes the kernels' sizes, not their number): public figures for one inductor compile of a
28-layer 7B model are 25 to 70 s, and the upper end is taken, so that what starts has the time to end."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

PUBLIC_7B_GRAPH_SECONDS = 70.0  # one inductor compile of a 28-layer 7B graph: 25 to 70 s (public figures), upper end
PUBLIC_7B_LAYERS = 28
MIN_GRAPH_SECONDS = 10.0  # assumed floor of one inductor compile (Triton kernel builds), however few the layers
AOT_EAGER_GRAPH_SECONDS = 5.0  # assumed for one ``aot_eager`` graph (the CPU's backend): tracing, no code generation

# Decoder layers of the model each compiling section compiles, in the full run and with ``--quick``.
LAYERS = {
    "preflight": (1, 1),  # a one-line function
    "parked": (2, 2),  # a tiny Llama
    "torchrun": (2, 2),  # a tiny Llama
    "decode": (28, 2),
    "settle": (28, 2),
    "recordings": (28, 2),
    "host": (30, 2),
    "calibration": (30, 2),
    "grpo": (30, 2),
}
# Graphs compiled by each unit of work that compiles on a GPU, counted with ``aot_eager`` on a CPU (tiny models at the
# full run's sweep points), in the order of a run (docs/benchmarks.md). A unit's count is what it compiles after the
# units before it: dynamo's caches are shared.
TORCHRUN_GRAPHS = 2  # the torchrun job: plain decoding, compile on
DECODE_STEP_GRAPHS = 1  # the decode section's engine step, per row count compiled
DECODE_VERIFY_GRAPHS = 2  # the decode section's verification forward, per point compiled (N = 1 and N = 8)
RECORDING_GRAPHS = {"plain": 1, "speculative": 5}  # four training rollouts
HOST_GRAPHS = {"plain": 1, "eagle": 4, "suffix": 3}  # per point of the host section (the most one point compiled)
CALIBRATION_GRAPHS = 6
PARKED_GRAPHS = 3  # the target's plain and tree steps and the EAGLE proposal of a tiny Llama
SETTLE_GRAPHS = 3  # the same of the decode model
GRPO_COMPILED_GRAPHS = 33  # the GRPO section's one compiled run (its calibration included)
# The graphs a section must compile before it has any figure: it is skipped when they do not fit the time left (the
# rest are checked one unit at a time inside it, `Section.in_time`).
START_GRAPHS = {
    "preflight": 1,
    "torchrun": TORCHRUN_GRAPHS,
    "parked": PARKED_GRAPHS,
    "decode": 0,  # every point is timed eagerly; the compiled ones are checked one by one
    "settle": SETTLE_GRAPHS,
    "recordings": RECORDING_GRAPHS["plain"],
    "host": HOST_GRAPHS["plain"],
    "calibration": CALIBRATION_GRAPHS,
    "grpo": 0,  # the eager runs compile nothing; the compiled one is checked before it starts
}

COMPILING_ON_CPU = {"preflight", "parked", "decode", "settle", "recordings"}  # on a CPU the others run eagerly


def compiled_graphs() -> int:
    """Graphs torch's compiler has compiled in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def assumed_graph_seconds(layers: int, cuda: bool) -> float:
    """The assumed seconds of one compile of a graph of ``layers`` decoder layers: inductor on a GPU (the public 7B
    figure per layer, at least `MIN_GRAPH_SECONDS`), ``aot_eager`` on a CPU."""
    if not cuda:
        return AOT_EAGER_GRAPH_SECONDS
    return max(PUBLIC_7B_GRAPH_SECONDS * layers / PUBLIC_7B_LAYERS, MIN_GRAPH_SECONDS)


@dataclass
class CompileClock:
    """Seconds per compiled graph measured in this run, by the depth (decoder layers) of the model compiled, and the
    estimate of a compile from them (or from `assumed_graph_seconds` for a depth not measured yet)."""

    cuda: bool
    measured: dict[int, tuple[float, int]] = field(default_factory=dict)  # layers -> (seconds, graphs)

    def graph_seconds(self, layers: int) -> float:
        """The expected seconds of one graph of a ``layers``-layer model."""
        seconds, graphs = self.measured.get(layers, (0.0, 0))
        return seconds / graphs if graphs else assumed_graph_seconds(layers, self.cuda)

    def source(self, layers: int) -> str:
        """Where `graph_seconds` comes from: measured in this run or assumed."""
        return "measured" if self.measured.get(layers, (0.0, 0))[1] else "assumed"

    @contextmanager
    def timing(self, layers: int) -> Iterator[None]:
        """Add the block's seconds and the graphs it compiled to the measurements of ``layers``-layer models (a block
        that compiled nothing adds nothing: its time was not a compile's)."""
        graphs, t0 = compiled_graphs(), time.perf_counter()
        try:
            yield
        finally:
            new = compiled_graphs() - graphs
            if new:
                seconds, count = self.measured.get(layers, (0.0, 0))
                self.measured[layers] = (seconds + time.perf_counter() - t0, count + new)


class Estimate(NamedTuple):
    """The graphs a section compiles, the seconds they are expected to take and whether the seconds per graph were
    measured in this run or assumed."""

    graphs: int
    seconds: float
    source: str


def section_estimate(name: str, clock: CompileClock, quick: bool) -> Estimate:
    """What section ``name`` must compile before it has a figure (`START_GRAPHS`; on a CPU only the sections of
    `COMPILING_ON_CPU` compile)."""
    if not START_GRAPHS.get(name) or not (clock.cuda or name in COMPILING_ON_CPU):
        return Estimate(0, 0.0, "nothing compiled")
    graphs, layers = START_GRAPHS[name], LAYERS[name][int(quick)]
    per_graph = clock.graph_seconds(layers)
    return Estimate(graphs, graphs * per_graph, f"{per_graph:.0f} s per graph, {clock.source(layers)}")
