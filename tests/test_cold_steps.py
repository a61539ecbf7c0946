"""Compiling is not a step: a decoding step that compiled or warmed up a graph is not timed into the adaptive
controller's prices, no observation moves a price by more than a bounded factor, a kind priced out is probed again,
and a function that cannot be compiled runs eagerly with one warning.

Steps are timed by a fake clock that each compiled call advances: by a steady step's time, or a hundred times that
when the call compiled or warmed up a graph (as a GPU's first tree step compiles for tens of seconds against
milliseconds)."""

from __future__ import annotations

import gc
import logging
from types import SimpleNamespace

import pytest
import torch
from conftest import VOCAB, make_tiny_model
from test_controller import flat_profile

from fastgrpo.config import ControllerLimits
from fastgrpo.rollout import compiled as compiled_module
from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.scheduling import AUTOREGRESSIVE
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.controller import AdaptiveController
from fastgrpo.speculative.suffix.drafter import SuffixDrafter

PROMPTS = [[5, 17, 3, 9], [40, 2, 9, 11, 60, 7]]


def prices(controller: AdaptiveController) -> dict[tuple[int, TreeShape], float]:
    """The controller's predicted seconds of every candidate shape at 1 to 16 rows."""
    return {(rows, s): controller.predicted_seconds(rows, s) for rows in (1, 2, 4, 8, 16) for s in controller.shapes}


def test_a_step_that_compiles_prices_nothing_out(fake_clock: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled steps (the ``eager`` backend) with the suffix drafter chosen adaptively, not settled before the call
    (as a shape outside the engine's menu would be met): the steps that compiled a tree step or met a new shape take a
    hundred times a replay, yet no observation moves any predicted price by more than 4x, and the next call still runs
    tree steps."""
    torch._dynamo.reset()
    monkeypatch.setattr(RolloutEngine, "settle", lambda self, params: None)
    model = make_tiny_model("llama")
    drafter = SuffixDrafter()
    controller = AdaptiveController(flat_profile(), ControllerLimits(n_max=4), drafters={"suffix": drafter})
    engine = RolloutEngine(model, [VOCAB], drafter=drafter, controller=controller, backend="eager")
    moves = []
    observe = controller.observe

    def watched(rows, shape, seconds, accepted, path_rank=None):
        before = prices(controller)
        observe(rows, shape, seconds, accepted, path_rank)
        after = prices(controller)
        moves.append(max(max(after[k] / before[k], before[k] / after[k]) for k in before))

    controller.observe = watched
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    first = engine.generate(PROMPTS, params, num_generations=4)
    assert first.stats.cold_steps >= 2 and first.stats.tree_nodes, "a plain and a tree step compiled, trees ran"
    assert max(moves) <= 4.0
    second = engine.generate(PROMPTS, params, num_generations=4)
    assert second.stats.tree_nodes, "trees still run in the next call"
    assert second.completion_ids == first.completion_ids


def test_one_slow_step_moves_a_price_by_a_bounded_factor_and_a_priced_out_kind_is_probed_again() -> None:
    """An eager first tree step 50x slower than steady ones moves its kind's correction by at most
    ``max_price_step``; a kind whose price stays high is still probed once ``reprobe_steps`` steps have passed since
    it was timed, and a steady measure brings its price back."""
    controller = AdaptiveController(
        flat_profile(), drafters={"suffix": SuffixDrafter()}, probe_interval=4, max_probe_interval=8, reprobe_steps=64
    )
    tree = controller.groups["suffix"][0]
    for _ in range(3):
        controller.observe(4, AUTOREGRESSIVE, 0.05, None)
    controller.observe(4, tree, 50 * 0.05, [0] * 4, [[tree.nodes] * 3] * 4)
    assert controller.correction[("spec:suffix", None)] == pytest.approx(2.0)
    for _ in range(6):  # the kind's price is raised as high as a run of slow steps can take it
        controller.observe(4, tree, 50 * 0.05, [0] * 4, [[tree.nodes] * 3] * 4)
    assert controller.correction[("spec:suffix", None)] > 20
    chosen = []
    for _ in range(400):
        shape = controller.choose(4)
        chosen.append(shape)
        seconds = 0.055 if shape.speculative else 0.05
        controller.observe(4, shape, seconds, [2] * 4 if shape.speculative else None, [[1, 2, 3]] * 4)
    first_tree = next(i for i, s in enumerate(chosen) if s.speculative)
    assert 64 - 8 <= first_tree <= 64 + 3 * 8, "probed again once its price was overdue"
    assert chosen[-1].speculative, "the steady measures brought trees back"


def test_a_graph_break_falls_back_to_the_eager_step_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A decoder layer with a graph break, compiled with ``fullgraph``: `generate` finishes with the eager engine's
    tokens, greedy and sampled, warns once with the reason, and counts every step that ran eagerly in
    ``compile/eager_fallbacks``."""
    torch._dynamo.reset()
    model = make_tiny_model("llama")
    layer = model.model.layers[0]
    forward = layer.forward

    def broken(*args, **kwargs):
        torch._dynamo.graph_break()
        return forward(*args, **kwargs)

    layer.forward = broken
    for params in (SamplingParams(max_new_tokens=10, temperature=0.0), SamplingParams(max_new_tokens=10)):
        uniforms = torch.rand(len(PROMPTS) * 2, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        eager = RolloutEngine(model, [VOCAB]).generate(PROMPTS, params, 2, uniforms=uniforms)
        compiled = RolloutEngine(model, [VOCAB], backend="eager")
        with caplog.at_level(logging.WARNING, logger=compiled_module.logger.name):
            out = compiled.generate(PROMPTS, params, 2, uniforms=uniforms)
            out = compiled.generate(PROMPTS, params, 2, uniforms=uniforms)
        assert out.completion_ids == eager.completion_ids
        warnings = [r for r in caplog.records if "cannot be compiled" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].eager_fallback == "plain_step"
        assert "graph_break" in warnings[0].getMessage(), "the warning says why it fell back"
        metrics = out.stats.metrics()
        assert metrics["compile/eager_fallbacks"] == metrics["compile/eager_fallbacks/plain_step"] == 9, "each step"
        assert "compile/eager_fallbacks/tree_step" not in metrics
        caplog.clear()


def test_a_new_cache_is_a_new_shape_key_even_at_a_freed_ones_id() -> None:
    """A cache made after another was freed may take its ``id``; its buffers are new, so its first call is cold:
    caches are made and freed until one takes a freed one's id, and every one of them has a key of its own."""
    config = make_tiny_model("llama").config
    keys, ids, reused = set(), set(), False
    while not reused and len(ids) < 200:
        cache = RowCache(config, 2, 16, torch.float64, torch.device("cpu"))
        keys.add(compiled_module.shape_key([cache]))
        reused = id(cache) in ids
        ids.add(id(cache))
        del cache
        gc.collect()  # a cache's layers refer back to it
    assert reused, "CPython hands freed ids back"
    assert len(keys) == len(ids) + 1


def test_every_graph_is_traced_once() -> None:
    """A compiled step is traced once per graph: a module's float attributes (the attention's scale) are constants,
    not symbols that make the compiler start its analysis over (which doubles every compile's time)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    engine = RolloutEngine(make_tiny_model("llama"), [VOCAB], backend="aot_eager")
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0), 2)
    attempts = torch._dynamo.utils.counters["aot_autograd"]
    assert attempts["ok"] >= 1 and attempts["total"] == attempts["ok"], dict(attempts)
