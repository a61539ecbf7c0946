"""Shapes settled before the first step: a compiled engine runs every row bucket and tree size of its `ShapeMenu` once
before a call's first step (`RolloutEngine.settle`), so that rollouts whose rows end on EOS at different steps, with
prompts of lengths from 90 to 330 tokens, compile nothing and meet no new shape after it: no step is cold, and no
graph is compiled nor shape met beyond the computed numbers.

Compiled with the ``eager`` backend: Dynamo's capture run as captured, which traces, guards and counts graphs and
shapes as under inductor, without AOT's second trace of every graph (checked where the same functions compile with
inductor, `test_tool_turns`, and with ``aot_eager``, `test_fused_attention` and `test_cold_steps`)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_model
from test_controller import flat_profile

from fastgrpo.config import ControllerLimits
from fastgrpo.rollout import drafter as drafter_module
from fastgrpo.rollout.cache import read_slots
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.shape_menu import menu_of, row_buckets
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.controller import AdaptiveController
from fastgrpo.speculative.eagle.drafter import CATCH_UP_WIDTH, EagleDrafter
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.merged import priced
from fastgrpo.speculative.suffix.drafter import SuffixDrafter

EOS = [19, 60, 52]  # tokens the tiny Llama samples often: rows end at every step of a call
PARAMS = SamplingParams(max_new_tokens=64, temperature=1.0)


def prompts(rng: random.Random, count: int, longest: int) -> list[list[int]]:
    """``count`` random prompts of 90 to ``longest`` tokens."""
    return [[rng.randrange(2, 128) for _ in range(rng.randrange(90, longest))] for _ in range(count)]


def test_bucket_lists() -> None:
    assert row_buckets(1) == [2] and row_buckets(64) == [2, 4, 8, 16, 32, 64] and row_buckets(33) == row_buckets(64)


@pytest.mark.parametrize("speculation", ["plain", "adaptive"])
def test_rollouts_compile_only_while_settling(
    speculation: str, fake_clock: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled rollouts of rows ending on EOS, prompts of many lengths: plain steps (64 rows, five calls), or
    trees of the EAGLE and suffix drafters chosen adaptively (8 rows, two calls, steps timed by a fake clock on
    which trees win). The first call compiles the menu's graphs and meets its shapes while it settles; no call has a
    cold step, compiles anything more or meets another shape: every step reads the whole cache. The EAGLE drafter's
    catch-up and the merge of its tree with the suffix drafter's run inside its compiled proposal: eagerly, only a
    long backlog (a prompt, a run of plain steps) is read first."""
    torch._dynamo.reset()
    model = make_tiny_model("llama")
    rows, calls, drafters, controller = 64, 5, None, None
    if speculation == "adaptive":
        rows, calls = 8, 2
        torch.manual_seed(0)
        drafters = [EagleDrafter(DraftHead(model.config).double(), model, "eager"), SuffixDrafter()]
        profile = flat_profile()  # trees win: every step that can draft one does
        controller = AdaptiveController(profile, ControllerLimits(n_max=8), drafters=priced(drafters))
        merges, backlogs, proposals = [], [], []  # eager merges, eager catch-ups' backlogs, proposals
        merge, catch_up, propose = drafter_module.merge_trees, EagleDrafter._catch_up, EagleDrafter._propose
        monkeypatch.setattr(drafter_module, "merge_trees", lambda *a: merges.append(1) or merge(*a))
        monkeypatch.setattr(
            EagleDrafter,
            "_catch_up",
            lambda d, *a, **k: backlogs.append(max(d.state.host_count)) or catch_up(d, *a, **k),
        )
        monkeypatch.setattr(EagleDrafter, "_propose", lambda *a: proposals.append(1) or propose(*a))
    engine = RolloutEngine(model, EOS, drafter=drafters, controller=controller, backend="eager")
    longest = 330
    engine.reserve(rows, longest + PARAMS.max_new_tokens + 1)
    rng, outputs = random.Random(0), []
    for i in range(calls):
        batch = prompts(rng, 2, longest)
        outputs.append(engine.generate(batch, PARAMS, rows // 2, generator=torch.Generator().manual_seed(i)))
    menu = menu_of(engine)
    assert menu.extent == read_slots(engine.cache.max_len) and menu.rows == tuple(row_buckets(rows))
    stats = [out.stats for out in outputs]
    assert all(s.cold_steps == 0 for s in stats), "no step compiled or met a new shape"
    assert sum(s.compile_graphs + s.compile_shapes for s in stats[1:]) == 0
    assert engine.target.compile_graphs == menu.graphs and engine.target.compile_shapes == menu.recordings
    assert stats[0].compile_shapes == menu.recordings + (drafters[0].compile_shapes if drafters else 0)
    concurrency = {c for s in stats for c in s.concurrency}
    assert min(concurrency) < 4 and max(concurrency) > rows // 2, "rows ended at every step"
    if speculation == "adaptive":
        assert all(s.tree_nodes for s in stats), "every call verified trees"
        eagle = drafters[0]
        kinds = {s.levels == 1 for s in controller.shapes if s.speculative}
        assert len({s.nodes for s in controller.shapes if s.speculative}) > len(kinds) == 2
        assert eagle.compile_graphs == len(kinds), "two proposal graphs: one level, and the rest; merged or alone"
        assert eagle.compile_shapes == len(kinds) * len(menu.rows)
        assert all(controller.levels(s) == eagle.deepest(s) for s in controller.groups["eagle"])
        assert sum(s.drafter_steps.get("eagle+suffix", 0) for s in stats) > 0, "merged trees were verified"
        assert not merges and min(backlogs) > CATCH_UP_WIDTH and len(backlogs) < len(proposals), (backlogs, proposals)


def test_new_caches_and_drafters_settle_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settling is keyed by the caches' serial numbers, not their ``id`` (which a new cache may reuse): a call after
    `RolloutEngine.release` settles again, as one after `RolloutEngine.speculate`; the same caches do not. Each shape
    runs as many times as its graph needs before it replays (twice where CUDA graphs warm up and record)."""
    import fastgrpo.rollout.shape_menu as shape_menu

    torch._dynamo.reset()
    engine = RolloutEngine(make_tiny_model("llama"), EOS, backend="eager")
    settles, plain_calls, plain, settle_target = [], [], engine.target.plain, shape_menu.settle_target

    def settle(*args) -> None:
        before = len(plain_calls)
        settle_target(*args)
        settles.append((args[4], len(plain_calls) - before))

    monkeypatch.setattr(shape_menu, "settle_target", settle)
    monkeypatch.setattr(engine.target, "plain", lambda *a: plain_calls.append(a[3].shape[0]) or plain(*a))
    monkeypatch.setattr(engine.target, "warm_calls", lambda device: 2)
    params = SamplingParams(max_new_tokens=4)

    def call() -> None:
        engine.generate([[5, 6, 7]], params, 2)

    call()
    call()
    assert len(settles) == 1
    menu, runs = settles[0]
    assert runs == 2 * len(menu.rows) > 0
    engine.release()
    call()
    assert len(settles) == 2, "a new cache settles again"
    engine.speculate(None)
    call()
    assert len(settles) == 3, "other drafters settle again"
