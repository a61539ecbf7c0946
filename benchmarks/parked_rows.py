"""Rows parked on tools while others decode, watched: an EOS that ends turns early, tools that answer a few decoding
steps late, and a check that every parked row finds its keys and values as it left them when it resumes. Shared by
`gpu_check`'s ``parked`` section and the test suite's (`test_tool_turns`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.turns import Parking
from fastgrpo.sampling_params import SamplingParams


def frequent_token(model: Any, prompts: list[list[int]]) -> int:
    """The token most of ``model``'s greedy continuations of ``prompts`` hold, early (an EOS that ends turns, so that
    rows call tools)."""
    free = RolloutEngine(model, []).generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0))
    rows_with = Counter(t for c in free.completion_ids for t in set(c))
    return max(rows_with, key=lambda t: (rows_with[t], -t))


@dataclass
class LateTools:
    """Tool turns (`fastgrpo.rollout.turns.Turns`): every turn that ends with the EOS calls a tool, up to ``calls``
    per row, whose result ``[20 + turn, 21, row % 7 + 30]`` (its first ``length`` tokens) comes ``delay`` decoding
    steps after the call (each `ready` call is a step; one that must block moves on to the first result due)."""

    calls: int = 2
    length: int = 3
    delay: int = 4
    clock: int = 0
    waiting: dict[int, list[int]] = field(default_factory=dict)
    due: dict[int, int] = field(default_factory=dict)
    turns: dict[int, int] = field(default_factory=dict)

    def ended(self, row: int, completion: list[int]) -> bool:
        turn = self.turns.get(row, 0)
        if turn >= self.calls:
            return False
        self.waiting[row] = [20 + turn, 21, row % 7 + 30, 22, 23][: self.length]
        self.turns[row] = turn + 1
        self.due[row] = self.clock + self.delay
        return True

    def ready(self, block: bool) -> list[tuple[int, list[int] | None]]:
        self.clock += 1
        if block and self.waiting:
            self.clock = max(self.clock, min(self.due[r] for r in self.waiting))
        done = [r for r in self.waiting if self.due[r] <= self.clock]
        return [(r, self.waiting.pop(r)) for r in done]


@dataclass
class ParkedKV:
    """What `watch_parked` saw: how many parked rows resumed, and the resumes (completion index, cache slot) that
    found their keys or values written over."""

    resumed: int = 0
    changed: list[tuple[int, int]] = field(default_factory=list)


@contextmanager
def watch_parked(engine: RolloutEngine) -> Iterator[ParkedKV]:
    """While in the block, snapshot each row's filled cache slots of ``engine`` when it parks and compare them with
    its cache row when it resumes (every `RolloutEngine` is watched; the snapshots read ``engine``'s cache)."""
    seen, saved = ParkedKV(), {}
    append, rejoin = RolloutEngine.append, Parking._rejoin

    def rows_of(slot: int, length: int) -> list[torch.Tensor]:
        return [buf[slot, :, :length].clone() for layer in engine.cache.layers for buf in (layer.keys, layer.values)]

    def snapshot(this, rows, verified, host, call):
        out = append(this, rows, verified, host, call)
        for index, parked in (call.parking.rows if call.parking is not None else {}).items():
            saved.setdefault(index, rows_of(parked.slot, parked.length))
        return out

    def check(this, model, cache, drafters, rows, joining):
        for parked, _ in joining:
            before = saved.pop(parked.seq.index)
            seen.resumed += 1
            if any(not torch.equal(a, b) for a, b in zip(before, rows_of(parked.slot, parked.length), strict=True)):
                seen.changed.append((parked.seq.index, parked.slot))
        return rejoin(this, model, cache, drafters, rows, joining)

    with mock.patch.object(RolloutEngine, "append", snapshot), mock.patch.object(Parking, "_rejoin", check):
        yield seen
