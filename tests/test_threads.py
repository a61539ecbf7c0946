"""Tests for the thread governor, on fake clocks: no test here depends on the machine's load or speed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fastgrpo.threads import WINDOW_S, ThreadGovernor, idle_cpu_seconds


class FakeMachine:
    """A wall clock, this process's CPU time and the idle time of its CPUs, advanced by hand: ``run(seconds,
    own, idle)`` spends ``seconds`` of wall time in which the process ran on ``own`` cores and ``idle`` cores idled."""

    def __init__(self, readable: bool = True):
        self.wall, self.cpu, self.idle_s = 0.0, 0.0, 0.0
        self.readable = readable

    def run(self, seconds: float, own: float, idle: float) -> None:
        self.wall += seconds
        self.cpu += own * seconds
        self.idle_s += idle * seconds

    def governor(self, most: int, adapt: bool = True) -> ThreadGovernor:
        return ThreadGovernor(
            most,
            adapt,
            clock=lambda: self.wall,
            cpu_time=lambda: self.cpu,
            idle=lambda: self.idle_s if self.readable else None,
        )


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_one_thread_fewer_while_another_process_competes_and_back_when_it_stops(keep_threads: int) -> None:
    machine = FakeMachine()
    with machine.governor(2) as governor:
        assert torch.get_num_threads() == 2
        machine.run(WINDOW_S, own=1.95, idle=0.05)  # alone: the two cores are the process's
        assert governor.update() == 2 and governor.cores == pytest.approx(2.0)
        machine.run(WINDOW_S, own=1.0, idle=0.0)  # another busy process takes a core's worth
        assert governor.update() == 1 and torch.get_num_threads() == 1
        machine.run(WINDOW_S, own=0.9, idle=0.0)  # still there: stay at one thread
        assert governor.update() == 1
        machine.run(WINDOW_S, own=1.0, idle=0.95)  # it has gone: a core idles
        assert governor.update() == 2 and torch.get_num_threads() == 2
        metrics = governor.metrics()
        assert metrics == {"cpu/threads": 2.0, "cpu/cores": pytest.approx(1.95)}
    assert torch.get_num_threads() == keep_threads


def test_decides_once_a_window_has_passed(keep_threads: int) -> None:
    machine = FakeMachine()
    with machine.governor(2) as governor:
        machine.run(WINDOW_S / 2, own=1.0, idle=0.0)
        assert governor.update() == 2 and governor.cores is None  # half a window: nothing measured yet
        machine.run(WINDOW_S / 2, own=1.0, idle=0.0)
        assert governor.update() == 1


def test_never_below_one_nor_above_its_start(keep_threads: int) -> None:
    machine = FakeMachine()
    with machine.governor(2) as governor:
        for _ in range(3):
            machine.run(WINDOW_S, own=0.2, idle=0.0)
            governor.update()
        assert governor.threads == 1
        for _ in range(3):
            machine.run(WINDOW_S, own=1.0, idle=3.0)
            governor.update()
        assert governor.threads == 2


def test_fixed_threads_and_unreadable_idle_time_keep_the_count(keep_threads: int) -> None:
    machine = FakeMachine()
    with machine.governor(1, adapt=False) as governor:
        assert torch.get_num_threads() == 1
        machine.run(WINDOW_S, own=0.1, idle=1.9)
        assert governor.update() == 1
    blind = FakeMachine(readable=False)
    with blind.governor(2) as governor:
        blind.run(WINDOW_S, own=0.5, idle=0.0)
        assert governor.update() == 2 and governor.metrics() == {"cpu/threads": 2.0}


def test_idle_cpu_seconds_reads_the_allowed_cpus(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  10 0 10 1000 100 0 0 0 0 0\ncpu0 5 0 5 300 20 0 0 0 0 0\ncpu1 5 0 5 700 80 0 0 0 0 0\nintr 1 2 3\n"
    )
    tick = os.sysconf("SC_CLK_TCK")
    assert idle_cpu_seconds({1}, stat) == pytest.approx(780 / tick)
    assert idle_cpu_seconds({0, 1}, stat) == pytest.approx(1100 / tick)
    assert idle_cpu_seconds({7}, stat) is None
    assert idle_cpu_seconds({0}, tmp_path / "missing") is None


def test_most_must_be_positive() -> None:
    with pytest.raises(ValueError, match="most"):
        ThreadGovernor(0)


def test_more_threads_than_cores_are_clamped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    from fastgrpo.threads import allowed_cpus

    with caplog.at_level("WARNING", logger="fastgrpo.threads"):
        governor = ThreadGovernor(1000, adapt=False)
    assert governor.most == len(allowed_cpus())
    assert "cpu_threads: 1000 is more than the" in caplog.text
