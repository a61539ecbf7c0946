"""Speculative rollouts are lossless, whoever drafts (the EAGLE head, the suffix drafter, or both merged): greedy
output equals autoregressive output token for token, sampled output has the autoregressive distribution (and is the
very output of autoregressive sampling under the same uniforms), and the emitted log-probs are the target's."""

from __future__ import annotations

import copy
import math
import random
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from fastgrpo.config import DraftTrainConfig
from fastgrpo.rollout import target_step as target_step_module
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.sampling import process_logits, sample
from fastgrpo.rollout.scheduling import AUTOREGRESSIVE, StaticController
from fastgrpo.rollout.tree import DraftTree, TreeShape
from fastgrpo.rollout.verify import Acceptance
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.eagle.training import DraftSample, DraftTrainer, rollout_samples
from fastgrpo.speculative.suffix.drafter import SuffixDrafter

EOS = 3
COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=EOS,
    pad_token_id=0,
    attn_implementation="sdpa",
)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [4]]
SHAPES = [TreeShape(1, 1, 1), TreeShape(4, 2, 2), TreeShape(8, 3, 4), TreeShape(16, 4, 5)]
DRAFTERS = ["eagle", "suffix", "eagle+suffix"]


def speculative_engine(model: PreTrainedModel, eos: list[int], drafter: str, draft: DraftHead, shape: TreeShape):
    """An engine drafting every tree of ``shape`` with ``drafter`` (fresh drafters; ``eagle`` with ``draft``)."""
    names = drafter.split("+")
    drafters = [EagleDrafter(draft, model) if name == "eagle" else SuffixDrafter() for name in names]
    return RolloutEngine(model, eos, drafter=drafters, tree=replace(shape, drafter=drafter))


def tiny_model(family: str, seed: int = 0, sharpen: float = 1.0) -> PreTrainedModel:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **extra)).double().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    return model


def trained_draft(model: PreTrainedModel, epochs: int = 30, seed: int = 0) -> DraftHead:
    """A draft fitted for a few seconds on the model's own greedy and sampled continuations of random prompts."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    draft = DraftHead(model.config, "tiny").double()
    prompts = [[rng.randrange(4, 96) for _ in range(rng.randrange(2, 8))] for _ in range(48)]
    engine = RolloutEngine(model, [EOS])
    samples = []
    for temperature in (0.0, 1.0):
        out = engine.generate(prompts, SamplingParams(max_new_tokens=40, temperature=temperature), capture_hidden=True)
        samples += rollout_samples(prompts, out, num_generations=1)
    config = DraftTrainConfig(learning_rate=3e-3, epochs=epochs, token_budget=512, token_loss_weight=1.0)
    DraftTrainer(draft, model.get_input_embeddings(), model.get_output_embeddings(), config).fit(samples)
    return draft


def short_samples(model: PreTrainedModel, temperature: float = 1.0) -> list[DraftSample]:
    """Draft samples of the model's continuations (24 tokens at most) of three short prompts."""
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    params = SamplingParams(max_new_tokens=24, temperature=temperature)
    out = RolloutEngine(model, [EOS]).generate(prompts, params, capture_hidden=True)
    return rollout_samples(prompts, out, num_generations=1)


def test_draft_training_under_bfloat16_autocast_on_a_float32_model() -> None:
    """The benchmarks train drafts under bfloat16 autocast on a float32 target, whose LM head then runs outside
    autograd on the rollout linear layers' path (`tests/test_linear.py` checks that path against autocast)."""
    torch.manual_seed(0)
    model = make_tiny_model("llama").float()
    samples = short_samples(model)
    config = DraftTrainConfig(learning_rate=3e-3, epochs=10, token_budget=512, token_loss_weight=1.0, bf16=True)
    losses = (
        DraftTrainer(DraftHead(model.config), model.get_input_embeddings(), model.get_output_embeddings(), config)
        .fit(samples)
        .losses
    )
    assert losses[-1] < losses[0]


def test_draft_accuracy_is_measured_before_the_draft_trains_on_the_samples() -> None:
    """`DraftFit.accuracy` counts the first epoch's forwards only, each before its update: with one batch, 1 and 40
    epochs from the same initial draft report the same accuracy, that of the untrained draft; after training, a new
    call on the same samples reports a higher one."""
    torch.manual_seed(0)
    model = make_tiny_model("llama").double()
    samples = short_samples(model, temperature=0.0)
    initial = DraftHead(model.config).double()
    fits = {}
    for epochs in (1, 40):
        config = DraftTrainConfig(learning_rate=3e-3, epochs=epochs, token_budget=512, token_loss_weight=1.0)
        trainer = DraftTrainer(
            copy.deepcopy(initial), model.get_input_embeddings(), model.get_output_embeddings(), config
        )
        fits[epochs] = trainer.fit(samples)
    assert len(fits[40].losses) == 40 * len(fits[1].losses)
    assert 0.0 <= fits[1].accuracy == fits[40].accuracy < 0.5
    assert trainer.fit(samples).accuracy > fits[40].accuracy + 0.2


def test_draft_learning_rate_schedule_spans_one_fit() -> None:
    """A linear schedule falls from the configured rate to zero over one `fit` call, which takes no step at zero
    (its last update still moves the draft), and the next call starts again from the full rate; a constant one keeps
    the rate."""
    torch.manual_seed(0)
    model = make_tiny_model("llama").double()
    samples = short_samples(model)
    rates = {}
    for kind in ("constant", "linear"):
        config = DraftTrainConfig(learning_rate=1e-3, epochs=4, token_budget=32, lr_scheduler_type=kind)
        draft = DraftHead(model.config).double()
        trainer = DraftTrainer(draft, model.get_input_embeddings(), model.get_output_embeddings(), config)
        used = []
        trainer.optimizer.register_step_pre_hook(lambda opt, *_, used=used: used.append(opt.param_groups[0]["lr"]))
        fit = trainer.fit(samples)
        first = len(used)
        trainer.fit(samples)
        rates[kind] = used, first, len(fit.losses)
    constant, _, _ = rates["constant"]
    assert constant == [1e-3] * len(constant)
    linear, first, updates = rates["linear"]
    assert first == updates > 4
    assert linear[0] == pytest.approx(1e-3) and linear[first] == pytest.approx(1e-3)
    assert all(a > b > 0 for a, b in zip(linear[: first - 1], linear[1:first], strict=True))
    assert linear[first - 1] == pytest.approx(1e-3 / first)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_unrolled_training_predicts_as_the_draft_drafts_deeper_levels(family: str) -> None:
    """Unroll step ``s`` of training (EAGLE-3's training-time test) must compute, at every row, what the draft
    computes for a depth-``s + 1`` tree node: true features up to ``s`` rows back, then the draft's own predictions.
    Checked against plain causal forwards that feed the draft its predictions one at a time."""
    torch.manual_seed(0)
    model = tiny_model(family)
    draft = DraftHead(model.config).double()
    config = DraftTrainConfig(unroll=3)
    trainer = DraftTrainer(draft, model.get_input_embeddings(), model.get_output_embeddings(), config)
    t, hidden = 9, model.config.hidden_size
    embeds = model.get_input_embeddings()(torch.randint(0, model.config.vocab_size, (2, t)))
    hid = torch.randn(2, t, hidden, dtype=torch.float64)
    positions = torch.arange(1, t + 1).expand(2, t)
    with torch.no_grad():
        preds = trainer.unrolled_predictions(embeds, hid, positions)
        for step in range(3):
            for row in range(step, t):
                features = hid[:, : row - step + 1]
                for _ in range(step + 1):
                    n = features.shape[1]
                    out = draft(embeds[:, :n], features, position_ids=positions[:, :n])[:, -1:]
                    features = torch.cat([features, out], dim=1)
                torch.testing.assert_close(preds[step][:, row], out[:, 0], rtol=1e-10, atol=1e-10)


def test_unrolled_training_lowers_its_loss() -> None:
    model = tiny_model("llama")
    torch.manual_seed(0)
    samples = short_samples(model)
    config = DraftTrainConfig(learning_rate=3e-3, epochs=30, token_budget=512, token_loss_weight=1.0, unroll=2)
    losses = (
        DraftTrainer(
            DraftHead(model.config).double(), model.get_input_embeddings(), model.get_output_embeddings(), config
        )
        .fit(samples)
        .losses
    )
    assert losses[-1] < losses[0] - 0.5


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_and_drafts(request: pytest.FixtureRequest) -> tuple[PreTrainedModel, dict[str, DraftHead]]:
    model = tiny_model(request.param)
    torch.manual_seed(1)
    return model, {"random": DraftHead(model.config).double(), "trained": trained_draft(model)}


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("draft_kind", ["random", "trained"])
def test_greedy_equals_autoregressive(model_and_drafts, shape: TreeShape, draft_kind: str, drafter: str) -> None:
    """Twice: the second call's suffix drafter also drafts from the first call's completions."""
    model, drafts = model_and_drafts
    params = SamplingParams(max_new_tokens=30, temperature=0)
    reference = RolloutEngine(model, [EOS]).generate(PROMPTS, params)
    engine = speculative_engine(model, [EOS], drafter, drafts[draft_kind], shape)
    for _ in range(2):
        out = engine.generate(PROMPTS, params, 2)
        for i, expected in enumerate(reference.completion_ids):
            assert out.completion_ids[2 * i] == expected
            assert out.completion_ids[2 * i + 1] == expected
        assert out.finish_reasons[::2] == reference.finish_reasons
    eagle_nodes = min(shape.nodes, 1 + shape.top_k + (shape.max_levels - 1) * shape.top_k**2)
    assert out.stats.n_verify_mean == (eagle_nodes if drafter == "eagle" else shape.nodes)
    if shape.speculative and "eagle" in drafter:
        assert out.stats.draft_forwards == out.stats.target_forwards * shape.max_levels
    else:
        assert out.stats.draft_forwards == 0
    if (draft_kind == "trained" or "suffix" in drafter) and shape.nodes >= 8:
        assert out.stats.accept_length > 1.5, "a trained draft, or earlier completions, should be accepted often"
        assert out.stats.target_forwards < reference.stats.target_forwards


@dataclass
class AlternatingController(StaticController):
    """A tree at every other step, a plain step in between; records the shape of every step."""

    chosen: list[TreeShape] = field(default_factory=list)

    def choose(self, rows: int, backlog: int = 0) -> TreeShape:
        self.chosen.append(self.shape if len(self.chosen) % 2 else AUTOREGRESSIVE)
        return self.chosen[-1]


def test_tree_accept_length_counts_tree_steps_only(model_and_drafts) -> None:
    """`accept_length` averages over all decoding steps, plain ones included; `tree_accept_length` over tree steps."""
    model, drafts = model_and_drafts
    params = SamplingParams(max_new_tokens=30, temperature=0)
    plain = RolloutEngine(model, [EOS]).generate(PROMPTS, params)
    assert math.isnan(plain.stats.tree_accept_length)
    controller = AlternatingController(SHAPES[2])
    out = RolloutEngine(model, [EOS], drafter=EagleDrafter(drafts["trained"], model), controller=controller).generate(
        PROMPTS, params
    )
    assert out.completion_ids == plain.completion_ids
    s = out.stats
    trees = [i for i, shape in enumerate(controller.chosen) if shape.speculative]
    emitted = sum(s.tokens_per_forward[i] for i in trees) / sum(s.concurrency[i] for i in trees)
    # A row that ends (EOS, length limit) inside an accepted path emits less than it accepted, never more.
    assert emitted - 1e-9 <= s.tree_accept_length <= emitted + 0.2
    assert s.tree_accept_length > 1.5, "a trained draft should be accepted often"
    assert s.accept_length < s.tree_accept_length - 0.2, "plain steps pull the all-steps average down"


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
def test_sampled_output_equals_autoregressive_for_the_same_seed(
    model_and_drafts, shape: TreeShape, drafter: str
) -> None:
    """Each position's token is drawn with that position's own uniform, so the trees drafted do not change what is
    sampled: not only the distribution but the very tokens are those of autoregressive sampling (the suffix drafter
    drafting from an earlier call's completions too)."""
    model, drafts = model_and_drafts
    params = SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.9)
    reference = RolloutEngine(model, [EOS]).generate(PROMPTS, params, 2, generator=torch.Generator().manual_seed(4))
    engine = speculative_engine(model, [EOS], drafter, drafts["trained"], shape)
    engine.generate(PROMPTS, params, 2, generator=torch.Generator().manual_seed(5))
    out = engine.generate(PROMPTS, params, 2, generator=torch.Generator().manual_seed(4))
    assert out.completion_ids == reference.completion_ids
    assert out.stats.accept_length > 1.0
    for a, b in zip(out.logprobs, reference.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))


def test_emitted_logprobs_equal_a_fresh_forward(model_and_drafts) -> None:
    model, drafts = model_and_drafts
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, top_k=30)
    engine = RolloutEngine(model, [EOS], drafter=EagleDrafter(drafts["trained"], model), tree=TreeShape(8, 3, 4))
    out = engine.generate(PROMPTS, params, 2, generator=torch.Generator().manual_seed(0))
    for i, (completion, logprobs) in enumerate(zip(out.completion_ids, out.logprobs, strict=True)):
        prompt = PROMPTS[i // 2]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        # under the distribution at the sampling temperature, before top-k and top-p, as the trainer scores them
        expected = torch.log_softmax(logits / params.temperature, -1).gather(1, torch.tensor(completion)[:, None])
        torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), expected.squeeze(1), atol=1e-8, rtol=0)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_eos_and_length_limit_inside_an_accepted_path(model_and_drafts, drafter: str) -> None:
    """Rows end exactly where autoregressive decoding ends them, even when a longer path was accepted."""
    model, drafts = model_and_drafts
    greedy = RolloutEngine(model, [EOS]).generate(PROMPTS, SamplingParams(max_new_tokens=30, temperature=0))
    # Make a token from the middle of a completion an end-of-sequence token.
    eos = greedy.completion_ids[0][6]
    for max_new in (5, 30):
        params = SamplingParams(max_new_tokens=max_new, temperature=0)
        reference = RolloutEngine(model, [EOS, eos]).generate(PROMPTS, params)
        engine = speculative_engine(model, [EOS, eos], drafter, drafts["trained"], TreeShape(16, 4, 5))
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=30, temperature=0))  # the suffix drafter's memory
        out = engine.generate(PROMPTS, params)
        assert out.completion_ids == reference.completion_ids
        assert out.finish_reasons == reference.finish_reasons
        assert all(len(c) <= max_new for c in out.completion_ids)
        assert out.stats.tokens_emitted == sum(map(len, out.completion_ids))


def test_draft_save_and_load_reproduces_outputs(model_and_drafts, tmp_path: Path) -> None:
    model, drafts = model_and_drafts
    draft = drafts["trained"]
    draft.save(tmp_path)
    loaded = DraftHead.load(tmp_path, model)
    x = torch.randn(2, 5, model.config.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(loaded(x, x), draft(x, x), atol=0, rtol=0)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    outs = [
        RolloutEngine(model, [EOS], drafter=EagleDrafter(d, model), tree=TreeShape(8, 3, 4)).generate(
            PROMPTS, params, generator=torch.Generator().manual_seed(3)
        )
        for d in (draft, loaded)
    ]
    assert outs[0].completion_ids == outs[1].completion_ids
    assert outs[0].stats.accept_length == outs[1].stats.accept_length


def test_a_draft_for_another_target_is_refused(tmp_path: Path) -> None:
    llama = tiny_model("llama")
    DraftHead(llama.config, "tiny-llama").save(tmp_path)
    with pytest.raises(ValueError, match="made for target tiny-llama"):
        DraftHead.load(tmp_path, tiny_model("qwen3"))
    with pytest.raises(FileNotFoundError, match="not a saved draft"):
        DraftHead.load(tmp_path / "absent", llama)


# -- the sampling distribution ---------------------------------------------------------------------------------------


def chi_square_p_value(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """p-value of a chi-square test that two samples of categories come from one distribution (rare bins pooled)."""
    n_a, n_b = sum(a.values()), sum(b.values())
    cells = []
    pooled = [0, 0]
    for key in set(a) | set(b):
        total = a[key] + b[key]
        if total * min(n_a, n_b) / (n_a + n_b) < min_expected:
            pooled[0] += a[key]
            pooled[1] += b[key]
        else:
            cells.append((a[key], b[key]))
    if sum(pooled):
        cells.append(tuple(pooled))
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (observed - expected) ** 2 / expected
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def stale_accept(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, uniforms=None) -> Acceptance:
    """A deliberately wrong rule with an off-by-one: after moving to a child, the next token is drawn from the
    parent's distribution instead of the child's."""
    logprobs = process_logits(logits, params)
    b = logprobs.shape[0]
    rows = torch.arange(b)
    node = torch.zeros(b, dtype=torch.long)
    previous = node.clone()
    active = torch.ones(b, dtype=torch.bool)
    path, tokens, lps = [], [], []
    for step in range(int(tree.node_depth.max()) + 1):
        here = logprobs[rows, previous]
        y = sample(here, params, uniforms[:, step])
        path.append(torch.where(active, node, -1))
        tokens.append(y)
        lps.append(here.gather(1, y[:, None]).squeeze(1))
        is_child = (tree.parent == node[:, None]) & (tree.tokens == y[:, None])
        active = active & is_child.any(dim=1)
        if not active.any():
            break
        previous = node
        node = torch.where(active, is_child.int().argmax(dim=1), node)
    path_t = torch.stack(path, 1)
    return Acceptance(path_t, torch.stack(tokens, 1), torch.stack(lps, 1), (path_t >= 0).sum(dim=1))


@pytest.fixture(scope="module")
def peaked_model_and_draft() -> tuple[PreTrainedModel, DraftHead]:
    """A bigram-like target (attention and MLP outputs zeroed, so logits depend on the current token only) with
    sharpened logits (a few plausible tokens per step), and a draft that predicts it well."""
    model = tiny_model("llama", seed=2, sharpen=60.0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model, trained_draft(model, epochs=20, seed=2)


def first_tokens(
    model, draft, params: SamplingParams, draws: int, seed: int, drafter: str = "eagle"
) -> tuple[Counter, float]:
    """Completions of one prompt; speculative with ``draft``, after a call of another seed (the suffix drafter's
    memory)."""
    prompt = [[7, 21, 40]]
    if draft is None:
        engine = RolloutEngine(model, [EOS])
    else:
        engine = speculative_engine(model, [EOS], drafter, draft, TreeShape(12, 3, 4))
        engine.generate(prompt, params, draws, generator=torch.Generator().manual_seed(seed + 1000))
    out = engine.generate(prompt, params, draws, generator=torch.Generator().manual_seed(seed))
    return Counter(tuple(c) for c in out.completion_ids), out.stats.accept_length


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_speculative_sampling_has_the_autoregressive_distribution(peaked_model_and_draft, monkeypatch, drafter) -> None:
    model, draft = peaked_model_and_draft
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=0.9)
    reference, _ = first_tokens(model, None, params, 3000, seed=10)
    speculative, accept_length = first_tokens(model, draft, params, 3000, seed=11, drafter=drafter)
    assert accept_length > 1.5, "the test needs accepted paths to exercise the acceptance rule"
    assert chi_square_p_value(reference, speculative) > 1e-3

    # The same test catches an off-by-one in the acceptance rule.
    monkeypatch.setattr(target_step_module, "accept", stale_accept)
    wrong, _ = first_tokens(model, draft, params, 3000, seed=11, drafter=drafter)
    assert chi_square_p_value(reference, wrong) < 1e-6


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9)],
    ids=["greedy", "sampled top-p"],
)
def test_drawing_every_node_at_once_walks_as_drawing_step_by_step(
    params: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`accept` draws every node's token before the walk where reading the device back is not free (a GPU, a
    compiled step), and at the node each row stands on, step by step, elsewhere: both walks emit the same tokens
    and log-probabilities down the same paths, over rows that stop at every depth, with a walk deeper than the
    trees (the wider result's extra columns are empty)."""
    from fastgrpo.rollout import sampling
    from fastgrpo.rollout.tree import ancestor_mask
    from fastgrpo.rollout.verify import accept

    gen = torch.Generator().manual_seed(3)
    rows, vocab = 64, 12
    parent = torch.tensor([-1, 0, 1, 2, 0, 1, 2]).expand(rows, 7)  # a chain 0-1-2-3 with a branch off 0, 1 and 2
    logits = 4 * torch.randn(rows, 7, vocab, dtype=torch.float64, generator=gen)
    best = logits.argmax(dim=-1)  # each node's greedy token
    tokens = torch.randint(vocab, (rows, 7), generator=gen)
    follows = torch.rand(rows, 7, generator=gen) < 0.7  # most children are what their parent's draw would be
    tokens = torch.where(follows, best.gather(1, parent.clamp(min=0)), tokens)
    depth = torch.tensor([0, 1, 2, 3, 1, 2, 3]).expand(rows, 7)
    tree = DraftTree(tokens, parent, depth, ancestor_mask(parent, 3), torch.arange(7).expand(rows, 7), levels=5)
    uniforms = None if params.greedy else torch.rand(rows, 6, dtype=torch.float64, generator=gen)
    stepwise = accept(tree, logits, params, uniforms)
    monkeypatch.setattr(sampling, "host_reads_are_free", lambda t: False)
    at_once = accept(tree, logits, params, uniforms)
    width = stepwise.path.shape[1]
    assert at_once.path.shape[1] == 6 and sorted(set(stepwise.length.tolist())) == [1, 2, 3, 4]
    assert torch.equal(at_once.length, stepwise.length) and torch.equal(at_once.path[:, :width], stepwise.path)
    assert torch.equal(at_once.tokens[:, :width], stepwise.tokens)
    torch.testing.assert_close(at_once.logprobs[:, :width], stepwise.logprobs, rtol=0, atol=1e-12)
    assert bool((at_once.path[:, width:] == -1).all()) and not at_once.tokens[:, width:].any()
