"""A generation call handed out step by step (`fastgrpo.rollout.engine.RolloutEngine.decoding`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from fastgrpo.rollout.sequence import ActiveRows, Generation, GenerationOutput


class CompiledSoFar(NamedTuple):
    """What an engine's compiled functions did so far: seconds of the calls that compiled a graph, the graphs they
    compiled, the shapes they met (on a GPU, the CUDA graphs recorded), and per function the calls that ran eagerly
    though compiled."""

    seconds: float
    graphs: int
    shapes: int
    eager_calls: dict[str, int]

    @classmethod
    def of(cls, parts: list[Any]) -> CompiledSoFar:
        """The sums over ``parts`` (a `fastgrpo.rollout.target_step.TargetStep` and drafters)."""
        eager = {name: n for part in parts for name, n in part.eager_calls.items()}
        seconds, graphs = sum(p.compile_seconds for p in parts), sum(p.compile_graphs for p in parts)
        return cls(seconds, graphs, sum(p.compile_shapes for p in parts), eager)


class Decoding:
    """A generation call of `RolloutEngine.decoding` in progress: `step` decodes one step of its live rows, until
    `done`; `output` is its result (made once). Made by the engine with its ``step`` (rows, call -> rows still
    active), ``compiled_so_far`` (`CompiledSoFar`), its value when the call began
    (``compiled_before``) and whether its steps run ``compiled``."""

    def __init__(
        self,
        step: Callable[[ActiveRows, Generation], ActiveRows],
        compiled_so_far: Callable[[], CompiledSoFar],
        compiled_before: CompiledSoFar,
        compiled: bool,
        call: Generation,
        rows: ActiveRows,
    ):
        self._step, self._compiled_so_far, self._compiled = step, compiled_so_far, compiled
        self.call, self.rows = call, rows
        self._compiled_before = compiled_before
        self._output: GenerationOutput | None = None

    @property
    def done(self) -> bool:
        """No row is live and none waits on a tool."""
        return not self.rows.size and (self.call.parking is None or not self.call.parking.rows)

    def step(self) -> None:
        self.rows = self._step(self.rows, self.call)

    def finish(self) -> None:
        """Step until every row is done."""
        while not self.done:
            self.step()

    def output(self) -> GenerationOutput:
        """The completions (every row must be done), with the call's statistics: its decoding time is that of its
        steps, and what the engine compiled (and ran eagerly though compiled) during them."""
        if not self.done:
            raise RuntimeError("the generation call still has live rows: step it until done")
        if self._output is None:
            stats, before, after = self.call.stats, self._compiled_before, self._compiled_so_far()
            stats.decode_time = sum(stats.step_times)
            stats.compiled = self._compiled
            stats.compile_time, stats.compile_graphs = after.seconds - before.seconds, after.graphs - before.graphs
            stats.compile_shapes = after.shapes - before.shapes
            eager = {name: n - before.eager_calls.get(name, 0) for name, n in after.eager_calls.items()}
            stats.eager_fallbacks = {name: n for name, n in eager.items() if n}
            self._output = self.call.output()
        return self._output
