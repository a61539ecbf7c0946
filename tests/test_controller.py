"""Concurrency-aware speculation: the paper's tree-size rule, the adaptive goodput controller, the latency profiler,
and losslessness of every mode."""

from __future__ import annotations

import math
import random
import time
from functools import partial

import numpy as np
import pytest
import torch
from conftest import ProfiledLevels, adaptive, plugin_probes
from transformers import PreTrainedModel

from fastgrpo import machine
from fastgrpo.config import ControllerLimits
from fastgrpo.report import plot_profile
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.scheduling import AUTOREGRESSIVE, StaticController
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative import profiler
from fastgrpo.speculative.controller import AdaptiveController
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.merged import priced
from fastgrpo.speculative.paper import PaperController, shape_for
from fastgrpo.speculative.profiler import LatencyProfile, find_knee

EOS = 1
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [4]]


def flat_profile(target: float = 0.05, draft: float = 0.002, knee: int = 32) -> LatencyProfile:
    """Synthetic roofline: flat up to ``knee`` tokens, then proportional."""
    tokens = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    return LatencyProfile(
        model="synthetic",
        device="none",
        dtype="float32",
        context_length=128,
        tokens=tokens,
        target_seconds=[target * max(1.0, t / knee) for t in tokens],
        c_peak=knee,
        drafter_seconds={"eagle": [draft * max(1.0, t / knee) for t in tokens]},
    )


# -- the paper's rule --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (1, TreeShape(64, 8, 5)),  # N = 64; L = floor(log2(64 / 0.75)) = 6, capped at L_max 5
        (4, TreeShape(16, 8, 4)),  # N = 16; L = floor(log2(21.3)) = 4
        (10, TreeShape(6, 5, 3)),  # N = 6; K = N - 1; L = floor(log2(8)) = 3
        (16, TreeShape(4, 3, 3)),  # N = 4; L = floor(log2(5.3)) = 2, raised to L_min 3
        (32, TreeShape(2, 1, 3)),
        (64, AUTOREGRESSIVE),  # N = 1: no tree
        (100, AUTOREGRESSIVE),  # C_peak // B = 0 is clamped to 1
    ],
)
def test_paper_controller_follows_the_formulas(rows: int, expected: TreeShape) -> None:
    controller = PaperController(c_peak=64)
    assert controller.choose(rows) == expected
    n = max(1, min(64 // rows, 64))
    if n > 1:
        assert expected.top_k == min(n - 1, 8)
        assert expected.max_levels == min(max(math.floor(math.log2(n / 0.75)), 3), 5)


def test_paper_controller_respects_custom_limits() -> None:
    limits = ControllerLimits(n_max=8, k_max=2, l_min=2, l_max=3, alpha=0.5)
    controller = PaperController(c_peak=100, limits=limits)
    assert controller.choose(1) == TreeShape(8, 2, 3)  # N capped at 8, log2(16) = 4 capped at 3
    assert controller.choose(25) == TreeShape(4, 2, 3)  # N = 4, log2(8) = 3
    assert controller.choose(50) == TreeShape(2, 1, 2)  # N = 2, log2(4) = 2
    assert controller.max_shape == TreeShape(8, 2, 3)


@pytest.mark.parametrize("bad", [dict(n_max=0), dict(l_max=3, l_min=4), dict(alpha=0.0), dict(k_max=0)])
def test_bad_limits_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
        PaperController(c_peak=16, limits=ControllerLimits(**bad))


def test_n_verify_one_runs_no_draft_forward(llama_model: PreTrainedModel) -> None:
    draft = DraftHead(llama_model.config).double()
    calls = []
    draft.body.register_forward_hook(lambda *args: calls.append(1))
    params = SamplingParams(max_new_tokens=12, temperature=0)
    reference = RolloutEngine(llama_model, [EOS]).generate(PROMPTS, params)
    engine = RolloutEngine(
        llama_model, [EOS], drafter=EagleDrafter(draft, llama_model), controller=PaperController(c_peak=1)
    )
    out = engine.generate(PROMPTS, params)
    assert out.completion_ids == reference.completion_ids
    assert out.stats.draft_forwards == 0 and not calls
    assert out.stats.n_verify_mean == 1.0


# -- the adaptive controller ------------------------------------------------------------------------------------


def run_steps(controller: AdaptiveController, rows: int, steps: int, accept_fraction: float) -> list[TreeShape]:
    """Feed the controller steps whose times follow its profile and whose rows accept that fraction of the
    draft tokens offered at every depth. No ranks are passed, so the controller takes the accepted nodes as the
    best-scored chain of the tree (node ranks 1, 2, ...)."""
    chosen = []
    for _ in range(steps):
        shape = controller.choose(rows)
        chosen.append(shape)
        seconds = controller._profiled_seconds(rows, shape)
        levels = shape.levels
        accepted = [levels if accept_fraction >= 1 else 0] * rows
        if 0 < accept_fraction < 1:
            accepted = [round(levels * accept_fraction)] * rows
        controller.observe(rows, shape, seconds, accepted if shape.speculative else None)
    return chosen


def test_adaptive_chooses_autoregressive_when_nothing_is_accepted() -> None:
    controller = adaptive(flat_profile())
    chosen = run_steps(controller, rows=1, steps=200, accept_fraction=0.0)
    assert controller.best(1) == AUTOREGRESSIVE
    # Trees here cost a 25th of a plain step, so it takes a few dozen one-row steps to rule them out.
    assert sum(s.speculative for s in chosen[24:]) <= 6, "only rare probes after the first steps"


def test_one_unlucky_step_does_not_rule_a_good_draft_out() -> None:
    """The prior acceptance weighs as much as a few rows: a first one-row step that accepted nothing leaves trees
    chosen (with the plain 1/n average it replaced the prior, and one row rejects a draft token often)."""
    controller = adaptive(flat_profile(draft=0.01))
    assert controller.choose(1) == AUTOREGRESSIVE, "a plain step first"
    controller.observe(1, AUTOREGRESSIVE, controller._profiled_seconds(1, AUTOREGRESSIVE), None)
    shape = controller.choose(1)
    assert shape.speculative
    controller.observe(1, shape, controller._profiled_seconds(1, shape), [0])
    assert controller.best(1).speculative
    for _ in range(40):  # once many rows have accepted nothing, the prior no longer counts
        controller.observe(1, shape, controller._profiled_seconds(1, shape), [0])
    assert controller.best(1) == AUTOREGRESSIVE


def test_depths_no_tree_has_reached_cannot_outweigh_a_measured_zero() -> None:
    """Shallow trees accepted nothing; the deeper levels only the big trees have keep their prior, yet a big tree
    cannot expect more than the one bonus token, because a row reaches depth 4 only through depths 1 to 3."""
    controller = adaptive(flat_profile(draft=0.0), prior_rows=0)  # measured values replace the prior
    shallow = TreeShape(4, 3, 3)
    for _ in range(5):
        controller.observe(1, shallow, controller._profiled_seconds(1, shallow), [0])
    deep = shape_for(controller.limits, 24)
    assert deep.levels == 5 and controller.pooled[""][3] > 0
    assert controller.expected_tokens(deep) == pytest.approx(1.0)
    assert controller.best(1) == AUTOREGRESSIVE


def test_adaptive_chooses_big_trees_when_everything_is_accepted() -> None:
    controller = adaptive(flat_profile())
    run_steps(controller, rows=1, steps=100, accept_fraction=1.0)
    best = controller.best(1)
    assert best.nodes >= 16 and best.levels == 5  # the deepest trees the limits allow
    assert controller.expected_tokens(best) == pytest.approx(6.0, abs=1e-3)


def test_adaptive_shrinks_trees_as_concurrency_grows() -> None:
    """Past the knee a bigger tree makes every step slower: with 200 rows plain steps win, with one row trees do."""
    controller = adaptive(flat_profile(knee=32))
    run_steps(controller, rows=1, steps=100, accept_fraction=0.5)
    assert controller.best(1).speculative
    assert controller.best(256) == AUTOREGRESSIVE
    sizes = [controller.best(rows).nodes for rows in (1, 2, 4, 8, 16, 32, 64)]
    assert sizes == sorted(sizes, reverse=True)


def test_adaptive_corrects_the_profile_from_observed_times() -> None:
    controller = adaptive(flat_profile(target=0.05))
    for _ in range(30):
        controller.observe(4, AUTOREGRESSIVE, 0.1, None)  # steps take twice what the profile says
    assert controller.predicted_seconds(4, AUTOREGRESSIVE) == pytest.approx(0.1)
    assert controller.predicted_seconds(64, AUTOREGRESSIVE) == pytest.approx(2 * 0.05 * 2)  # unseen band: the mean
    for _ in range(30):
        controller.observe(64, AUTOREGRESSIVE, 0.05 * 2 * 3, None)  # at 64 rows, three times the profile
    assert controller.predicted_seconds(64, AUTOREGRESSIVE) == pytest.approx(0.3)
    assert controller.predicted_seconds(4, AUTOREGRESSIVE) == pytest.approx(0.1), "each band keeps its own factor"


def test_one_slow_plain_step_does_not_keep_trees_chosen_where_they_lose() -> None:
    """At 64 rows past the knee a tree of 2 nodes costs twice a plain step and emits 1.7 tokens: plain steps win.
    After a tree step as fast as the profile says, a plain step ran twice as slow as usual (the machine was busy),
    which makes trees look better, and a tree's steps say nothing of a plain step's time: the controller must run
    plain steps again to find out."""
    rows, controller = 64, adaptive(flat_profile())

    def accepted(step: int, shape: TreeShape) -> list[int]:
        draws = torch.rand(rows, shape.levels, generator=torch.Generator().manual_seed(step)) < 0.7
        return draws.long().cumprod(dim=1).sum(dim=1).tolist()

    tree = controller.groups[""][0]
    controller.observe(rows, tree, controller._profiled_seconds(rows, tree), accepted(-1, tree))
    controller.observe(rows, AUTOREGRESSIVE, 2 * controller._profiled_seconds(rows, AUTOREGRESSIVE), None)
    chosen = []
    for step in range(130):
        shape = controller.choose(rows)
        chosen.append(shape)
        seconds = controller._profiled_seconds(rows, shape)
        controller.observe(rows, shape, seconds, accepted(step, shape) if shape.speculative else None)
    assert chosen[0].speculative, "the slow step made trees look better"
    # Probes are due every 16, then 32 steps: a bigger tree first (once the steps have earned its loss: a tree of 4
    # nodes at 64 rows loses as much as 60 steps earn), then a plain step, which runs at once.
    plain_probe = chosen.index(AUTOREGRESSIVE)
    assert plain_probe < 110 and not any(s.speculative for s in chosen[plain_probe:]), "one plain probe found it"


def test_a_plain_step_runs_first_at_every_band_of_rows() -> None:
    """A latency profile calibrated while the machine was busy prices forwards of up to 32 tokens ten times too slow,
    and as costing the same; the machine is compute-bound. Trees, never priced cheaper than a plain step, would win
    against the plain step's unmeasured price for good once their own steps showed the machine fast (without the
    rule below, each of these 60 steps ran a tree). A plain step runs first at each
    power-of-two band of rows, and trees that have not run are priced at the machine's measured speed."""
    rows, controller = 16, adaptive(flat_profile(knee=32, draft=0.0))
    chosen = []
    for _ in range(60):
        shape = controller.choose(rows)
        chosen.append(shape)
        seconds = 0.005 * rows * shape.nodes / 16  # ten times the profile's speed, in proportion to the tokens
        controller.observe(rows, shape, seconds, [0] * rows if shape.speculative else None)
    assert chosen[0] == AUTOREGRESSIVE
    assert sum(s.speculative for s in chosen) <= 2 and not any(s.speculative for s in chosen[20:])
    assert controller.choose(8) == AUTOREGRESSIVE, "a band of rows not measured yet"


def test_adaptive_prices_a_tree_by_the_plain_steps_seen_at_its_token_count() -> None:
    """A target forward costs what its tokens cost, rows or tree nodes: plain steps over 8 rows that take twice the
    profile make a 2-row tree of 4 nodes (8 tokens) twice as dear before any tree has run, while plain steps over
    2 rows stay as profiled."""
    controller = adaptive(flat_profile(target=0.05, knee=64))
    tree = TreeShape(4, 2, 3)
    before = controller.predicted_seconds(2, tree)
    for _ in range(30):
        controller.observe(8, AUTOREGRESSIVE, 0.1, None)
        controller.observe(2, AUTOREGRESSIVE, 0.05, None)  # plain steps over 2 rows cost what the profile says
    assert controller.predicted_seconds(8, AUTOREGRESSIVE) == pytest.approx(0.1)
    assert controller.predicted_seconds(2, AUTOREGRESSIVE) == pytest.approx(0.05)
    assert controller.predicted_seconds(2, tree) == pytest.approx(2 * before)


def grid_profile(one_row_tree: float) -> LatencyProfile:
    """The one-token curve of a CPU where rows cost (50 ms at one row, 100 ms at 8), with a grid in which ``N``
    tokens in one row cost ``one_row_tree`` times one token and ``N`` tokens in each of 8 rows twice that row count's
    one token."""
    profile = flat_profile(target=0.05, draft=0.0001, knee=4)
    profile.tree_rows, profile.tree_nodes = [1, 8], [2, 4, 8]
    profile.tree_seconds = [[0.05 * one_row_tree] * 3, [0.2, 0.2, None]]  # 8 x 8 tokens: not measured
    return profile


def test_a_profile_prices_trees_by_rows_and_tokens_per_row() -> None:
    profile = grid_profile(one_row_tree=1.1)
    assert profile.tree_time(1, 1) == pytest.approx(0.05)
    assert profile.tree_time(1, 8) == pytest.approx(0.055), "measured, not 8 rows' 0.1"
    assert profile.tree_time(1, 3) == pytest.approx(0.055)
    assert profile.tree_time(8, 2) == pytest.approx(0.2)
    assert profile.tree_time(8, 8) == pytest.approx(0.2), "past the last measured N: the last segment's line"
    assert profile.tree_time(4, 4) == pytest.approx(0.055 + (0.2 - 0.055) * 3 / 7), "between row counts: linear"
    assert profile.tree_time(16, 2) == pytest.approx(0.2 * profile.target_time(16) / profile.target_time(8))
    assert flat_profile(knee=4).tree_time(2, 8) == pytest.approx(flat_profile(knee=4).target_time(16)), "no grid"


def test_adaptive_runs_deep_one_row_trees_where_the_grid_says_they_cost_a_plain_step() -> None:
    """With the prior acceptance and drafting almost free, the deepest trees win when a one-row tree of up to 64
    nodes costs 1.1 plain steps (the grid); priced as that many rows of one token, trees past the knee's 4 tokens
    cost more and the controller stays at 4 nodes."""
    flat = flat_profile(target=0.05, draft=0.0001, knee=4)
    by_tokens, by_grid = adaptive(flat), adaptive(grid_profile(one_row_tree=1.1))
    assert by_tokens.best(1).nodes == 4
    assert by_grid.best(1).nodes >= 16 and by_grid.best(1).levels == 5
    tree = TreeShape(8, 3, 4)
    assert by_grid.predicted_seconds(1, tree) < 0.6 * by_tokens.predicted_seconds(1, tree)


def test_adaptive_with_a_draft_that_never_agrees_falls_back_to_autoregressive(
    llama_model: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real engine run: the draft proposes only tokens the target never emits, so nothing is accepted. The clock is
    fake and the profile synthetic: each forward of the target advances the clock by 50 ms and each draft forward by
    1 ms, as the profile says, so that no timing noise of the machine decides the controller's choices."""
    params = SamplingParams(max_new_tokens=80, temperature=0)
    reference = RolloutEngine(llama_model, [EOS]).generate(PROMPTS, params)
    emitted = {t for c in reference.completion_ids for t in c} | {t for p in PROMPTS for t in p}
    never = torch.tensor([t for t in range(llama_model.config.vocab_size) if t not in emitted][:8])
    draft = DraftHead(llama_model.config, draft_vocab=never).double()
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    hooks = [
        module.register_forward_hook(lambda *_, cost=cost: now.__setitem__(0, now[0] + cost))
        for module, cost in ((llama_model.get_decoder(), 0.05), (draft.decoder, 0.001))
    ]
    try:
        controller = adaptive(flat_profile(target=0.05, draft=0.001, knee=64))
        engine = RolloutEngine(llama_model, [EOS], drafter=EagleDrafter(draft, llama_model), controller=controller)
        out = engine.generate(PROMPTS, params)
    finally:
        for hook in hooks:
            hook.remove()
    assert out.completion_ids == reference.completion_ids
    assert out.stats.accept_length == 1.0
    assert controller.best(1) == AUTOREGRESSIVE
    assert len(out.stats.tree_nodes) <= 10, "speculative steps stop after the first few and rare probes"


# -- losslessness of every mode ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["static", "paper", "adaptive"])
def test_every_mode_is_lossless_under_greedy_decoding(family_model: PreTrainedModel, mode: str) -> None:
    torch.manual_seed(0)
    draft = DraftHead(family_model.config).double()
    controllers = {
        "static": StaticController(TreeShape(8, 3, 4)),
        "paper": PaperController(c_peak=24, limits=ControllerLimits(n_max=16)),
        "adaptive": adaptive(flat_profile(), probe_interval=2),
    }
    params = SamplingParams(max_new_tokens=30, temperature=0)
    reference = RolloutEngine(family_model, [EOS]).generate(PROMPTS, params, 3)
    out = RolloutEngine(
        family_model, [EOS], drafter=EagleDrafter(draft, family_model), controller=controllers[mode]
    ).generate(PROMPTS, params, 3)
    assert out.completion_ids == reference.completion_ids
    assert out.finish_reasons == reference.finish_reasons
    if mode == "paper":  # 12 rows: N = 2, then bigger trees as rows finish
        assert len(set(out.stats.tree_nodes)) >= 1 and out.stats.tree_nodes[0] == 2


# -- profiling -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("knee", [8, 32, 64])
def test_find_knee_recovers_a_known_knee(knee: int) -> None:
    tokens = list(profiler.DEFAULT_TOKENS)
    gen = torch.Generator().manual_seed(knee)
    noise = 1 + 0.03 * (2 * torch.rand(len(tokens), generator=gen) - 1)
    seconds = [0.02 * max(1.0, t / knee) * float(e) for t, e in zip(tokens, noise, strict=True)]
    assert find_knee(tokens, seconds) == knee


def test_profiler_finds_the_knee_of_a_model_with_known_latency(
    llama_model: PreTrainedModel, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny model's decoder runs on a fake clock that each forward advances by a synthetic roofline (flat 20 ms
    up to 16 tokens, then proportional); measuring it must find 16."""
    clock = [0.0]

    def slow(module, args, kwargs):
        tokens = (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]).shape
        clock[0] += 0.02 * max(1.0, tokens[0] * tokens[1] / 16)

    monkeypatch.setattr(profiler.time, "perf_counter", lambda: clock[0])
    handle = llama_model.get_decoder().register_forward_pre_hook(slow, with_kwargs=True)
    llama_model.train()  # as a trainer's model is when its first rollout calibrates the controller
    try:
        profile = profiler.measure(
            llama_model, "tiny", plugin_probes(llama_model), tokens=(1, 2, 4, 8, 16, 32, 64), repeats=3
        )
    finally:
        handle.remove()
        was_training = llama_model.training
        llama_model.eval()
    assert was_training, "measuring must leave the model in the mode it had"
    assert profile.c_peak == 16
    assert profile.target_seconds[0] == pytest.approx(0.02)  # one forward's median, not three repeats summed
    assert profile.target_time(64) == pytest.approx(4 * profile.target_time(8))
    assert profile.tree_rows == [1, 2, 4, 8, 16, 32, 64] and profile.tree_nodes == list(profiler.TREE_NODES)
    assert profile.tree_time(4, 16) > 2 * profile.tree_time(1, 8)  # the grid: 64 tokens in 4 rows against 8 in one
    path = profile.save(tmp_path / "profile.json")
    assert LatencyProfile.load(path) == profile
    png = plot_profile(profile, tmp_path / "profile.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_path_is_keyed_by_model_device_and_dtype(tmp_path) -> None:
    a = profiler.profile_path("smollm2", torch.device("cpu"), torch.float32, tmp_path)
    b = profiler.profile_path("smollm2", torch.device("cpu"), torch.bfloat16, tmp_path)
    c = profiler.profile_path("other/model", torch.device("cpu"), torch.float32, tmp_path)
    assert len({a, b, c}) == 3 and all(p.parent == tmp_path / "profiles" for p in (a, b, c))
    assert all(p.name.endswith(f"-v{profiler.PROFILE_VERSION}.json") for p in (a, b, c)), "older kernels, other name"


def test_cpu_profiles_are_keyed_by_cpu_instruction_set_threads_and_torch(tmp_path, monkeypatch) -> None:
    path = partial(profiler.profile_path, "smollm2", torch.device("cpu"), torch.float32, tmp_path)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    avx2 = path()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    avx512 = path()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    threads = path()
    monkeypatch.setattr(machine, "cpu_model", lambda: "Another CPU")
    cpu = path()
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert len({avx2, avx512, threads, cpu, path()}) == 5


def test_load_or_calibrate_prefers_a_saved_profile_and_saves_its_calibration(
    llama_model: PreTrainedModel, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path))
    path = profiler.profile_path("tiny", torch.device("cpu"), torch.float64)
    calibrated = profiler.load_or_calibrate(llama_model, "tiny", plugin_probes(llama_model))
    assert calibrated.tokens == list(profiler.CALIBRATION_TOKENS)
    assert LatencyProfile.load(path) == calibrated, "the next run on this machine reads the calibration"
    monkeypatch.setattr(profiler, "calibrate", lambda *a: pytest.fail("calibrated again"))
    assert profiler.load_or_calibrate(llama_model, "tiny", plugin_probes(llama_model)) == calibrated
    saved = flat_profile()
    saved.save(path)
    assert profiler.load_or_calibrate(llama_model, "tiny", plugin_probes(llama_model)) == saved


def test_a_compiled_engine_is_priced_by_a_profile_of_compiled_forwards(
    llama_model: PreTrainedModel, tmp_path, monkeypatch
) -> None:
    """With ``compile`` the calibration times the forwards compiled (one graph each, no break) and keeps the profile
    apart from the eager one's. Compiled by Dynamo alone (its ``eager`` backend runs the graphs as captured): what is
    tested is which forwards are timed and where their profile goes, whatever compiles the graphs."""
    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path))
    eager = profiler.profile_path("tiny", torch.device("cpu"), torch.float64)
    compiled = profiler.profile_path("tiny", torch.device("cpu"), torch.float64, backend="eager")
    assert compiled != eager and compiled.parent == eager.parent
    profile = profiler.load_or_calibrate(llama_model, "tiny", plugin_probes(llama_model, backend="eager"), "eager")
    assert compiled.is_file() and not eager.exists()
    assert profile.tokens == list(profiler.CALIBRATION_TOKENS) and min(profile.target_seconds) > 0


def test_adaptive_does_not_probe_trees_that_cannot_win() -> None:
    """Far past the knee even a fully accepted tree is slower per token than a plain step: no probe runs there."""
    controller = adaptive(flat_profile(knee=8, draft=0.01), probe_interval=2)
    chosen = run_steps(controller, rows=256, steps=64, accept_fraction=1.0)
    assert not any(s.speculative for s in chosen)  # probes are due every few steps, but none could win


def test_adaptive_does_not_probe_when_the_draft_catch_up_would_cost_more_than_it_could_win() -> None:
    """After many plain steps a tree first feeds the draft every row's backlog; with a long backlog over many rows
    that costs more than a fully accepted tree could save, so the probes due every few steps do not run."""
    controller = adaptive(flat_profile(knee=32, draft=0.01), probe_interval=2, explore_share=1.0)
    run_steps(controller, rows=8, steps=20, accept_fraction=0.0)  # plain steps win; probes keep running
    assert controller.best(8) == AUTOREGRESSIVE
    probes = [controller.choose(8, backlog=1) for _ in range(64)]
    assert any(s.speculative for s in probes), "without a backlog the due probes run"
    controller.begin()
    assert not any(controller.choose(8, backlog=200).speculative for _ in range(64))


def test_a_changed_draft_is_probed_once_whatever_its_catch_up_costs() -> None:
    """Online learning changes the draft between rollouts. A draft that was bad when last measured must still be
    measured again, or the controller would never notice it has learned: the first due probe after a change runs
    despite the catch-up, and only until a tree has run (the budget is unbounded here: see the next test)."""
    controller = adaptive(flat_profile(knee=32, draft=0.01), probe_interval=2, explore_share=1.0)
    run_steps(controller, rows=8, steps=20, accept_fraction=0.0)
    controller.begin(draft_changed=False)
    assert not any(controller.choose(8, backlog=200).speculative for _ in range(64))
    controller.begin(draft_changed=True)
    chosen = [controller.choose(8, backlog=200) for _ in range(2)]
    assert chosen[-1].speculative, "the first due probe after a change runs"
    controller.observe(8, chosen[-1], controller._profiled_seconds(8, chosen[-1]), [0] * 8)
    assert not any(controller.choose(8, backlog=200).speculative for _ in range(64)), "once measured, no more"


def test_tree_probes_lose_at_most_their_share_of_the_time() -> None:
    """Where no tree wins (nothing accepted, 24 rows, a tree of 2 nodes costs 1.5 plain steps),
    the probes due every few steps run only as fast as the steps earn their loss: in all they lose at most
    ``explore_share`` of the time observed, plus one probe. A changed draft is still probed, however long its
    catch-up, once the steps have paid for it."""
    for share in (0.01, 0.05):
        profile = flat_profile(knee=32, draft=0.001)
        controller = adaptive(profile, probe_interval=2, max_probe_interval=4, explore_share=share)
        total = lost = 0.0
        probes = 0
        for step in range(2000):
            if step % 100 == 0:
                controller.begin(draft_changed=True)
            shape = controller.choose(24, backlog=10)
            seconds = controller._profiled_seconds(24, shape)
            if shape.speculative:
                probes += 1
                seconds += controller.draft_seconds(24, shape, 10) - controller.draft_seconds(24, shape)
                lost += seconds - controller.predicted_seconds(24, AUTOREGRESSIVE)
            total += seconds
            controller.observe(24, shape, seconds, [0] * 24 if shape.speculative else None)
        assert controller.best(16) == AUTOREGRESSIVE
        assert 0 < lost <= share * total + 2 * controller.predicted_seconds(24, controller.groups[""][0])
        assert probes >= 2000 * share / 2, "the budget, not the interval, limits the probes"


class RecordingController(StaticController):
    """A static controller that records the ``draft_changed`` flag of every generation call."""

    def __init__(self, shape: TreeShape):
        super().__init__(shape)
        self.changes: list[bool] = []

    def begin(self, draft_changed: bool = False) -> None:
        self.changes.append(draft_changed)


def test_the_engine_tells_the_controller_when_the_draft_has_changed(llama_model: PreTrainedModel) -> None:
    draft = DraftHead(llama_model.config).double()
    controller = RecordingController(TreeShape(4, 2, 2))
    engine = RolloutEngine(llama_model, [EOS], drafter=EagleDrafter(draft, llama_model), controller=controller)
    params = SamplingParams(max_new_tokens=4, temperature=0)
    engine.generate(PROMPTS, params)
    engine.generate(PROMPTS, params)
    with torch.no_grad():
        draft.fc.weight.mul_(0.5)  # what an optimizer step does: an in-place write
    engine.generate(PROMPTS, params)
    engine.generate(PROMPTS, params)
    assert controller.changes == [True, False, True, False]


# -- what smaller trees would have accepted ---------------------------------------------------------------------


def test_a_tree_ranks_its_nodes_so_that_ranks_below_n_are_the_tree_of_n_nodes() -> None:
    """Two rows of candidates (root children, then two children of each); the nodes of rank below ``n`` in the
    tree of 6 nodes are exactly the nodes of the tree of ``n`` nodes drafted from the same candidates."""
    from fastgrpo.speculative.eagle.expansion import _select

    cand_tok = [torch.tensor([[10, 11], [20, 21]]), torch.tensor([[12, 13, 14, 15], [22, 23, 24, 25]])]
    cand_score = [
        torch.tensor([[-0.1, -1.0], [-2.0, -0.3]]),
        torch.tensor([[-0.5, -3.0, -1.2, -4.0], [-2.1, -2.5, -0.4, -0.9]]),
    ]
    cand_parent = [torch.full((2, 2), -1), torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1]])]
    cand_depth = [torch.ones(2, 2, dtype=torch.long), torch.full((2, 4), 2)]
    root = torch.tensor([1, 2])
    full = _select(root, cand_tok, cand_score, cand_parent, cand_depth, nodes=6, levels=2)
    assert full.rank[0].tolist() == [0, 1, 3, 2, 5, 4]  # nodes 10, 11, 12, 13, 14 in candidate order
    for n in range(2, 6):
        small = _select(root, cand_tok, cand_score, cand_parent, cand_depth, nodes=n, levels=2)
        for b in range(2):
            kept = {t for t, r in zip(full.tokens[b].tolist(), full.rank[b].tolist(), strict=True) if r < n}
            assert kept == set(small.tokens[b].tolist())
        assert bool((full.rank.gather(1, full.parent.clamp(min=0)) <= full.rank).all()), "parents rank first"


def test_a_verification_teaches_every_smaller_tree_what_it_would_have_accepted() -> None:
    """One step of N32/K8/L5 over two rows: row 0 accepted nodes of ranks 1, 5, 9, row 1 one node of rank 2. The
    tree of 4 nodes would have accepted one token in each row, that of 8 nodes two in row 0; bigger shapes learn
    nothing from it."""
    controller = adaptive(flat_profile(), prior_rows=0)  # one measurement replaces the prior
    big = TreeShape(32, 8, 5)
    path_rank = np.array([[1, 5, 9, 32, 32], [2, 32, 32, 32, 32]])
    controller.observe(2, big, 0.06, [3, 1], path_rank)
    assert controller._fractions(big)[:3] == pytest.approx([1.0, 0.5, 0.5])
    assert controller._fractions(TreeShape(4, 3, 3))[:3] == pytest.approx([1.0, 0.0, 0.0])
    assert controller._fractions(TreeShape(8, 7, 3))[:3] == pytest.approx([1.0, 0.5, 0.0])
    assert TreeShape(64, 8, 5) not in controller.shape_accept
    # A bigger shape that has not run expects at least what the biggest measured one accepted.
    assert controller.expected_tokens(TreeShape(64, 8, 5)) == pytest.approx(controller.expected_tokens(big))


def test_the_engine_reports_the_ranks_of_the_accepted_path(llama_model: PreTrainedModel) -> None:
    """What the engine tells the controller: every accepted draft node has a rank below the tree's size, the first
    rejected position is at least the size, and the count of ranks below it is the accepted count."""
    torch.manual_seed(0)
    draft = DraftHead(llama_model.config).double()
    seen = []

    class Recording(StaticController):
        def observe(self, rows, shape, seconds, accepted, path_rank=None):
            seen.append((shape, torch.tensor(accepted), torch.tensor(path_rank)))

    engine = RolloutEngine(
        llama_model, [EOS], drafter=EagleDrafter(draft, llama_model), controller=Recording(TreeShape(6, 3, 3))
    )
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=12), num_generations=2)
    assert sum(int(accepted.sum()) for _, accepted, _ in seen) > 0, "some draft tokens were accepted"
    for shape, accepted, path_rank in seen:
        leading = (path_rank < shape.nodes).long().cumprod(dim=1).sum(dim=1)
        assert torch.equal(leading, accepted)
        assert bool((path_rank >= 1).all())


def test_an_unlucky_step_of_a_big_tree_does_not_rank_it_below_a_smaller_one() -> None:
    """A bigger tree accepts at least what a smaller one drafted from the same candidates does: a big tree measured
    on one step that accepted nothing is estimated at what the small trees accepted, not at zero."""
    controller = adaptive(flat_profile(), prior_rows=0)
    small, big = TreeShape(4, 3, 3), TreeShape(32, 8, 5)
    for _ in range(3):
        controller.observe(1, small, 0.05, [2], [[1, 2, 4]])
    controller.observe(1, big, 0.05, [0], [[32, 32, 32, 32, 32]])
    assert controller.shape_accept[big] == pytest.approx([0.0] * 5)
    assert controller.expected_tokens(small) == pytest.approx(1 + 0.75 + 0.75)  # three steps of 2, one of 0
    assert controller.expected_tokens(big) == pytest.approx(controller.expected_tokens(small))


def fake_clock_rollout(tree_cost: float, accept_length: float, rows: int = 8, tokens: int = 128) -> tuple[float, int]:
    """A rollout of ``rows`` rows of ``tokens`` tokens each, decoded by a fresh adaptive controller over an EAGLE, a
    suffix and their merged trees, priced by a profile in which a forward costs the same up to 64 tokens (what a GPU's
    profile says, and wrong by ``tree_cost`` here), on a fake clock: a plain step takes 1 s, a tree step
    ``tree_cost`` s, and each row of a tree step emits ``accept_length`` tokens on average (its draft tokens accepted
    one by one, each with the same chance, up to the tree's depth; drawn from a seeded generator). Returns the
    rollout's seconds and its tree steps."""
    profile = flat_profile(target=1.0, draft=0.01, knee=64)
    drafters = []
    for name in ("eagle", "suffix"):
        drafter = ProfiledLevels(profile)
        drafter.name = name
        drafters.append(drafter)
    controller = AdaptiveController(profile, drafters=priced(drafters))
    rng = random.Random(0)
    chance = (accept_length - 1) / accept_length  # a geometric count of mean accept_length - 1
    left, seconds, trees = [tokens] * rows, 0.0, 0
    controller.begin()
    while live := [i for i, n in enumerate(left) if n > 0]:
        shape = controller.choose(len(live))
        accepted = None
        if shape.speculative:
            accepted = []
            for _ in live:
                count = 0
                while count < controller.levels(shape) and rng.random() < chance:
                    count += 1
                accepted.append(count)
            trees += 1
        step = tree_cost if shape.speculative else 1.0
        seconds += step
        for i, count in zip(live, accepted or [0] * len(live), strict=True):
            left[i] -= 1 + count
        controller.observe(len(live), shape, step, accepted)
    return seconds, trees


def test_trees_that_cost_three_plain_steps_and_accept_little_cost_a_rollout_at_most_3_percent() -> None:
    """Trees at 3x a plain step accepting 1.3 tokens per row lose: a fresh controller whose profile prices them as
    cheap as a plain step finds out within a few steps, and the whole rollout takes at most 3 % longer than plain
    decoding (128 steps)."""
    seconds, trees = fake_clock_rollout(tree_cost=3.0, accept_length=1.3)
    assert seconds <= 1.03 * 128, f"{seconds:.1f} s against 128 s of plain steps, {trees} tree steps"


def test_trees_that_cost_little_more_and_accept_much_are_chosen_and_win() -> None:
    """Trees at 1.2x a plain step accepting 3 tokens per row win: they are chosen at most steps and the rollout is
    faster than plain decoding."""
    seconds, trees = fake_clock_rollout(tree_cost=1.2, accept_length=3.0)
    assert seconds < 0.7 * 128 and trees > 0.8 * (seconds / 1.2), f"{seconds:.1f} s, {trees} tree steps"


def test_trees_that_cost_more_than_they_saved_stop_the_probes_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    """Each timed tree step saved its tokens per row times a plain step's predicted time, less its own time: here
    trees take 1.5 plain steps and first accept nothing. Once a full window of tree steps cost more than it saved,
    the run's log says so once and the controller runs no probes: every step is the shape it predicts to win, plain
    here, though trees would now accept a token per row and win (without the guard, probes find that out and trees
    run most steps). A changed draft (online learning) lets the probes run again."""
    from fastgrpo.speculative.guard import SavingsGuard

    def run(window: int) -> tuple[AdaptiveController, list[bool], int]:
        rows, controller = 8, adaptive(flat_profile(), guard=SavingsGuard(window=window))
        plain = controller.predicted_seconds(rows, AUTOREGRESSIVE)
        controller.observe(rows, AUTOREGRESSIVE, plain, None)
        tree = controller.groups[""][0]
        for step in range(6):
            assert controller.observe(rows, tree, 1.5 * plain, [0] * rows) == pytest.approx(-0.5 * plain)
            assert controller.guard.losing == (step >= window - 1)
        probed, trees = [], 0
        for step in range(600):
            if step == 300:
                controller.begin(draft_changed=True)
            best, shape = controller.best(rows), controller.choose(rows)
            probed.append(shape != best)
            trees += shape.speculative
            seconds = 1.5 * plain if shape.speculative else plain
            controller.observe(rows, shape, seconds, [1] * rows if shape.speculative else None)
        return controller, probed, trees

    with caplog.at_level("WARNING", logger="fastgrpo.speculative.guard"):
        guarded, probed, trees = run(window=4)
    assert caplog.text.count("speculation cost") == 1 and "without probes" in caplog.text
    assert not any(probed[:300]) and any(probed[300:]), "no probe while trees lost, until the draft changed"
    assert trees > 100 and not guarded.guard.losing, "trees that save time again run again"
    _, probed, unguarded_trees = run(window=10**9)
    assert any(probed[:300]) and unguarded_trees > 500


def test_a_call_logs_what_its_trees_saved(llama_model: PreTrainedModel) -> None:
    """``spec/time_saved`` adds up what the controller says each timed tree step saved."""
    savings: list[float] = []

    class Saving(StaticController):
        def observe(self, rows, shape, seconds, accepted, path_rank=None):
            saved = 0.0 if seconds is None else 0.001 * len(savings)
            savings.append(saved)
            return saved

    draft = DraftHead(llama_model.config).double()
    engine = RolloutEngine(
        llama_model, [EOS], drafter=EagleDrafter(draft, llama_model), controller=Saving(TreeShape(4, 3, 3))
    )
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8), num_generations=2)
    assert len(savings) > 1 and out.stats.metrics()["spec/time_saved"] == pytest.approx(sum(savings))


def test_a_losing_window_still_lets_overdue_probes_measure_trees_again() -> None:
    """While the savings guard holds, a kind of step not timed for ``reprobe_steps`` steps is still probed: trees that
    cost more than they saved are measured again, so a run whose draft never changes is not locked out for good."""
    from fastgrpo.speculative.guard import SavingsGuard

    rows, controller = 8, adaptive(flat_profile(), guard=SavingsGuard(window=4), reprobe_steps=100)
    plain = controller.predicted_seconds(rows, AUTOREGRESSIVE)
    controller.observe(rows, AUTOREGRESSIVE, plain, None)
    for _ in range(6):
        controller.observe(rows, controller.groups[""][0], 1.5 * plain, [0] * rows)
    assert controller.guard.losing
    chosen = []
    for _ in range(400):
        shape = controller.choose(rows)
        chosen.append(shape.speculative)
        controller.observe(
            rows, shape, 1.5 * plain if shape.speculative else plain, [1] * rows if shape.speculative else None
        )
    assert not any(chosen[:90]) and any(chosen[90:]), "the overdue trees ran again"


def test_the_controller_reads_the_depths_the_drafters_settled() -> None:
    """A compiled drafter groups its trees when the engine settles them and may then expand a small tree deeper
    (`Drafter.deepest`): the controller forgets the depths it looked up (`drafters_settled`) and prices the new ones."""

    class Deepening(ProfiledLevels):
        extra = 0

        def deepest(self, shape: TreeShape) -> int:
            return min(shape.levels + self.extra, shape.nodes - 1)

    drafter = Deepening(flat_profile())
    controller = AdaptiveController(flat_profile(), drafters={"": drafter})
    eight = next(s for s in controller.shapes if s.nodes == 8)
    before = controller.levels(eight)
    drafter.extra = 1
    assert controller.levels(eight) == before, "looked up once"
    controller.drafters_settled()
    assert controller.levels(eight) == before + 1 and controller.expected_tokens(eight) > 1
