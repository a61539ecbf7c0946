"""A generation call handed out step by step (`fastgrpo.rollout.engine.RolloutEngine.decoding`), whose rows are
refilled as they finish when it decodes fewer at once than it has (`Refill`), and which may take in more completions
while it runs and hand over a part of them once they all ended (`Decoding.extend`, `Decoding.hand_over`): a call that
spans generations, each handed over as it ends while the next ones decode."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from fastgrpo.rollout.cache import call_length
from fastgrpo.rollout.call_setup import CallSetup
from fastgrpo.rollout.host import host_to_device
from fastgrpo.rollout.sequence import ActiveRows, Generation, GenerationOutput, Sequence
from fastgrpo.rollout.stats import GenerationStats
from fastgrpo.sampling_params import SamplingParams

Admit = Callable[[ActiveRows, list[list[int]], list[int], list[Sequence], Generation], ActiveRows]


def check_prompts(
    prompt_ids: list[list[int]], num_generations: int, params: SamplingParams, uniforms: torch.Tensor | None
) -> None:
    """Refuse a call's (or an extension's) empty prompts and ``uniforms`` not of one per completion and position."""
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt must have at least one token")
    expected = (len(prompt_ids) * num_generations, params.max_new_tokens)
    if uniforms is not None and tuple(uniforms.shape) != expected:
        raise ValueError(f"uniforms must have shape {expected}, got {tuple(uniforms.shape)}")


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
    """The completions of a call that wait for room, in order: ``pending`` their prompts' keys in ``prompts`` and
    their sequences. A call decodes at most ``max_rows`` rows at once, and before each step `__call__` takes in as
    many of them as fit beside the live rows and those waiting on tools, with the engine's ``admit``
    (`fastgrpo.rollout.engine.RolloutEngine.admit`): one forward per intake, in which each of their prompts is
    prefilled once, however many of its completions join."""

    admit: Admit
    max_rows: int
    prompts: dict[int, list[int]] = field(default_factory=dict, init=False)
    pending: list[tuple[int, Sequence]] = field(default_factory=list, init=False)

    def add(self, prompt_ids: list[list[int]], seqs: list[Sequence], num_generations: int) -> None:
        """``seqs`` wait after the others: ``num_generations`` completions of each of ``prompt_ids`` in turn."""
        first = max(self.prompts, default=-1) + 1
        self.prompts |= {first + i: prompt for i, prompt in enumerate(prompt_ids)}
        self.pending += [(first + i // num_generations, seq) for i, seq in enumerate(seqs)]

    def take(self, count: int) -> tuple[list[list[int]], list[int], list[Sequence]]:
        """The next ``count`` completions: their distinct prompts, the prompt of each (an index into them) and their
        sequences."""
        taken, self.pending = self.pending[:count], self.pending[count:]
        used = list(dict.fromkeys(p for p, _ in taken))
        local = {p: i for i, p in enumerate(used)}
        prompts = [self.prompts[p] for p in used]
        waiting = {p for p, _ in self.pending}
        for p in used:  # (a prompt no completion waits for any more)
            if p not in waiting:
                del self.prompts[p]
        return prompts, [local[p] for p, _ in taken], [seq for _, seq in taken]

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


@dataclass(eq=False)
class Decoding:
    """A generation call of `RolloutEngine.decoding` in progress: `step` decodes one step of its live rows, until
    `done`; `output` is its result (made once). Made by the engine with its ``step_fn`` (rows, call -> rows still
    active), ``compiled_so_far`` (`CompiledSoFar`), its value when the call began (``compiled_before``), whether its
    steps run ``compiled``, the completions ``waiting`` for room (`Refill`), the ``setup`` its steps run inside and
    the ``capacity`` of its caches, in tokens of prompt and completion per row.

    A call may also span generations: `extend` takes in more completions while it runs, `hand_over` gives back those
    of one generation once they all ended (the others decoding on), and `paused` leaves the call's setup for work
    between steps, such as scoring and training the drafters on what was handed over."""

    step_fn: Callable[[ActiveRows, Generation], ActiveRows]
    compiled_so_far: Callable[[], CompiledSoFar]
    compiled_before: CompiledSoFar
    compiled: bool
    call: Generation
    rows: ActiveRows
    waiting: Refill
    setup: CallSetup
    capacity: int
    handed_over: int = 0  # parts given back (`hand_over`)
    _output: GenerationOutput | None = field(default=None, init=False)
    _free: list[int] = field(default_factory=list, init=False)  # noise rows of completions handed over, for reuse
    _slots: int = field(init=False)  # noise rows (`Sequence.index`) so far

    def __post_init__(self) -> None:
        self._slots = len(self.call.seqs)

    @property
    def done(self) -> bool:
        """No row is live, none waits on a tool and no completion for room."""
        parked = self.call.parking is not None and self.call.parking.rows
        return not self.rows.size and not parked and not self.waiting.pending

    def step(self) -> None:
        """Take in the completions that fit (`Refill`), then decode one step."""
        self.rows = self.waiting(self.rows, self.call)
        if not self.done:  # (all the rows taken in may have ended at their first token)
            self.rows = self.step_fn(self.rows, self.call)

    def finish(self) -> None:
        """Step until every row is done."""
        while not self.done:
            self.step()

    def paused(self) -> AbstractContextManager[None]:
        """Between steps, outside the call's setup inside the block (`CallSetup.paused`)."""
        return self.setup.paused()

    def extend(
        self, prompt_ids: list[list[int]], num_generations: int, uniforms: torch.Tensor | None
    ) -> list[Sequence]:
        """Take ``num_generations`` completions of each of ``prompt_ids`` into the call, after those waiting (they join
        as rows free up); ``uniforms`` ``[len(prompt_ids) * num_generations, max_new_tokens]`` pick their sampled tokens
        (None when greedy). Returns their sequences, prompt-major, for `hand_over`."""
        call = self.call
        if call.parking is not None:
            raise ValueError("a call with tools takes no completions in after it began")
        check_prompts(prompt_ids, num_generations, call.params, uniforms)
        if uniforms is None and not call.params.greedy:
            raise ValueError(
                "a sampled call takes completions in with their uniforms (one per completion and position)"
            )
        longest = max(map(len, prompt_ids))
        if call_length(longest, call.params.max_new_tokens) > self.capacity:
            raise ValueError(
                f"a prompt of {longest} tokens does not fit the call's caches, made for {self.capacity} tokens of "
                "prompt and completion (`RolloutEngine.reserve` sizes them for the longest)"
            )
        total = len(prompt_ids) * num_generations
        reused, self._free = self._free[:total], self._free[total:]
        slots = reused + list(range(self._slots, self._slots + total - len(reused)))
        self._slots += total - len(reused)
        noise = call.params.noise(total, None, uniforms, self.rows.ids.device)
        if noise is not None:
            if reused:
                call.noise[host_to_device(reused, noise.device)] = noise[: len(reused)]
            call.noise = torch.cat([call.noise, noise[len(reused) :]])
        seqs = [Sequence(slot, 0, hidden=[] if call.capture else None) for slot in slots]
        call.seqs += seqs
        self.waiting.add(prompt_ids, seqs, num_generations)
        return seqs

    def ended(self, seqs: list[Sequence]) -> bool:
        """Whether every one of ``seqs`` ended (none is live, waits on a tool or for room)."""
        parked = self.call.parking.rows.values() if self.call.parking is not None else []
        busy = {id(s) for s in self.rows.seqs} | {id(s) for _, s in self.waiting.pending}
        busy |= {id(p.seq) for p in parked}
        return not any(id(s) in busy for s in seqs)

    def hand_over(self, seqs: list[Sequence]) -> GenerationOutput:
        """The output of ``seqs``, completions of the call that all ended (`ended`), with the call's statistics since
        the part handed over before (begun afresh after); the call goes on without them."""
        handed, held = {id(s) for s in seqs}, {id(s) for s in self.call.seqs}
        if len(handed) != len(seqs) or not handed <= held:
            raise ValueError("hand over completions of the call, each once (not those handed over already)")
        if not self.ended(seqs):
            raise RuntimeError("a completion handed over has not ended: step the call until it has")
        self._finish_stats()
        out = self.call.output(seqs)
        self.call.seqs = [s for s in self.call.seqs if id(s) not in handed]
        self._free += [s.index for s in seqs]
        self.call.stats, self.compiled_before = GenerationStats(), self.compiled_so_far()
        self.handed_over += 1
        return out

    def output(self) -> GenerationOutput:
        """The completions (every row must be done) not handed over, with the call's statistics: its decoding time is
        that of its steps, and what the engine compiled (and ran eagerly though compiled) during them."""
        if not self.done:
            raise RuntimeError("the generation call still has live rows: step it until done")
        if self._output is None:
            self._finish_stats()
            self._output = self.call.output()
        return self._output

    def _finish_stats(self) -> None:
        stats, before, after = self.call.stats, self.compiled_before, self.compiled_so_far()
        stats.decode_time = sum(stats.step_times)
        stats.compiled = self.compiled
        stats.compile_time, stats.compile_graphs = after.seconds - before.seconds, after.graphs - before.graphs
        stats.compile_shapes = after.shapes - before.shapes
        eager = {name: n - before.eager_calls.get(name, 0) for name, n in after.eager_calls.items()}
        stats.eager_fallbacks = {name: n for name, n in eager.items() if n}
