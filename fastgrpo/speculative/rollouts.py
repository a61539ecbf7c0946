"""A training run's rollouts: one `RolloutEngine`, built once, and, while speculation is on, the draft it drafts
with, the controller that sizes its trees, the online trainer that keeps the draft close to the changing policy and
the sampling noise of every step. `GRPOTrainer` and the TRL integration both roll out through `Rollouts`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastgrpo.config import DraftTrainConfig, SpeculationConfig
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.sequence import GenerationOutput
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.controller import controller_from_config
from fastgrpo.speculative.draft import DraftHead
from fastgrpo.speculative.draft_trainer import DraftTrainer, rollout_samples
from fastgrpo.speculative.eagle import EagleDrafter
from fastgrpo.speculative.offline import frequent_tokens_on_all_ranks

DRAFT_DIR = "draft"  # a checkpoint's draft: GRPOTrainer's and the TRL integration's alike


def starting_draft(model: PreTrainedModel, speculation: SpeculationConfig, resumed: Path | None) -> DraftHead | None:
    """The draft a run starts from: the one saved in the checkpoint it resumes (``resumed``, that checkpoint's draft
    directory, when it has one), else the saved draft of ``speculation.draft``, else None (`Rollouts` then makes a
    fresh one); None when speculation is off."""
    if speculation.mode == "off":
        return None
    if resumed is not None and resumed.is_dir():
        return DraftHead.load(resumed, model)
    if speculation.draft is not None:
        try:
            return DraftHead.load(speculation.draft, model)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"speculation.draft: {e}") from None
    return None


def step_uniforms(seed: int, step: int, rows: int, width: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """``[rows, width]`` float64 uniforms that pick the sampled tokens of one process's ``rows`` completions at a
    training step: drawn for the whole job's rows from a generator seeded by (seed, step), each process taking its
    own share, so that a completion depends neither on how many processes share the step nor on what ran before
    (a resumed run samples what the uninterrupted one would)."""
    generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
    uniforms = torch.rand((rows * world_size, width), generator=generator, dtype=torch.float64, device="cpu")
    return uniforms[rank * rows : (rank + 1) * rows]


class Rollouts:
    """Rolls out ``model`` (its weights as they are, no copy) and owns what speculation adds.

    Args:
        speculation: the ``speculation`` options; with ``mode: off`` the engine decodes plainly.
        draft_training: online draft learning (``online: false`` keeps the draft fixed).
        draft: the draft to start from (a saved or resumed one); None for a fresh draft, made at once over the full
            vocabulary or, with ``speculation.draft_vocab_size``, after the first rollout (which runs plain) over its
            most frequent tokens.
        seed: initialises a fresh draft, the same on every process.
        compile: the ``torch.compile`` backend the decoding steps and the draft's expansion run with (None: eager;
            `fastgrpo.rollout.compiled.compile_backend` reads the ``compile`` option).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_ids: list[int],
        speculation: SpeculationConfig,
        draft_training: DraftTrainConfig,
        model_name: str,
        draft: DraftHead | None = None,
        seed: int = 0,
        compile: str | None = None,
    ):
        self.model = model
        self.eos = eos_token_ids
        self.speculation = speculation
        self.draft_training = draft_training
        self.model_name = model_name
        self.seed = seed
        self.compile = compile
        self.engine = RolloutEngine(model, eos_token_ids, tokenizer, compile=compile)
        self.draft: DraftHead | None = None
        self.draft_trainer: DraftTrainer | None = None
        self.pending: list[tuple[list[list[int]], GenerationOutput, int]] = []  # rollouts the draft has not learnt
        if speculation.mode != "off":
            if draft is None and speculation.draft_vocab_size is None:
                draft = self._fresh_draft()
            if draft is not None:
                self.attach(draft)

    @property
    def awaits_draft_vocab(self) -> bool:
        """Speculation is on but its fresh draft waits for the first rollout to choose its reduced vocabulary."""
        return self.speculation.mode != "off" and self.draft is None

    def _fresh_draft(self, vocab: torch.Tensor | None = None) -> DraftHead:
        """An untrained draft over the ``[V_d]`` target ids ``vocab`` (None: the full vocabulary)."""
        with torch.random.fork_rng(devices=[]):  # leaves the run's random state alone (the head is built on the CPU)
            torch.default_generator.manual_seed(self.seed)
            return DraftHead(self.model.config, self.model_name, vocab)

    def attach(self, draft: DraftHead) -> None:
        """Draft with ``draft`` from the next rollout on (the engine is kept), and train it online when draft learning
        is on."""
        param = next(self.model.parameters())
        self.draft = draft.to(device=param.device, dtype=param.dtype)
        controller = controller_from_config(self.speculation, self.model, self.draft, self.model_name, self.compile)
        self.engine.speculate(EagleDrafter(self.draft, self.model, self.compile), controller=controller)
        if self.draft_training.online:
            embed, head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
            self.draft_trainer = DraftTrainer(self.draft, embed, head, self.draft_training)

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
        keeping what online draft learning needs for `update_draft`."""
        uniforms = None
        if not params.greedy:
            rows = len(prompt_ids) * num_generations
            uniforms = step_uniforms(self.seed, step, rows, params.max_new_tokens, rank, world_size)
        awaits_vocab = self.awaits_draft_vocab
        capture = self.draft_trainer is not None or (awaits_vocab and self.draft_training.online)
        out = self.engine.generate(prompt_ids, params, num_generations, capture_hidden=capture, uniforms=uniforms)
        if awaits_vocab:
            vocab = frequent_tokens_on_all_ranks(out.completion_ids, self.speculation.draft_vocab_size, self.eos)
            self.attach(self._fresh_draft(vocab))
        if capture:  # a captured rollout has a draft trainer by now (made with the draft when it awaited one)
            self.pending.append((prompt_ids, out, num_generations))
        return out

    def update_draft(self) -> dict[str, float]:
        """Train the draft on the rollouts since the last update (their completions, with the hidden states their
        forwards captured, on the share `DraftTrainer.fit_online` takes); returns the ``draft/*`` metrics. The policy
        is not touched: the draft's loss reaches none of its weights."""
        if self.draft_trainer is None or not self.pending:
            return {}
        samples = [s for prompt_ids, out, n in self.pending for s in rollout_samples(prompt_ids, out, n)]
        stats = [out.stats for _, out, _ in self.pending]
        self.pending.clear()
        return self.draft_trainer.fit_online(samples, stats)

    def release(self) -> None:
        """Free the engine's caches and any captured hidden states the draft has not learnt from (`update_draft`
        learns from them first): what a rollout holds, given back before the policy update."""
        self.pending.clear()
        self.engine.release()

    def optimizer_state(self) -> dict[str, Any] | None:
        """The draft optimizer's state (None without online draft learning)."""
        return None if self.draft_trainer is None else self.draft_trainer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        if self.draft_trainer is not None:
            self.draft_trainer.load_state_dict(state)
