"""Shapes settled before the first step: a compiled engine runs every row bucket, extent bucket and tree of its
`ShapeMenu` once before a call's first step (`RolloutEngine.settle`), so that rollouts whose rows end on EOS at
different steps, with prompts of lengths across several extent buckets, compile nothing and meet no new shape after
it: no step is cold, and no graph is compiled beyond the computed number.

Compiled with ``aot_eager``, which traces and guards as inductor does without generating code."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_model
from test_controller import flat_profile

from fastgrpo.config import ControllerLimits
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.shape_menu import extent_buckets, menu_of, row_buckets
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.controller import AdaptiveController
from fastgrpo.speculative.eagle.drafter import EagleDrafter
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
    assert extent_buckets(200) == [200] and extent_buckets(600) == [256, 512, 600]


@pytest.mark.parametrize("speculation", ["plain", "adaptive"])
def test_rollouts_compile_only_while_settling(speculation: str, fake_clock: SimpleNamespace) -> None:
    """Compiled rollouts of rows ending on EOS, prompts across extent buckets: plain steps (64 rows, five calls), or
    trees of the EAGLE and suffix drafters chosen adaptively (16 rows, three calls, steps timed by a fake clock on
    which trees win). The first call compiles the menu's graphs while it settles; no call has a cold step or
    compiles anything more."""
    torch._dynamo.reset()
    model = make_tiny_model("llama")
    rows, calls, drafters, controller = 64, 5, None, None
    if speculation == "adaptive":
        rows, calls = 16, 3
        torch.manual_seed(0)
        drafters = [EagleDrafter(DraftHead(model.config).double(), model, "aot_eager"), SuffixDrafter()]
        profile = flat_profile()  # trees win: every step that can draft one does
        controller = AdaptiveController(profile, ControllerLimits(n_max=3), drafters=priced(drafters))
    engine = RolloutEngine(model, EOS, drafter=drafters, controller=controller, backend="aot_eager")
    longest = 330
    engine.reserve(rows, longest + PARAMS.max_new_tokens + 1)
    rng, outputs = random.Random(0), []
    for i in range(calls):
        batch = prompts(rng, 2, longest)
        outputs.append(engine.generate(batch, PARAMS, rows // 2, generator=torch.Generator().manual_seed(i)))
    menu = menu_of(engine)
    assert len(menu.extents) == 2 and menu.rows == tuple(row_buckets(rows))
    stats = [out.stats for out in outputs]
    assert all(s.cold_steps == 0 for s in stats), "no step compiled or met a new shape"
    assert sum(s.compile_graphs for s in stats[1:]) == 0
    assert engine.target.compile_graphs == menu.graphs
    concurrency = {c for s in stats for c in s.concurrency}
    assert min(concurrency) < 4 and max(concurrency) > rows // 2, "rows ended at every step"
    if speculation == "adaptive":
        assert all(s.tree_nodes for s in stats), "every call verified trees"
        eagle = drafters[0]
        expansions = {(s.top_k == 1, s.levels) for s in controller.shapes if s.speculative}
        assert eagle.compile_graphs == len(expansions), "one expansion graph per depth (and a top-1 one)"
