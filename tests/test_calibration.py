"""Calibration times only a function's steady calls: a compiled function is slow on its first few calls (compiling,
then on a GPU recording its CUDA graph), and only the calls after them (the replays) may enter a profile. The clock
is a fake one that each call advances by the seconds scripted for it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from fastgrpo.speculative import profiler

CPU = torch.device("cpu")


class ScriptedCall:
    """A function whose ``i``-th call (from 0) takes ``seconds(i)`` on the fake ``clock``; ``calls`` counts them."""

    def __init__(self, clock: list[float], seconds: Callable[[int], float]):
        self.clock = clock
        self.seconds = seconds
        self.calls = 0

    def __call__(self) -> None:
        self.clock[0] += self.seconds(self.calls)
        self.calls += 1


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The fake clock the profiler reads, in seconds."""
    now = [0.0]
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: now[0])
    return now


def slow_first(slow: tuple[float, ...], steady: float) -> Callable[[int], float]:
    """Seconds of a call that takes ``slow[i]`` on its first calls and ``steady`` after them."""
    return lambda i: slow[i] if i < len(slow) else steady


@pytest.mark.parametrize(
    "slow",
    [
        (5.0, 0.5),  # compiled on a GPU: the compilation, then the CUDA graph's recording
        (0.5, 0.5),  # two slow calls alike
        (5.0, 2.0, 0.5, 0.1),  # four, each faster than the one before
        (),  # eager: steady from the first call
    ],
)
def test_only_the_calls_after_the_slow_ones_are_timed(clock: list[float], slow: tuple[float, ...]) -> None:
    fns = [ScriptedCall(clock, slow_first(slow, 0.01)), ScriptedCall(clock, slow_first(slow, 0.03))]
    assert profiler.interleaved_medians(fns, 2, CPU, progress=False) == pytest.approx([0.01, 0.03])


def test_warming_up_takes_the_fewest_calls_of_a_steady_function_and_stops_at_the_most(clock: list[float]) -> None:
    """A steady function is called `MIN_WARM_CALLS` times before it is timed; one whose calls never settle (each
    twice or half the last) `MAX_WARM_CALLS` times, and is then timed as it is."""
    steady = ScriptedCall(clock, lambda i: 0.01)
    unsettled = ScriptedCall(clock, lambda i: 0.01 * 2 ** (i % 2))
    medians = profiler.interleaved_medians([steady, unsettled], 3, CPU, progress=False)
    assert steady.calls == profiler.MIN_WARM_CALLS + 3 and unsettled.calls == profiler.MAX_WARM_CALLS + 3
    assert medians == pytest.approx([0.01, 0.01 * 2 ** (profiler.MAX_WARM_CALLS % 2)])


def test_calibration_of_a_compiled_like_model_holds_only_its_steady_times(
    llama_model: PreTrainedModel, clock: list[float]
) -> None:
    """Each forward of the tiny model takes 5 s on the first call of its shape (compiling) and 0.5 s on the second
    (recording), then a synthetic roofline: flat 20 ms up to 16 tokens, proportional beyond. The calibration's
    profile holds the roofline alone, at every token count and grid point."""
    calls: dict[tuple[int, ...], int] = {}

    def steady(tokens: int) -> float:
        return 0.02 * max(1.0, tokens / 16)

    def compiled_like(module, args, kwargs) -> None:
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
        shape = tuple(ids.shape[:2])
        seen = calls.get(shape, 0)
        calls[shape] = seen + 1
        clock[0] += slow_first((5.0, 0.5), steady(shape[0] * shape[1]))(seen)

    handle = llama_model.get_decoder().register_forward_pre_hook(compiled_like, with_kwargs=True)
    try:
        profile = profiler.calibrate(llama_model, "tiny")
    finally:
        handle.remove()
    assert profile.target_seconds == pytest.approx([steady(t) for t in profiler.CALIBRATION_TOKENS])
    assert profile.c_peak == 16
    for rows, seconds in zip(profile.tree_rows, profile.tree_seconds, strict=True):
        for nodes, measured in zip(profile.tree_nodes, seconds, strict=True):
            assert measured is None or measured == pytest.approx(steady(rows * nodes)), (rows, nodes)
    assert any(s is not None for seconds in profile.tree_seconds for s in seconds)
