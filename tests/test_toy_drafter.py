"""A drafter added in one file: `PromptTailDrafter` proposes, after each row's pending token, what followed that token's
last occurrence in the row's prompt. Registered under the name ``toy``, it runs through the engine (lossless), the
adaptive controller (which prices it by its own cost and reports its share) and a GRPO training step, with no other
module touched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import save_tiny_llama
from test_speculative import EOS, PROMPTS, tiny_model

from fastgrpo.config import SpeculationConfig
from fastgrpo.rollout.drafter import Drafter, Emitted, Prefill, Proposal
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.host import host_to_device
from fastgrpo.rollout.sequence import ActiveRows
from fastgrpo.rollout.tree import DraftTree, TreeShape, ancestor_mask
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative import registry
from fastgrpo.speculative.controller import AdaptiveController
from fastgrpo.speculative.plugin import DrafterContext, DrafterPlugin
from fastgrpo.speculative.profiler import LatencyProfile, profile_path


class PromptTailDrafter(Drafter):
    """Chains of ``N - 1`` tokens: what followed the pending token's last occurrence in the prompt, then the prompt's
    first tokens again (a row whose token is not in its prompt gets the prompt's last tokens)."""

    name = "toy"

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def start(self, prefill: Prefill) -> None:
        self.prompts = [prefill.prompts[p] for p in prefill.row_prompt]

    def deepest(self, shape: TreeShape) -> int:
        return shape.nodes - 1

    def cost(self, rows: int, shape: TreeShape, backlog: int = 1) -> float:
        return 1e-6 * rows

    def propose(self, rows: ActiveRows, shape: TreeShape) -> Proposal:
        n = shape.nodes
        tokens = []
        for seq, prompt in zip(rows.seqs, self.prompts, strict=True):
            pending = seq.completion_ids[-1]
            after = len(prompt) - 1 - prompt[::-1].index(pending) + 1 if pending in prompt else len(prompt) - n + 1
            chain = (prompt * n)[max(after, 0) :][: n - 1]
            tokens += [pending] + chain + [0] * (n - 1 - len(chain))
        dev = rows.pending.device
        b = rows.size
        ids = host_to_device(tokens, dev).view(b, n)
        steps = torch.arange(n, device=dev).expand(b, n)
        parent = steps - 1
        score = -steps.double()
        return Proposal(DraftTree(ids, parent, steps, ancestor_mask(parent, n - 1), steps, n - 1, score), 0)

    def accepted(self, rows: ActiveRows, emitted: Emitted) -> None:
        pass

    def select(self, order: list[int], index: torch.Tensor) -> None:
        self.prompts = [self.prompts[i] for i in order]


class ToyPlugin(DrafterPlugin):
    name = "toy"

    def build(self, ctx: DrafterContext, saved: Path | None = None) -> Drafter:
        return PromptTailDrafter()


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.PLUGINS, "toy", ToyPlugin())


def flat_profile(name: str) -> LatencyProfile:
    """Forwards of up to 256 tokens all cost the same: trees look cheap, so the controller's first choice is one."""
    tokens = [1, 4, 16, 64, 256]
    return LatencyProfile(name, "cpu", "float32", 64, tokens, [0.01] * 5, 256, {"eagle": [0.0001] * 5})


def test_the_toy_drafter_is_lossless_in_the_engine_and_accepted_on_repetitive_prompts() -> None:
    model = tiny_model("llama")
    params = SamplingParams(max_new_tokens=30, temperature=0)
    prompts = PROMPTS + [[9, 10, 11] * 4]
    reference = RolloutEngine(model, [EOS]).generate(prompts, params, 2)
    engine = RolloutEngine(model, [EOS], drafter=PromptTailDrafter(), tree=TreeShape(6, 1, 5))
    out = engine.generate(prompts, params, 2)
    assert out.completion_ids == reference.completion_ids
    assert out.stats.metrics()["spec/drafter/toy/share"] == 1.0

    sampled = SamplingParams(max_new_tokens=30, temperature=1.0)
    reference = RolloutEngine(model, [EOS]).generate(prompts, sampled, 2, generator=torch.Generator().manual_seed(0))
    out = engine.generate(prompts, sampled, 2, generator=torch.Generator().manual_seed(0))
    assert out.completion_ids == reference.completion_ids


def test_the_adaptive_controller_prices_and_reports_the_toy_drafter() -> None:
    model = tiny_model("llama")
    toy = PromptTailDrafter()
    controller = AdaptiveController(flat_profile("tiny"), drafters={"toy": toy})
    assert {s.drafter for s in controller.shapes if s.speculative} == {"toy"}
    assert controller.draft_seconds(8, controller.groups["toy"][0]) == pytest.approx(8e-6)
    params = SamplingParams(max_new_tokens=30, temperature=0)
    reference = RolloutEngine(model, [EOS]).generate(PROMPTS, params, 2)
    out = RolloutEngine(model, [EOS], drafter=[toy], controller=controller).generate(PROMPTS, params, 2)
    assert out.completion_ids == reference.completion_ids
    assert out.stats.metrics()["spec/drafter/toy/share"] > 0


def test_a_grpo_step_drafts_with_the_registered_toy_drafter(
    toy_registered: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_trainer import make_config, make_trainer

    model_dir = save_tiny_llama(tmp_path / "model", seed=0, tie_word_embeddings=True)
    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path / "cache"))
    flat_profile(str(model_dir)).save(profile_path(str(model_dir), torch.device("cpu"), torch.float32))
    spec = SpeculationConfig(mode="adaptive", drafter="toy")
    trainer = make_trainer(make_config(model_dir, tmp_path / "run", speculation=spec, max_steps=1))
    assert [d.name for d in trainer.rollouts.drafters] == ["toy"]
    (metrics,) = trainer.train()
    assert metrics["spec/drafter/toy/share"] > 0
    assert metrics["spec/n_verify_mean"] > 1


def test_an_unknown_drafter_is_refused_naming_the_option(tmp_path: Path) -> None:
    from test_trainer import make_config, make_trainer

    for bad in ("toy", "eagle+eagle"):
        with pytest.raises(ValueError, match="speculation.drafter must be one of"):
            registry.drafter_names(bad)
    with pytest.raises(ValueError, match="speculation.drafter must name drafters"):
        SpeculationConfig(drafter="eagle+").validate()
    model_dir = save_tiny_llama(tmp_path / "model", seed=0, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="speculation.drafter must be one of"):
        make_trainer(make_config(model_dir, tmp_path / "run", speculation=SpeculationConfig(drafter="toy")))
