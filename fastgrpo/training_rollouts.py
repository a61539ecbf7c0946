"""A training run's rollouts: one `RolloutEngine`, built once, and, while speculation is on, the drafters it drafts
with (each built by its plugin, `fastgrpo.speculative.registry`), the controller that chooses their trees, their
online learning and the sampling noise of every step. `GRPOTrainer` and the TRL integration both roll out through
`TrainingRollouts`, and both save and restore it the same way (`save`, `restore`), so that a checkpoint of either
resumes in either."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastgrpo.config import DraftTrainConfig, SpeculationConfig
from fastgrpo.rollout.cache import call_length
from fastgrpo.rollout.decoding import Decoding
from fastgrpo.rollout.drafter import Drafter, Rollout
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.sequence import Generation, GenerationOutput, Sequence
from fastgrpo.rollout.turns import Turns
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.configured import controller_from_config
from fastgrpo.speculative.plugin import LEARNERS, DrafterContext, DrafterPlugin, cost_probes
from fastgrpo.speculative.profiler import LatencyProfile, load_or_calibrate
from fastgrpo.speculative.registry import plugins
from fastgrpo.state_files import DamagedStateFile, load_data

logger = logging.getLogger(__name__)

DRAFT_DIR = "draft"  # a checkpoint's drafters: GRPOTrainer's and the TRL integration's alike
# in DRAFT_DIR: what the controller has learnt (`Controller.state_dict`) and the drafters measured of their costs
SCHEDULE = "schedule.json"


def drafts_folder(rank: int, trainers: int) -> str:
    """The folder of a checkpoint that the drafters of the rollout process of job rank ``rank`` are saved in, the
    job's first ``trainers`` ranks training: ``draft`` for the first rollout process (and any run's only one), which a
    run without rollout processes reads; ``draft-rank{n}`` for the ``n``-th (from 1; its rank where one trains)."""
    return DRAFT_DIR if rank - trainers < 1 else f"{DRAFT_DIR}-rank{rank - trainers + 1}"


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
        draft_training: online draft learning (``online: false`` keeps the drafters fixed).
        seed: initialises fresh drafter networks, the same on every process.
        backend: the ``torch.compile`` backend the decoding steps and the drafters run with (None: eager;
            `fastgrpo.rollout.compiled.compile_backend` reads the ``compile`` option).
        start_from: a drafters' directory to start from, ``speculation.draft``: a saved draft, or a checkpoint's
            ``draft`` directory (of either trainer), whose learners' states are restored too; None: fresh drafters
            (a drafter that waits for data, as a fresh EAGLE head with ``speculation.draft_vocab_size`` for its
            vocabulary, is built after the first rollout). A resumed run then calls `restore` with its checkpoint.
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
        backend: str | None = None,
        start_from: str | Path | None = None,
    ):
        self.model = model
        self.eos = eos_token_ids
        self.speculation = speculation
        self.draft_training = draft_training
        self.model_name = model_name
        self.seed = seed
        self.backend = backend
        self.engine = RolloutEngine(model, eos_token_ids, tokenizer, backend=backend)
        self.engine.routes.measure(model)  # the CPU routes of its products, before the first rollout
        self.plugins: list[DrafterPlugin] = plugins(speculation)
        self.drafters: list[Drafter] = []
        self.profile: LatencyProfile | None = None
        self.pending: list[Rollout] = []  # rollouts the learners have not learnt from
        # called with the call before each decoding step of `generate`, and with None after its last (a rollout
        # process takes new weights there)
        self.between_steps: Callable[[Generation | None], None] | None = None
        if not self.plugins:
            return
        start = Path(start_from) if start_from is not None else None
        try:
            self._build(saved=start)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"speculation.draft: {e}") from None
        if start is not None:
            self._load_learners(start)

    def drafter(self, name: str) -> Drafter | None:
        """The drafter called ``name`` (None: not drafting with it, or not built yet)."""
        return next((d for d in self.drafters if d.name == name), None)

    @property
    def waiting(self) -> list[DrafterPlugin]:
        """The plugins whose drafters could not be built yet (they are tried again after every rollout)."""
        return [p for p in self.plugins if self.drafter(p.name) is None]

    def _context(self, rollout: GenerationOutput | None = None) -> DrafterContext:
        return DrafterContext(
            self.model,
            self.model_name,
            self.eos,
            self.seed,
            self.backend,
            self.profile,
            self.speculation,
            self.draft_training,
            rollout,
        )

    def _build(self, saved: Path | None = None, rollout: GenerationOutput | None = None) -> None:
        """Build the drafters that are not built yet and can be now (from ``saved`` where it holds their files), and a
        controller over all of them; the engine drafts with them from the next rollout on (drafters built before keep
        their state: a suffix memory is not lost when the EAGLE head joins)."""
        spec = self.speculation
        if self.profile is None and (spec.mode == "adaptive" or (spec.mode == "paper" and spec.c_peak == "auto")):
            probes = cost_probes(self.plugins, self.model, self.backend, saved)
            self.profile = load_or_calibrate(self.model, self.model_name, probes, self.backend)
        ctx = self._context(rollout)
        built = {d.name: d for d in self.drafters}
        for plugin in self.waiting:
            drafter = plugin.build(ctx, saved)
            if drafter is not None:
                built[plugin.name] = drafter
        self.drafters = [built[p.name] for p in self.plugins if p.name in built]
        if not self.drafters:
            self.engine.speculate(None)
            return
        self.engine.speculate(self.drafters, controller=controller_from_config(spec, self.profile, self.drafters))

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        num_generations: int,
        step: int,
        rank: int = 0,
        world_size: int = 1,
        turns: Turns | None = None,
        max_rows: int | None = None,
    ) -> GenerationOutput:
        """``num_generations`` completions of each prompt at training step ``step`` (sampled with `step_uniforms`),
        keeping what online learning needs for `learn`; with ``turns``, the completions call tools; with
        ``max_rows``, at most that many decode at once (`RolloutEngine.generate`)."""
        with self.decoding(prompt_ids, params, num_generations, step, rank, world_size, turns, max_rows) as run:
            if self.between_steps is None:
                run.finish()
            else:
                while not run.done:
                    self.between_steps(run.call)
                    run.step()
                self.between_steps(None)
        return run.output()

    @contextmanager
    def decoding(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        num_generations: int,
        step: int,
        rank: int = 0,
        world_size: int = 1,
        turns: Turns | None = None,
        max_rows: int | None = None,
    ) -> Iterator[Decoding]:
        """`generate` one step at a time (`RolloutEngine.decoding`): what online learning needs is kept when the
        block ends with every row done, or, in a call that spans generations, as each is handed over (`hand_over`)."""
        uniforms = self._uniforms(params, len(prompt_ids) * num_generations, step, rank, world_size)
        waiting = self.waiting
        learners = [d.learner for d in self.drafters if d.learner is not None]
        capture = any(learner.captures_hidden for learner in learners)
        capture |= self.draft_training.online and any(p.captures_hidden for p in waiting)
        engine = self.engine
        args = (prompt_ids, params, num_generations, None, capture, uniforms, turns, max_rows)
        with engine.decoding(*args) as run:
            yield run
        if not run.done or run.handed_over:  # (a call that spans generations hands each over, `hand_over`)
            return
        out = run.output()
        if waiting:
            self._build(rollout=out)
        self._keep(prompt_ids, out, num_generations)

    def extend(
        self,
        run: Decoding,
        prompt_ids: list[list[int]],
        num_generations: int,
        step: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> list[Sequence]:
        """Take the completions of step ``step`` into ``run``, a call of `decoding` under way (sampled with the uniforms
        `generate` would sample them with at that step); their sequences, for `hand_over`
        (`fastgrpo.rollout.decoding.Decoding.extend`)."""
        uniforms = self._uniforms(run.call.params, len(prompt_ids) * num_generations, step, rank, world_size)
        return run.extend(prompt_ids, num_generations, uniforms)

    def hand_over(
        self, run: Decoding, seqs: list[Sequence], prompt_ids: list[list[int]], num_generations: int
    ) -> GenerationOutput:
        """The completions ``seqs`` of ``run`` (the call's first ones, or those `extend` took in), all ended, kept for
        `learn` as `generate`'s are (`fastgrpo.rollout.decoding.Decoding.hand_over`)."""
        out = run.hand_over(seqs)
        self._keep(prompt_ids, out, num_generations)
        return out

    def _keep(self, prompt_ids: list[list[int]], out: GenerationOutput, num_generations: int) -> None:
        """Keep a rollout for the learners' next `learn` (where a drafter learns)."""
        if any(d.learner is not None for d in self.drafters):
            self.pending.append(Rollout(prompt_ids, out, num_generations))

    def _uniforms(self, params: SamplingParams, rows: int, step: int, rank: int, world: int) -> torch.Tensor | None:
        return None if params.greedy else step_uniforms(self.seed, step, rows, params.max_new_tokens, rank, world)

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

    def reserve(self, rows: int, max_prompt_length: int, max_completion_length: int) -> None:
        """Size the rollout's KV caches, when the first rollout makes them, for the run's largest rollout: ``rows``
        completions of prompts up to ``max_prompt_length`` tokens (`RolloutEngine.reserve`). They then stay where they
        are for the whole run, through the policy updates (the memory plan counts them there), so that compiled
        steps are recorded once per run."""
        self.engine.reserve(rows, call_length(max_prompt_length, max_completion_length))

    def release(self) -> None:
        """Free the hidden states captured and not learnt from yet (`learn` learns from them first): what a rollout
        holds beyond its caches, given back before the policy update."""
        self.pending.clear()

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def save(self, checkpoint: str | Path, learners: bool = True, folder: str = DRAFT_DIR) -> None:
        """Write the drafters' state into ``checkpoint/draft`` (or ``folder``): each drafter's own files
        (`DrafterPlugin.save`: the EAGLE head as a saved draft, which ``speculation.draft`` reads) and, with
        ``learners``, every learner's state (`LEARNERS`: the draft's optimizer, the suffix drafter's memory) and what
        the controller has learnt and the drafters of their costs (`SCHEDULE`), so that a resumed run drafts what the
        uninterrupted one would."""
        directory = Path(checkpoint) / folder
        for plugin in self.plugins:
            drafter = self.drafter(plugin.name)
            if drafter is not None:
                plugin.save(drafter, directory)
        states = {d.name: d.learner.state_dict() for d in self.drafters if d.learner is not None and learners}
        if states:
            directory.mkdir(parents=True, exist_ok=True)
            torch.save(states, directory / LEARNERS)
        if self.engine.controller is not None and learners:
            schedule = {
                "controller": self.engine.controller.state_dict(),
                "drafters": {d.name: d.cost_state() for d in self.drafters},
            }
            directory.mkdir(parents=True, exist_ok=True)
            (directory / SCHEDULE).write_text(json.dumps(schedule))

    def restore(self, checkpoint: str | Path, folder: str = DRAFT_DIR) -> None:
        """Restore what `save` wrote into ``checkpoint`` (``folder`` where it is there, else ``draft``): a drafter
        whose files are there is built from them anew, and the learners and the controller take their saved states.
        What is missing or damaged is passed over with a warning that names the file and says what starts afresh."""
        directory = Path(checkpoint) / folder
        if not directory.is_dir():
            directory = Path(checkpoint) / DRAFT_DIR
        if not self.plugins:
            return
        if not directory.is_dir():
            logger.warning(
                "--resume: %s is missing: the drafters, their learners and the controller start afresh (what they had "
                "learnt is lost; the completions are the same)",
                directory,
            )
            return
        saved = {p.name for p in self.plugins if p.saved_in(directory)}
        if saved:
            self.drafters = [d for d in self.drafters if d.name not in saved]
            self._build(saved=directory)
        self._load_learners(directory, resumed=True)
        self._load_schedule(directory)

    def _load_schedule(self, directory: Path) -> None:
        """What the controller had learnt and the drafters had measured of their costs (`SCHEDULE`), where saved for
        this run's candidate trees; otherwise they start afresh, and say so. Every drafter's cost state is checked
        against the form of its fresh one before anything is taken up, so that a damaged file changes nothing."""
        path = directory / SCHEDULE
        if self.engine.controller is None:
            return
        if not path.is_file():
            logger.warning("%s is missing: the controller and the drafters' prices start afresh", path)
            return
        try:
            schedule = json.loads(path.read_text())
            costs = {d.name: schedule["drafters"].get(d.name) for d in self.drafters}
            for drafter in self.drafters:
                if costs[drafter.name]:
                    _check_same_form(costs[drafter.name], drafter.cost_state(), f"drafters.{drafter.name}")
            self.engine.controller.load_state_dict(schedule["controller"])
            for drafter in self.drafters:
                if costs[drafter.name]:
                    drafter.load_cost_state(costs[drafter.name])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning(
                "%s: not used, the controller and the drafters' prices start afresh (%s: %s)", path, type(e).__name__, e
            )

    def _load_learners(self, directory: Path, resumed: bool = False) -> None:
        """The learners' states saved in ``directory``, into the drafters of the same names (those this run does not
        draft with are left out). Resuming (``resumed``), a learner whose state is missing or does not fit starts
        afresh, with a warning naming the file and the drafter; a state file that holds more than data is refused
        (`fastgrpo.state_files.load_data`)."""
        path = directory / LEARNERS
        learners = [d for d in self.drafters if d.learner is not None]
        if not path.is_file():
            if resumed and learners:
                logger.warning(
                    "%s is missing: the learners of %s start afresh (what they had learnt is lost)",
                    path,
                    ", ".join(d.name for d in learners),
                )
            return
        try:
            states = load_data(path)
        except DamagedStateFile as e:
            logger.warning("%s: the learners start afresh (what they had learnt is lost)", e)
            return
        if not isinstance(states, dict):
            logger.warning(
                "%s holds a %s, not learners' states: the learners start afresh", path, type(states).__name__
            )
            return
        for drafter in learners:
            if drafter.name not in states:
                if resumed:
                    logger.warning(
                        "%s holds no state for the %s drafter: its learner starts afresh (what it had learnt is lost)",
                        path,
                        drafter.name,
                    )
                continue
            try:
                drafter.learner.load_state_dict(states[drafter.name])
            except (KeyError, ValueError, TypeError, AttributeError, IndexError, RuntimeError) as e:
                logger.warning(
                    "%s: the %s drafter's state does not fit its learner (%s: %s): it starts afresh",
                    path,
                    drafter.name,
                    type(e).__name__,
                    e,
                )


def _check_same_form(saved: Any, fresh: Any, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` when the JSON value ``saved`` is not of the form of ``fresh`` (a drafter's
    cost state as it makes it): the same keys, lists of the same length, numbers where it has numbers."""
    if isinstance(fresh, dict):
        if not isinstance(saved, dict) or set(saved) != set(fresh):
            raise ValueError(f"{where}: expected the keys {sorted(fresh)}, got {saved!r:.80}")
        for key in fresh:
            _check_same_form(saved[key], fresh[key], f"{where}.{key}")
    elif isinstance(fresh, list | tuple):
        if not isinstance(saved, list) or len(saved) != len(fresh):
            raise ValueError(f"{where}: expected a list of {len(fresh)}, got {saved!r:.80}")
        for index, (a, b) in enumerate(zip(saved, fresh, strict=True)):
            _check_same_form(a, b, f"{where}[{index}]")
    elif (isinstance(fresh, int | float) and not isinstance(fresh, bool)) and (
        isinstance(saved, bool) or not isinstance(saved, int | float)
    ):
        raise ValueError(f"{where}: expected a number, got {saved!r:.80}")
