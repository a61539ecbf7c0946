"""A second neural drafter added in one file: `MLPDrafter` proposes a chain with Medusa-style heads, small MLPs over
the hidden state that drew each row's pending token, read out by the target's own LM head, and `MLPLearner` trains
them online on the hidden states the rollouts capture. Registered under the name ``mlp`` by its `MLPPlugin`, it runs
through the engine (lossless, greedy and sampled), the adaptive controller (priced from its timing in the latency
profile), a GRPO run, its checkpoint and a resume, with no other module touched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import save_tiny_llama
from safetensors.torch import load_file, save_file
from test_speculative import EOS, PROMPTS, tiny_model
from test_trainer import make_config, make_trainer
from torch import nn
from transformers import PreTrainedModel

from fastgrpo.config import DraftTrainConfig, SpeculationConfig
from fastgrpo.memory.items import MemoryItem, MemoryItems
from fastgrpo.memory_plan.plan import estimate_memory
from fastgrpo.rollout.drafter import Drafter, Emitted, Prefill, Proposal, Rollout
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.sequence import ActiveRows
from fastgrpo.rollout.tree import DraftTree, TreeShape, ancestor_mask
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative import registry
from fastgrpo.speculative.controller import AdaptiveController
from fastgrpo.speculative.merged import priced
from fastgrpo.speculative.plugin import DrafterContext, DrafterPlugin, PlannedRun, cost_probes
from fastgrpo.speculative.profiler import CostProbe, LatencyProfile, load_or_calibrate

NAME = "mlp"
HEADS = 3  # head k predicts the token k + 1 places after the pending one
WEIGHTS = "mlp_heads.safetensors"


class MLPHeads(nn.Module):
    """``[..., H] -> [..., HEADS, H]``: per head, the hidden state plus an MLP of it (zero at the start, so that every
    head first predicts what the LM head reads from the state itself)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden)) for _ in range(HEADS)
        )
        for mlp in self.mlps:
            nn.init.zeros_(mlp[2].weight)
            nn.init.zeros_(mlp[2].bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([hidden + mlp(hidden) for mlp in self.mlps], dim=-2)


class MLPLearner:
    """Trains the heads on the rollouts' captured hidden states: ``h_j`` (which drew token ``j + 1``) and head ``k``
    predict token ``j + 2 + k``, by cross-entropy through the target's frozen LM head."""

    captures_hidden = True

    def __init__(self, heads: MLPHeads, lm_head: nn.Module):
        self.heads, self.lm_head = heads, lm_head
        self.optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-2)

    def learn(self, rollouts: list[Rollout]) -> dict[str, float]:
        losses = []
        with torch.enable_grad():
            for r in rollouts:
                rows = zip(r.output.completion_ids, r.output.hidden_states, strict=True)
                for i, (completion, hidden) in enumerate(rows):
                    prompt = r.prompt_ids[i // r.num_generations]
                    tokens = torch.tensor(prompt + completion, device=hidden.device)
                    loss = self._loss(hidden.clone(), tokens, len(prompt))  # a copy: captured in inference mode
                    if loss is None:
                        continue
                    self.optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    self.optimizer.step()
                    losses.append(float(loss.detach()))
        return {"mlp/loss": sum(losses) / len(losses)} if losses else {}

    def _loss(self, hidden: torch.Tensor, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor | None:
        """``hidden`` ``[T, H]`` of the ``[T + 1]`` ``tokens``; completion positions only."""
        start = max(prompt_len - 1, 0)
        terms = []
        for k in range(HEADS):
            count = tokens.numel() - (start + 2 + k)
            if count <= 0:
                continue
            out = self.heads(hidden[start : start + count])[:, k]
            logits = F.linear(out, self.lm_head.weight.detach()).float()
            terms.append(F.cross_entropy(logits, tokens[start + 2 + k : start + 2 + k + count]))
        return sum(terms) / len(terms) if terms else None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class MLPDrafter(Drafter):
    """A chain per row: each head's most likely token after the pending one, scored by cumulative log-probability."""

    name = NAME

    def __init__(self, heads: MLPHeads, model: PreTrainedModel, profile: LatencyProfile | None, learner=None):
        self.heads, self.model, self.profile, self.learner = heads, model, profile, learner
        self.modules = (heads,)
        self.last: torch.Tensor | None = None  # [B, H] the hidden state that drew each row's pending token

    def start(self, prefill: Prefill) -> None:
        self.last = prefill.first_hidden

    def accepted(self, rows: ActiveRows, emitted: Emitted) -> None:
        index = torch.arange(emitted.hidden.shape[0], device=emitted.hidden.device)
        self.last = emitted.hidden[index, emitted.count - 1]

    def select(self, order: list[int], index: torch.Tensor) -> None:
        self.last = self.last[index]

    def deepest(self, shape: TreeShape) -> int:
        return min(shape.nodes - 1, HEADS)

    def cost(self, rows: int, shape: TreeShape, backlog: int = 1) -> float:
        return 0.0 if self.profile is None else self.profile.drafter_time(NAME, rows)

    def propose(self, rows: ActiveRows, shape: TreeShape) -> Proposal:
        n, depth = shape.nodes, self.deepest(shape)
        b, dev = rows.size, rows.pending.device
        out = self.heads(self.last.to(self.model.dtype))[:, :depth]  # [B, D, H]
        logp = torch.log_softmax(self.model.get_output_embeddings()(out).double(), dim=-1)
        best, chain = logp.max(dim=-1)  # [B, D]
        pad = n - 1 - depth
        tokens = torch.cat([rows.pending[:, None], chain, chain.new_zeros(b, pad)], 1)
        steps = torch.arange(n, device=dev)
        parent = torch.where(steps <= depth, steps - 1, 0).expand(b, n)
        node_depth = torch.where(steps <= depth, steps, 1).expand(b, n)
        score = torch.cat([best.new_zeros(b, 1), best.cumsum(1), best.new_full((b, pad), -torch.inf)], 1)
        rank = steps.expand(b, n)
        return Proposal(DraftTree(tokens, parent, node_depth, ancestor_mask(parent, depth), rank, depth, score), 1)


class MLPPlugin(DrafterPlugin):
    name = NAME
    captures_hidden = True

    def saved_in(self, directory: Path) -> bool:
        return (directory / WEIGHTS).is_file()

    def _heads(self, model: PreTrainedModel, seed: int, saved: Path | None) -> MLPHeads:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            heads = MLPHeads(model.config.hidden_size)
        if saved is not None and self.saved_in(saved):
            heads.load_state_dict(load_file(str(saved / WEIGHTS)))
        param = next(model.parameters())
        return heads.to(device=param.device, dtype=param.dtype)

    def build(self, ctx: DrafterContext, saved: Path | None = None) -> Drafter:
        heads = self._heads(ctx.model, ctx.seed, saved)
        learner = MLPLearner(heads, ctx.model.get_output_embeddings()) if ctx.draft_training.online else None
        return MLPDrafter(heads, ctx.model, ctx.profile, learner)

    def save(self, drafter: Drafter, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous().cpu() for k, v in drafter.heads.state_dict().items()}, str(directory / WEIGHTS))

    def cost_probe(
        self,
        model: PreTrainedModel,
        tokens: tuple[int, ...],
        context_length: int,
        compile: str | None,
        saved: Path | None = None,
    ) -> CostProbe:
        heads, head = self._heads(model, 0, saved), model.get_output_embeddings()
        param = next(model.parameters())
        states = [torch.zeros(t, model.config.hidden_size, dtype=param.dtype, device=param.device) for t in tokens]
        return CostProbe([lambda h=h: head(heads(h)) for h in states], (heads,))

    def memory(self, run: PlannedRun) -> list[MemoryItem]:
        items = MemoryItems()
        h = run.shape.hidden_size
        items.resident("mlp heads", HEADS * (2 * h * h + 2 * h) * run.dtype_bytes)
        return items.items


@pytest.fixture
def mlp_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.PLUGINS, NAME, MLPPlugin())


def mlp_drafter(model: PreTrainedModel, profile: LatencyProfile | None = None) -> MLPDrafter:
    ctx = DrafterContext(model, "tiny", [EOS], 0, None, profile, SpeculationConfig(), DraftTrainConfig(online=False))
    return MLPPlugin().build(ctx)


def test_the_mlp_drafter_is_lossless_greedy_and_sampled() -> None:
    model = tiny_model("llama")
    greedy = SamplingParams(max_new_tokens=24, temperature=0)
    reference = RolloutEngine(model, [EOS]).generate(PROMPTS, greedy, 2)
    engine = RolloutEngine(model, [EOS], drafter=mlp_drafter(model), tree=TreeShape(4, 1, 3))
    out = engine.generate(PROMPTS, greedy, 2)
    assert out.completion_ids == reference.completion_ids
    assert out.stats.metrics()["spec/drafter/mlp/share"] == 1.0

    sampled = SamplingParams(max_new_tokens=24, temperature=1.0)
    uniforms = torch.rand(len(PROMPTS) * 2, 24, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    reference = RolloutEngine(model, [EOS]).generate(PROMPTS, sampled, 2, uniforms=uniforms)
    out = engine.generate(PROMPTS, sampled, 2, uniforms=uniforms)
    assert out.completion_ids == reference.completion_ids


def test_the_adaptive_controller_prices_the_mlp_drafter_from_its_profiled_curve(tmp_path: Path, monkeypatch) -> None:
    model = tiny_model("llama")
    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path))
    profile = load_or_calibrate(model, "tiny", cost_probes([MLPPlugin()], model, None))
    assert list(profile.drafter_seconds) == [NAME] and min(profile.drafter_seconds[NAME]) > 0
    drafter = mlp_drafter(model, profile)
    controller = AdaptiveController(profile, drafters=priced([drafter]))
    shape = controller.groups[NAME][0]
    assert controller.draft_seconds(8, shape) == pytest.approx(profile.drafter_time(NAME, 8))
    params = SamplingParams(max_new_tokens=24, temperature=0)
    reference = RolloutEngine(model, [EOS]).generate(PROMPTS, params, 2)
    out = RolloutEngine(model, [EOS], drafter=[drafter], controller=controller).generate(PROMPTS, params, 2)
    assert out.completion_ids == reference.completion_ids


def test_a_grpo_run_with_the_mlp_drafter_learns_checkpoints_and_resumes(
    mlp_registered: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Static trees of the MLP drafter sample what plain rollouts sample; its heads learn online; a run cut after one
    step and resumed ends with the heads, their optimizer and the policy of the uninterrupted run."""
    model_dir = save_tiny_llama(tmp_path / "model", seed=0, tie_word_embeddings=True)
    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path / "cache"))
    spec = SpeculationConfig(mode="static", drafter=NAME, nodes=4, top_k=1, depth=3)

    def config(out: Path, steps: int, **overrides):
        return make_config(model_dir, out, speculation=spec, max_steps=steps, save_steps=1, **overrides)

    full = make_trainer(config(tmp_path / "full", 2))
    assert [d.name for d in full.rollouts.drafters] == [NAME]
    plan = estimate_memory(full.config, full.model.config, "cpu")
    assert plan.item("mlp heads").bytes[0] == sum(p.numel() * 4 for p in full.rollouts.drafter(NAME).heads.parameters())
    assert not [item for item in plan.items if "draft" in item.name], "no EAGLE head is planned"
    heads = [p.detach().clone() for p in full.rollouts.drafter(NAME).heads.parameters()]
    history = full.train()
    assert all(m["spec/n_verify_mean"] == 4.0 and m["mlp/loss"] > 0 for m in history)
    moved = full.rollouts.drafter(NAME).heads.parameters()
    assert not all(torch.equal(a, b) for a, b in zip(moved, heads, strict=True)), "the heads learn online"
    assert (tmp_path / "full" / "checkpoint-1" / "draft" / WEIGHTS).is_file()
    plain = make_config(model_dir, tmp_path / "plain", max_steps=2, save_steps=10)
    assert [m["reward"] for m in make_trainer(plain).train()] == [m["reward"] for m in history]

    make_trainer(config(tmp_path / "cut", 1)).train()
    resumed = make_trainer(config(tmp_path / "cut", 2), resume=True)
    assert resumed.start_step == 1
    resumed.train()
    for (name, a), (_, b) in zip(resumed.model.named_parameters(), full.model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    ours, theirs = resumed.rollouts.drafter(NAME), full.rollouts.drafter(NAME)
    for a, b in zip(ours.heads.parameters(), theirs.heads.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert ours.learner.optimizer.state_dict()["state"].keys() == theirs.learner.optimizer.state_dict()["state"].keys()
