"""Speculative rollouts and online draft learning inside TRL's ``GRPOTrainer``.

Two objects are added to an existing TRL script::

    from fastgrpo.integrations.trl import DraftCallback, SpeculativeRollout

    rollout = SpeculativeRollout()                      # or SpeculativeRollout(draft="drafts/my-draft")
    trainer = GRPOTrainer(..., rollout_func=rollout, callbacks=[DraftCallback(rollout)])

`SpeculativeRollout` is TRL's ``rollout_func``: it runs fastgrpo's lossless speculative engine (with its concurrency
controller) on the trainer's current model and captures the target hidden states of every rollout. `DraftCallback`
trains the draft on them after each optimizer step (the policy is not touched: the draft's loss reaches none of its
weights), saves the draft into every TRL checkpoint (``checkpoint-N/draft``) and loads it back when TRL resumes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from packaging.version import Version

from fastgrpo.config import SpeculationConfig
from fastgrpo.models import encode_prompts, eos_token_ids
from fastgrpo.rollout.engine import GenerationOutput, RolloutEngine
from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.spec.controller import controller_from_config
from fastgrpo.spec.draft import DraftHead
from fastgrpo.spec.draft_trainer import DraftTrainConfig, DraftTrainer, rollout_samples
from fastgrpo.spec.offline import frequent_tokens_on_all_ranks

TESTED_TRL = (Version("1.14.0"), Version("1.17.0"))  # the rollout_func hook as of these versions: [low, high)
DRAFT_DIR = "draft"
DRAFT_OPTIMIZER = "optimizer.pt"


def check_trl_version() -> None:
    """Raise ImportError unless the installed TRL is one this integration was tested with."""
    try:
        import trl
    except ImportError as e:
        raise ImportError("fastgrpo.integrations.trl needs TRL: pip install 'fastgrpo[trl]'") from e
    low, high = TESTED_TRL
    if not low <= Version(trl.__version__) < high:
        raise ImportError(
            f"fastgrpo.integrations.trl is tested with trl>={low},<{high} (its experimental rollout_func hook), "
            f"found trl {trl.__version__}: pip install 'trl>={low},<{high}'"
        )


check_trl_version()

from transformers import TrainerCallback  # noqa: E402  (after the version check, which names the fix)


def _groups(prompts: list[Any]) -> int:
    """How many times each prompt is repeated in a row (TRL passes every prompt ``num_generations`` times)."""
    run = 1
    while run < len(prompts) and prompts[run] == prompts[0]:
        run += 1
    if len(prompts) % run or any(prompts[i] != prompts[i - i % run] for i in range(len(prompts))):
        return 1
    return run


class SpeculativeRollout:
    """TRL ``rollout_func``: ``(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs"}``.

    Args:
        draft: a saved draft directory (``fastgrpo draft train``; default ``speculation.draft``), or None for a
            fresh draft that online learning trains from scratch (over the full vocabulary, or with
            ``speculation.draft_vocab_size`` over the most frequent tokens of the first rollout, which runs plain).
        speculation: the controller (default: the adaptive one, with a short calibration when this model has
            no saved profile).
        draft_training: online draft-learning options (`DraftCallback` runs them; ``online=False`` freezes the
            draft).
        max_prompt_length: keep the last this many prompt tokens (None: whole prompts).
    """

    def __init__(
        self,
        draft: str | Path | None = None,
        speculation: SpeculationConfig | None = None,
        draft_training: DraftTrainConfig | None = None,
        max_prompt_length: int | None = None,
    ):
        self.speculation = speculation or SpeculationConfig()
        self.speculation.validate()
        if self.speculation.mode == "off":
            raise ValueError("SpeculativeRollout: speculation.mode 'off' leaves nothing to do; use TRL's generation")
        draft = draft if draft is not None else self.speculation.draft
        self.draft_path = None if draft is None else Path(draft)
        if self.draft_path is not None and not self.draft_path.is_dir():
            raise ValueError(f"draft: {self.draft_path} is not a directory with a saved draft")
        if self.draft_path is not None and self.speculation.draft_vocab_size is not None:
            raise ValueError(
                f"speculation.draft_vocab_size applies to a fresh draft; the saved draft {self.draft_path} keeps its "
                "own vocabulary"
            )
        self.draft_training = draft_training or DraftTrainConfig()
        self.draft_training.validate()
        self.max_prompt_length = max_prompt_length or sys.maxsize
        self.engine: RolloutEngine | None = None
        self.eos: list[int] = []  # the model's end-of-sequence ids, set with the engine
        self.draft: DraftHead | None = None
        self.draft_trainer: DraftTrainer | None = None
        self.trainer: Any = None
        self.resume_from: Path | None = None  # a TRL checkpoint whose draft replaces `draft` (set by DraftCallback)
        self.pending: list[tuple[list[list[int]], GenerationOutput, int]] = []
        self.calls = 0

    # -- TRL's hook -----------------------------------------------------------------------------------------
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        self.trainer = trainer
        engine = self._engine(trainer)
        params = self._sampling_params(trainer)
        n = _groups(prompts)
        tokenizer = trainer.processing_class
        prompt_ids = encode_prompts(tokenizer, prompts[::n], self.max_prompt_length)
        # Seeded by the step (so a resumed run samples as the uninterrupted one would) and the process.
        seed = (trainer.args.seed * 1_000_003 + trainer.state.global_step) * 1009 + trainer.accelerator.process_index
        self.calls += 1
        generator = torch.Generator().manual_seed(seed)
        awaits_vocab = self.draft is None
        capture = self.draft_trainer is not None or (awaits_vocab and self.draft_training.online)
        out = engine.generate(prompt_ids, params, n, generator, capture_hidden=capture)
        if awaits_vocab:
            self._attach_vocab_draft(trainer, out)
        if capture:
            self.pending.append((prompt_ids, out, n))
        self._log(trainer, out)
        return {
            "prompt_ids": [p for p in prompt_ids for _ in range(n)],
            "completion_ids": out.completion_ids,
            "logprobs": out.logprobs,
        }

    def _engine(self, trainer: Any) -> RolloutEngine:
        """Built on the first call, on the trainer's model (unwrapped from DDP; the same module TRL trains). With
        ``speculation.draft_vocab_size`` and no saved draft, the first rollout runs plain (`_attach_vocab_draft`)."""
        if self.engine is not None:
            return self.engine
        self._check_supported(trainer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        self.eos = eos_token_ids(model, trainer.processing_class)
        saved = self.resume_from / DRAFT_DIR if self.resume_from is not None else None
        if saved is not None and saved.is_dir():
            self._attach(model, trainer, DraftHead.load(saved, model), saved)
        elif self.draft_path is not None:
            self._attach(model, trainer, DraftHead.load(self.draft_path, model))
        elif self.speculation.draft_vocab_size is not None:
            self.engine = RolloutEngine(model, self.eos, trainer.processing_class)
        else:
            self._attach(model, trainer, self._fresh_draft(model, trainer))
        return self.engine

    @staticmethod
    def _fresh_draft(model: Any, trainer: Any, vocab: torch.Tensor | None = None) -> DraftHead:
        """An untrained draft over the ``[V_d]`` target ids ``vocab`` (None: the full vocabulary), the same on every
        process."""
        with torch.random.fork_rng(devices=[]):  # leaves the training run's random state alone
            torch.manual_seed(trainer.args.seed)
            return DraftHead(model.config, model.config.name_or_path, vocab)

    def _attach(self, model: Any, trainer: Any, draft: DraftHead, saved: Path | None = None) -> None:
        """Roll out speculatively with ``draft`` from now on, and train it online when draft learning is on (with
        the optimizer state of the checkpoint draft directory ``saved``, if it has one)."""
        param = next(model.parameters())
        self.draft = draft.to(device=param.device, dtype=param.dtype)
        name = model.config.name_or_path or model.config.model_type
        controller = controller_from_config(self.speculation, model, self.draft, name)
        self.engine = RolloutEngine(model, self.eos, trainer.processing_class, self.draft, controller=controller)
        if self.draft_training.online:
            embed, head = model.get_input_embeddings(), model.get_output_embeddings()
            self.draft_trainer = DraftTrainer(self.draft, embed, head, self.draft_training)
            if saved is not None and (saved / DRAFT_OPTIMIZER).is_file():
                self.draft_trainer.optimizer.load_state_dict(torch.load(saved / DRAFT_OPTIMIZER))

    def _attach_vocab_draft(self, trainer: Any, out: GenerationOutput) -> None:
        """Make and attach the fresh draft of ``speculation.draft_vocab_size``: its vocabulary is the most frequent
        tokens of this rollout's completions on all processes (so that every process builds the same draft)."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        vocab = frequent_tokens_on_all_ranks(out.completion_ids, self.speculation.draft_vocab_size, self.eos)
        self._attach(model, trainer, self._fresh_draft(model, trainer, vocab))

    @staticmethod
    def _check_supported(trainer: Any) -> None:
        args = trainer.args
        unsupported = {
            "repetition_penalty": args.repetition_penalty != 1.0,
            "generation_kwargs": bool(args.generation_kwargs),
            "chat_template_kwargs": bool(getattr(args, "chat_template_kwargs", None)),
            "use_vllm": args.use_vllm,
            "environment_factory / tools": bool(getattr(trainer, "tools", None))
            or getattr(trainer, "environment_factories", None) is not None,
        }
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise ValueError(f"SpeculativeRollout does not support these GRPOConfig/GRPOTrainer options: {bad}")

    @staticmethod
    def _sampling_params(trainer: Any) -> SamplingParams:
        args = trainer.args
        return SamplingParams(
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k or 0,
            min_p=args.min_p or 0.0,
        )

    @staticmethod
    def _log(trainer: Any, out: GenerationOutput) -> None:
        """Add the rollout's speculation figures to the metrics TRL logs at its next logging step."""
        s = out.stats
        metrics = trainer._metrics["train"]
        metrics["spec/accept_length"].append(s.accept_length)
        if s.depth_offered:  # a rollout of plain steps only has no tree acceptance to average in
            metrics["spec/tree_accept_length"].append(s.tree_accept_length)
        metrics["spec/n_verify_mean"].append(s.n_verify_mean)
        metrics["spec/concurrency_mean"].append(s.concurrency_mean)
        metrics["rollout/tokens_per_second"].append(s.tokens_per_second)

    # -- online draft learning --------------------------------------------------------------------------------
    def update_draft(self) -> dict[str, float]:
        """Train the draft on the rollouts since the last update (their completions, hidden states captured by the
        rollout forwards, on the share `DraftTrainer.fit_online` takes); returns the ``draft/*`` metrics."""
        if self.draft_trainer is None or not self.pending:
            return {}
        samples = [s for prompt_ids, out, n in self.pending for s in rollout_samples(prompt_ids, out, n)]
        rollouts = [out.stats for _, out, _ in self.pending]
        self.pending.clear()
        return self.draft_trainer.fit_online(samples, rollouts)

    def save_draft(self, checkpoint: Path) -> None:
        """Write the draft (and its optimizer's state) into ``checkpoint/draft``."""
        if self.draft is None:
            return
        self.draft.save(checkpoint / DRAFT_DIR)
        if self.draft_trainer is not None:
            torch.save(self.draft_trainer.optimizer.state_dict(), checkpoint / DRAFT_DIR / DRAFT_OPTIMIZER)


class DraftCallback(TrainerCallback):
    """Runs `SpeculativeRollout.update_draft` after every optimizer step, saves the draft into each checkpoint
    (``checkpoint-N/draft``) and restores it when training resumes from a checkpoint."""

    def __init__(self, rollout: SpeculativeRollout):
        self.rollout = rollout

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step > 0:  # TRL restored its state from checkpoint-{global_step}: take that draft too
            self.rollout.resume_from = Path(args.output_dir) / f"checkpoint-{state.global_step}"

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        metrics = self.rollout.update_draft()
        if metrics and self.rollout.trainer is not None:
            for key, value in metrics.items():
                self.rollout.trainer._metrics["train"][key].append(value)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.rollout.save_draft(Path(args.output_dir) / f"checkpoint-{state.global_step}")
