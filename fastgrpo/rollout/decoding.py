"""A generation call handed out step by step (`fastgrpo.rollout.engine.RolloutEngine.decoding`), whose rows are
refilled as they finish when it decodes fewer at once than it has (`Refill`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from fastgrpo.rollout.sequence import ActiveRows, Generation, GenerationOutput, Sequence

Admit = Callable[[ActiveRows, list[list[int]], list[int], list[Sequence], Generation], ActiveRows]


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


@dataclass
class Refill:
    """The completions of a call that wait for room, in order: ``pending`` their prompts' indices in ``prompts`` and
    their sequences. A call decodes at most ``max_rows`` rows at once, and before each step `__call__` takes in as
    many of them as fit beside the live rows and those waiting on tools, with the engine's ``admit``
    (`fastgrpo.rollout.engine.RolloutEngine.admit`): one forward per intake, in which each of their prompts is
    prefilled once, however many of its completions join."""

    admit: Admit
    prompts: list[list[int]]
    pending: list[tuple[int, Sequence]]
    max_rows: int

    def take(self, count: int) -> tuple[list[list[int]], list[int], list[Sequence]]:
        """The next ``count`` completions: their distinct prompts, the prompt of each (an index into them) and their
        sequences."""
        taken, self.pending = self.pending[:count], self.pending[count:]
        used = list(dict.fromkeys(p for p, _ in taken))
        local = {p: i for i, p in enumerate(used)}
        return [self.prompts[p] for p in used], [local[p] for p, _ in taken], [seq for _, seq in taken]

    @property
    def waiting(self) -> list[list[int]]:
        """The prompts of the completions still waiting."""
        return [self.prompts[p] for p in dict.fromkeys(p for p, _ in self.pending)]

    def __call__(self, rows: ActiveRows, call: Generation) -> ActiveRows:
        """``rows`` and the rows taken in."""
        while self.pending:
            parked = 0 if call.parking is None else len(call.parking.rows)
            free = self.max_rows - rows.size - parked
            if free <= 0:
                break
            rows = self.admit(rows, *self.take(free), call)
            call.stats.refills += 1
        return rows


class Decoding:
    """A generation call of `RolloutEngine.decoding` in progress: `step` decodes one step of its live rows, until
    `done`; `output` is its result (made once). Made by the engine with its ``step`` (rows, call -> rows still
    active), ``compiled_so_far`` (`CompiledSoFar`), its value when the call began
    (``compiled_before``), whether its steps run ``compiled``, and the completions ``waiting`` for room (`Refill`)."""

    def __init__(
        self,
        step: Callable[[ActiveRows, Generation], ActiveRows],
        compiled_so_far: Callable[[], CompiledSoFar],
        compiled_before: CompiledSoFar,
        compiled: bool,
        call: Generation,
        rows: ActiveRows,
        waiting: Refill,
    ):
        self._step, self._compiled_so_far, self._compiled = step, compiled_so_far, compiled
        self.call, self.rows, self.waiting = call, rows, waiting
        self._compiled_before = compiled_before
        self._output: GenerationOutput | None = None

    @property
    def done(self) -> bool:
        """No row is live, none waits on a tool and no completion for room."""
        parked = self.call.parking is not None and self.call.parking.rows
        return not self.rows.size and not parked and not self.waiting.pending

    def step(self) -> None:
        """Take in the completions that fit (`Refill`), then decode one step."""
        self.rows = self.waiting(self.rows, self.call)
        if not self.done:  # (all the rows taken in may have ended at their first token)
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
