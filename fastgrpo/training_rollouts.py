"""A training run's rollouts: one `RolloutEngine`, built once, and, while speculation is on, the drafters it drafts
with (`fastgrpo.speculative.drafters`), the controller that chooses their trees, their online learning (the EAGLE
head's training, the suffix drafter's memory) and the sampling noise of every step. `GRPOTrainer` and the TRL
integration both roll out through `TrainingRollouts`, and both save and restore it the same way (`save`,
`restore`), so that a checkpoint of either resumes in either."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastgrpo.config import DraftTrainConfig, SpeculationConfig
from fastgrpo.config.speculation import DRAFT_CONFIG, LEARNERS
from fastgrpo.rollout.drafter import Drafter, Rollout
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.sequence import GenerationOutput
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.controller import DraftCost, MergedCost, controller_from_config
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.drafters import DrafterContext, build_drafters, needs_draft_head
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.eagle.offline import frequent_tokens_on_all_ranks
from fastgrpo.speculative.profiler import LatencyProfile, load_or_calibrate

DRAFT_DIR = "draft"  # a checkpoint's drafters: GRPOTrainer's and the TRL integration's alike
LEGACY_DRAFT_OPTIMIZER = "optimizer.pt"  # the draft's optimizer in a TRL checkpoint's draft/ before LEARNERS


def step_uniforms(seed: int, step: int, rows: int, width: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """``[rows, width]`` float64 uniforms that pick the sampled tokens of one process's ``rows`` completions at a
    training step: drawn for the whole job's rows from a generator seeded by (seed, step), each process taking its
    own share, so that a completion depends neither on how many processes share the step nor on what ran before
    (a resumed run samples what the uninterrupted one would)."""
    generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
    uniforms = torch.rand((rows * world_size, width), generator=generator, dtype=torch.float64, device="cpu")
    return uniforms[rank * rows : (rank + 1) * rows]


class TrainingRollouts:
    """Rolls out ``model`` (its weights as they are, no copy) and owns what speculation adds.

    Args:
        speculation: the ``speculation`` options; with ``mode: off`` the engine decodes plainly.
        draft_training: online draft learning (``online: false`` keeps the draft fixed).
        seed: initialises a fresh draft, the same on every process.
        compile: the ``torch.compile`` backend the decoding steps and the draft's expansion run with (None: eager;
            `fastgrpo.rollout.compiled.compile_backend` reads the ``compile`` option).
        start_from: a drafters' directory to start from, ``speculation.draft``: a saved draft, or a checkpoint's
            ``draft`` directory (of either trainer), whose learners' states are restored too; None: a fresh draft,
            made at once over the full vocabulary or, with ``speculation.draft_vocab_size``, after the first rollout
            over its most frequent tokens. A resumed run then calls `restore` with its checkpoint.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_ids: list[int],
        speculation: SpeculationConfig,
        draft_training: DraftTrainConfig,
        model_name: str,
        seed: int = 0,
        compile: str | None = None,
        start_from: str | Path | None = None,
    ):
        self.model = model
        self.eos = eos_token_ids
        self.speculation = speculation
        self.draft_training = draft_training
        self.model_name = model_name
        self.seed = seed
        self.compile = compile
        self.engine = RolloutEngine(model, eos_token_ids, tokenizer, compile=compile)
        self.engine.routes.measure(model)  # the CPU routes of its products, before the first rollout
        self.draft: DraftHead | None = None
        self.drafters: list[Drafter] = []
        self.profile: LatencyProfile | None = None
        self.pending: list[Rollout] = []  # rollouts the learners have not learnt from
        if speculation.mode == "off":
            return
        start = Path(start_from) if start_from is not None else None
        try:
            self.draft = self._saved_draft(start) if start is not None else None
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"speculation.draft: {e}") from None
        if self.draft is None and needs_draft_head(speculation) and speculation.draft_vocab_size is None:
            self.draft = self._fresh_draft()
        self._build()
        if start is not None:
            self._load_learners(start)

    @property
    def awaits_draft_vocab(self) -> bool:
        """The EAGLE head is to draft but its fresh draft waits for the first rollout to choose its vocabulary."""
        return needs_draft_head(self.speculation) and self.draft is None

    def _saved_draft(self, directory: Path) -> DraftHead | None:
        """The EAGLE head saved in ``directory``, when there is one and this run drafts with it."""
        if not ((directory / DRAFT_CONFIG).is_file() and needs_draft_head(self.speculation)):
            return None
        return DraftHead.load(directory, self.model)

    def _fresh_draft(self, vocab: torch.Tensor | None = None) -> DraftHead:
        """An untrained draft over the ``[V_d]`` target ids ``vocab`` (None: the full vocabulary)."""
        with torch.random.fork_rng(devices=[]):  # leaves the run's random state alone (the head is built on the CPU)
            torch.default_generator.manual_seed(self.seed)
            return DraftHead(self.model.config, self.model_name, vocab)

    def _build(self) -> None:
        """Build the drafters that can draft now and a controller over them; the engine drafts with them from the next
        rollout on (drafters built before keep their state: a suffix memory is not lost when the EAGLE head joins)."""
        if self.draft is not None:
            param = next(self.model.parameters())
            self.draft = self.draft.to(device=param.device, dtype=param.dtype)
        spec = self.speculation
        if self.profile is None and (spec.mode == "adaptive" or (spec.mode == "paper" and spec.c_peak == "auto")):
            self.profile = load_or_calibrate(self.model, self.draft, self.model_name, self.compile)
        ctx = DrafterContext(self.model, self.draft, self.compile, self.profile, self.speculation, self.draft_training)
        built = {d.name: d for d in self.drafters}
        fresh = build_drafters(ctx)
        self.drafters = [built.get(d.name, d) for d in fresh]
        if not self.drafters:
            self.engine.speculate(None)
            return
        costs: dict[str, DraftCost] = {d.name: d for d in self.drafters}
        if len(self.drafters) > 1:
            costs["+".join(costs)] = MergedCost(list(costs.values()))
        if spec.mode != "adaptive":  # one tree of all the drafters built so far
            spec = replace(spec, drafter="+".join(d.name for d in self.drafters))
        self.engine.speculate(self.drafters, controller=controller_from_config(spec, self.profile, costs))

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        num_generations: int,
        step: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> GenerationOutput:
        """``num_generations`` completions of each prompt at training step ``step`` (sampled with `step_uniforms`),
        keeping what online learning needs for `learn`."""
        uniforms = None
        if not params.greedy:
            rows = len(prompt_ids) * num_generations
            uniforms = step_uniforms(self.seed, step, rows, params.max_new_tokens, rank, world_size)
        awaits_vocab = self.awaits_draft_vocab
        learners = [d.learner for d in self.drafters if d.learner is not None]
        capture = any(learner.captures_hidden for learner in learners) or (awaits_vocab and self.draft_training.online)
        out = self.engine.generate(prompt_ids, params, num_generations, capture_hidden=capture, uniforms=uniforms)
        if awaits_vocab:
            vocab = frequent_tokens_on_all_ranks(out.completion_ids, self.speculation.draft_vocab_size, self.eos)
            self.draft = self._fresh_draft(vocab)
            self._build()
        if any(d.learner is not None for d in self.drafters):
            self.pending.append(Rollout(prompt_ids, out, num_generations))
        return out

    def learn(self) -> dict[str, float]:
        """Every drafter's online learning on the rollouts since the last call (the EAGLE head trains on their
        completions with the hidden states their forwards captured; the policy is not touched: the draft's loss
        reaches none of its weights); returns their metrics (``draft/*``, ``suffix/*``)."""
        if not self.pending:
            return {}
        metrics: dict[str, float] = {}
        for drafter in self.drafters:
            if drafter.learner is not None:
                metrics |= drafter.learner.learn(self.pending)
        self.pending.clear()
        return metrics

    def release(self) -> None:
        """Free the engine's caches and any captured hidden states not learnt from yet (`learn` learns from them
        first): what a rollout holds, given back before the policy update."""
        self.pending.clear()
        self.engine.release()

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def save(self, checkpoint: str | Path, learners: bool = True) -> None:
        """Write the drafters' state into ``checkpoint/draft``: the EAGLE head (a saved draft, which
        ``speculation.draft`` and ``fastgrpo generate --draft`` read) and, with ``learners``, every learner's state
        (`LEARNERS`: the draft's optimizer, the suffix drafter's memory)."""
        directory = Path(checkpoint) / DRAFT_DIR
        if self.draft is not None:
            self.draft.save(directory)
        states = {d.name: d.learner.state_dict() for d in self.drafters if d.learner is not None and learners}
        if states:
            directory.mkdir(parents=True, exist_ok=True)
            torch.save(states, directory / LEARNERS)

    def restore(self, checkpoint: str | Path) -> None:
        """Restore what `save` wrote into ``checkpoint`` (nothing when it holds no drafters' directory): the EAGLE head
        replaces the current one (with its vocabulary) and the learners take their saved states."""
        directory = Path(checkpoint) / DRAFT_DIR
        if not directory.is_dir() or self.speculation.mode == "off":
            return
        saved = self._saved_draft(directory)
        if saved is not None:
            self.draft = saved
            self.drafters = [d for d in self.drafters if not isinstance(d, EagleDrafter)]
            self._build()
        self._load_learners(directory)

    def _load_learners(self, directory: Path) -> None:
        """The learners' states saved in ``directory``, into the drafters of the same names (those this run does not
        draft with are left out). A directory written before `LEARNERS` existed holds the draft's optimizer alone
        (`LEGACY_DRAFT_OPTIMIZER`)."""
        path, legacy = directory / LEARNERS, directory / LEGACY_DRAFT_OPTIMIZER
        if path.is_file():
            states: dict[str, Any] = torch.load(path, map_location="cpu")
        elif legacy.is_file():
            states = {"eagle": torch.load(legacy, map_location="cpu")}
        else:
            return
        self.load_learner_states(states)

    def load_learner_states(self, states: dict[str, Any]) -> None:
        """Learner states by drafter name into the drafters of those names (others are left out)."""
        for drafter in self.drafters:
            if drafter.learner is not None and drafter.name in states:
                drafter.learner.load_state_dict(states[drafter.name])
