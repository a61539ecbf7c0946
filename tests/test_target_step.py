"""The target's step and the draft's expansion compiled with ``torch.compile(fullgraph=True)``
(`fastgrpo.rollout.target_step`, `fastgrpo.speculative.eagle.drafter`): graphs without breaks, the eager step's
tokens, plain and speculative, greedy and sampled under the same uniforms, over padded rows and bucketed extents,
and the weights as training leaves them.

They compile with the ``eager`` backend, which runs Dynamo's capture of each function (the graphs, their breaks and
their symbolic sizes, as inductor receives them) as captured; AOT's trace of the same three functions is checked where
they compile with inductor itself (`test_tool_turns`, which follows the weights there) and with ``aot_eager`` under
flex attention (`test_fused_attention`)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import VOCAB, make_tiny_model
from test_speculative import trained_draft

from fastgrpo.rollout.compiled import Compiled, row_bucket
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.eagle.head import DraftHead

PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 60, 7], [1, 90]]  # 3 prompts x 2 generations: 6 rows, padded to 8
# The tree of every test that verifies one shape: a test meets the graphs an earlier one compiled for the same
# sampling setting and caches of the same size (Dynamo's cache is the module's) and compiles only what is new to it.
TREE = TreeShape(6, 3, 3)
MAX_NEW = 12
PARAMS = {
    "greedy": SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0),
    "top-p": SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.9, top_k=50),
}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch._dynamo.reset()
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def draft(model) -> DraftHead:
    """A draft the model's trees accept tokens of, so that acceptance walks past the root and moves cache slots."""
    return trained_draft(model, epochs=10)


def eos_midway(model) -> int:
    """A token the model emits greedily in some rows but not all, so that rows end at different steps."""
    completions = RolloutEngine(model, [VOCAB]).generate(PROMPTS, PARAMS["greedy"]).completion_ids
    seen = [set(c[1 : MAX_NEW // 2]) for c in completions]
    return min(t for t in set().union(*seen) if sum(t in s for s in seen) < len(seen))


def engines(model, draft, shape: TreeShape | None, backend: str) -> tuple[RolloutEngine, RolloutEngine]:
    """An eager and a compiled engine (its drafter compiled too) with the same draft (when ``shape`` asks for
    trees)."""
    eos = eos_midway(model)
    built = []
    for compile in (None, backend):
        drafter = EagleDrafter(draft, model, compile) if shape is not None else None
        built.append(RolloutEngine(model, [eos], drafter=drafter, tree=shape, backend=compile))
    return built[0], built[1]


def same_outputs(eager, compiled, params: SamplingParams, seed: int = 3, atol: float = 1e-9):
    """Both engines' outputs for the same uniforms; the compiled one's tokens must equal the eager one's, and their
    log-probabilities agree to ``atol``."""
    n = len(PROMPTS) * 2
    uniforms = torch.rand(n, MAX_NEW, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    a = eager.generate(PROMPTS, params, num_generations=2, uniforms=uniforms)
    b = compiled.generate(PROMPTS, params, num_generations=2, uniforms=uniforms)
    assert b.completion_ids == a.completion_ids
    assert b.finish_reasons == a.finish_reasons
    if atol <= 1e-9:  # the same arithmetic: the compiled draft proposed the eager draft's trees
        assert b.stats.depth_accepted == a.stats.depth_accepted
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(y), torch.tensor(x), rtol=0, atol=atol)
    return a, b


@pytest.mark.parametrize("sampling", PARAMS)
@pytest.mark.parametrize("shape", [None, TREE], ids=["plain", "tree"])
def test_the_compiled_step_is_one_graph_with_the_eager_tokens(
    model, draft, shape: TreeShape | None, sampling: str
) -> None:
    """``fullgraph=True`` raises at the first graph break; rows end on the way, so the batch moves from 6 rows padded
    to 8 to a smaller bucket."""
    eager, compiled = engines(model, draft, shape, "eager")
    a, b = same_outputs(eager, compiled, PARAMS[sampling])
    buckets = {row_bucket(rows) for rows in a.stats.concurrency}
    assert a.stats.concurrency[0] == 6 and len(buckets) > 1, "padded rows, and rows that ended on the way"
    assert b.stats.compile_time > 0 and a.stats.compile_time == 0
    assert b.stats.metrics()["compile/graphs"] > 0 and "compile/graphs" not in a.stats.metrics()
    if shape is not None:
        assert b.stats.depth_accepted[0] > 0, "trees were verified and draft tokens accepted"
    assert compiled.cache.max_rows == row_bucket(6) == 8


def test_the_compiled_steps_meet_other_tree_sizes_and_longer_contexts(model, draft) -> None:
    """One compiled target step verifies trees of two sizes and contexts past the first extent bucket (the compiler
    then treats those sizes as symbolic), with the eager engine's tokens (the drafters run eagerly here)."""
    params = PARAMS["top-p"]
    eos = eos_midway(model)
    eager, compiled = (
        RolloutEngine(model, [eos], drafter=EagleDrafter(draft, model), tree=TREE, backend=compile)
        for compile in (None, "eager")
    )
    same_outputs(eager, compiled, params)
    for engine in (eager, compiled):
        engine.speculate(list(engine.drafters.values()), tree=TreeShape(16, 4, 5))
    same_outputs(eager, compiled, params)
    long_prompts = [[(5 * i + 3) % VOCAB for i in range(300)], [7, 8, 9]]
    uniforms = torch.rand(4, MAX_NEW, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    a = eager.generate(long_prompts, params, num_generations=2, uniforms=uniforms)
    b = compiled.generate(long_prompts, params, num_generations=2, uniforms=uniforms)
    assert b.completion_ids == a.completion_ids and b.stats.depth_accepted == a.stats.depth_accepted


def test_a_function_past_its_graph_limit_runs_eagerly(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """``fullgraph=True`` turns torch's recompile limit into an error; a compiled function past it runs eagerly and
    says so once."""
    from fastgrpo.rollout import compiled as compiled_module

    monkeypatch.setattr(compiled_module, "RECOMPILE_LIMIT", 1)

    def double(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    fn, cpu = Compiled(double, "eager"), torch.device("cpu")
    assert torch.equal(fn(cpu, torch.ones(2)), torch.full((2,), 2.0)) and fn.seconds > 0
    with caplog.at_level(logging.WARNING, logger="fastgrpo.rollout.compiled"):
        assert torch.equal(fn(cpu, torch.ones(3, 3)), torch.full((3, 3), 2.0))  # a second graph would be needed
        assert torch.equal(fn(cpu, torch.ones(4, 3)), torch.full((4, 3), 2.0))
    assert caplog.text.count("run eagerly") == 1


def test_outputs_of_a_captured_graph_are_copied_whatever_holds_them() -> None:
    """On CUDA a captured graph's next replay overwrites its outputs: the step's tensors, alone, in a tuple or in a
    `DraftTree` (the draft's expansion returns one), are copied before the next graph runs."""
    from fastgrpo.rollout.compiled import map_tensors
    from fastgrpo.rollout.tree import DraftTree

    tree = DraftTree(*(torch.arange(6).view(2, 3) for _ in range(5)), levels=3)
    out = map_tensors(torch.clone, (tree, torch.ones(2)))
    assert isinstance(out[0], DraftTree) and out[0].levels == 3
    copies = [out[0].tokens, out[0].rank, out[1]]
    originals = [tree.tokens, tree.rank]
    assert all(a.data_ptr() != b.data_ptr() for a in copies[:2] for b in originals)
    assert torch.equal(out[0].ancestors, tree.ancestors) and torch.equal(out[1], torch.ones(2))


def test_the_eagle_expansion_compiles_for_bucketed_row_counts_only(model, draft, monkeypatch) -> None:
    """As rows finish (6 live rows, then fewer), the compiled expansion is only ever called with a power-of-two
    number of rows, at least 2, and the compiled engine's tokens are the eager one's."""
    seen: list[int] = []
    eager, compiled = engines(model, draft, TREE, "eager")
    expansion, call = compiled.drafters["eagle"]._step, Compiled.__call__

    def counted(self: Compiled, device: torch.device, *args):
        if self is expansion:  # the rows it is given (draft, embed, head, cache, then draft_len [B], ...)
            seen.append(args[4].shape[0])
        return call(self, device, *args)

    monkeypatch.setattr(Compiled, "__call__", counted)
    a, b = same_outputs(eager, compiled, PARAMS["greedy"])
    assert min(b.stats.concurrency) < max(b.stats.concurrency) == 6, "rows finished during the call"
    assert seen and set(seen) <= {2, 4, 8}, seen


def test_greedy_calls_and_other_temperatures_run_the_sampled_graphs(model, draft) -> None:
    """The temperature and greedy decoding are inputs of the compiled steps (`GraphSampling`), not constants: after a
    sampled call at T=1, a greedy call and one at T=0.6 compile no graph and meet no shape, settle nothing again,
    and give the eager engine's tokens, plain and with trees."""
    for shape in (None, TREE):
        eager, compiled = engines(model, draft, shape, "eager")
        same_outputs(eager, compiled, SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0))
        settled = set(compiled.settled)
        for params in (PARAMS["greedy"], SamplingParams(max_new_tokens=MAX_NEW, temperature=0.6)):
            _, out = same_outputs(eager, compiled, params)
            assert out.stats.compile_graphs == 0 and out.stats.compile_shapes == 0, params
        assert compiled.settled == settled
