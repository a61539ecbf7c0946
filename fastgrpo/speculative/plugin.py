"""What a drafter kind supplies besides its `fastgrpo.rollout.drafter.Drafter`. Each drafter is a package whose
`DrafterPlugin` says everything about it that a run needs besides proposing trees: how to build it, how to save and
load its own files, what its proposals cost (timed into the latency profile) and how much memory it takes.
`fastgrpo.training_rollouts`, the latency profile, the controller and the memory plan loop over the plugins of the
drafters named and name none. A new drafter is a `fastgrpo.rollout.drafter.Drafter` and a
plugin registered with `fastgrpo.speculative.registry.register_drafter`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel

from fastgrpo.config import DraftTrainConfig, GRPOConfig, SpeculationConfig
from fastgrpo.memory.items import MemoryItem
from fastgrpo.memory.shapes import ModelShape
from fastgrpo.rollout.cache import cache_slots, physical_rows
from fastgrpo.rollout.drafter import Drafter
from fastgrpo.rollout.sequence import GenerationOutput
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.speculative.profiler import CostProbe, LatencyProfile, ProbeFactory

LEARNERS = "learners.pt"  # in a drafters' directory: the learners' states by drafter name (`DrafterPlugin`)


@dataclass
class DrafterContext:
    """What a drafter is built from: the target ``model`` (``model_name`` names it, ``eos_token_ids`` end its
    completions), the run's ``seed`` (a fresh network starts from it), the compile ``backend`` of the engine's steps
    (None: eager), the latency ``profile`` (None when no controller needs one), the run's options, and ``rollout``:
    the latest rollout (None before the first), from which a drafter that waits for data (as a fresh EAGLE head for
    its vocabulary) is built."""

    model: PreTrainedModel
    model_name: str
    eos_token_ids: list[int]
    seed: int
    backend: str | None
    profile: LatencyProfile | None
    speculation: SpeculationConfig
    draft_training: DraftTrainConfig
    rollout: GenerationOutput | None = None


@dataclass(frozen=True)
class PlannedRun:
    """What a memory estimate is made from (`fastgrpo.memory_plan.plan`): the run's options, the model's shape, the
    bytes of an element of its dtype, the processes in the job, whether on a GPU, and the rollout's sizes as the
    engine makes them: ``rows`` cache rows, ``length`` tokens per row of a call, ``bound`` the largest tree (None:
    plain), ``compiled`` whether the steps run compiled (its caches hold a scratch row more, `cache_rows`)."""

    config: GRPOConfig
    shape: ModelShape
    dtype_bytes: int
    world_size: int
    cuda: bool
    rows: int
    length: int
    bound: TreeShape | None
    compiled: bool = False

    @property
    def cache_rows(self) -> int:
        """Rows a KV cache of the rollout allocates (`fastgrpo.rollout.cache.physical_rows`)."""
        return physical_rows(self.rows, self.compiled)

    @property
    def kv_slots(self) -> int:
        """Slots per row of the target's KV cache (`fastgrpo.rollout.cache.cache_slots`)."""
        return cache_slots(self.length, self.bound.nodes if self.bound is not None else 1)


class DrafterPlugin:
    """One drafter kind. ``build`` is all a plugin must do; the rest is optional.

    ``captures_hidden``: its drafters learn from the target's hidden states of the rollouts (the engine captures
    them while one of the drafters named is built or waits to be), with the ``draft_training.*`` options; a run
    none of whose drafters does refuses those options. ``parks_rows``: its drafters keep a row's state aside while
    the row waits on tools (`Drafter.park`, `Drafter.rejoin`); a run with tools refuses a drafter that does not."""

    name: str = ""
    captures_hidden: bool = False
    parks_rows: bool = False

    def build(self, ctx: DrafterContext, saved: Path | None = None) -> Drafter | None:
        """A drafter for the run, from the files `save` wrote in ``saved`` when given (and there); None while it
        cannot be built yet (`TrainingRollouts` tries again after every rollout, with ``ctx.rollout`` set)."""
        raise NotImplementedError

    def saved_in(self, directory: Path) -> bool:
        """Whether ``directory`` holds what `save` writes (the drafter is then rebuilt from it on a restore)."""
        return False

    def check_saved(self, directory: Path) -> None:
        """Raise ``ValueError`` naming the file when what `save` wrote in ``directory`` cannot be read; called before
        a model loads (`build` reads the files later)."""

    def save(self, drafter: Drafter, directory: Path) -> None:
        """Write the drafter's own files (a network's weights, say) into ``directory``; its learner's state is saved
        beside them by the caller."""

    def cost_probe(
        self,
        model: PreTrainedModel,
        tokens: tuple[int, ...],
        context_length: int,
        backend: str | None,
        saved: Path | None = None,
    ) -> CostProbe | None:
        """What the latency profile times of this drafter at each of ``tokens`` over contexts of ``context_length``
        tokens, compiled by ``backend`` as the engine would run it, for the drafter `build` makes from ``saved``
        (None: it prices itself otherwise)."""
        return None

    def memory(self, run: PlannedRun) -> list[MemoryItem]:
        """Device memory its drafting and learning take in ``run`` (see `fastgrpo.memory_plan.plan`)."""
        return []

    def checkpoint_bytes(self, run: PlannedRun) -> int:
        """About what its files and learner's state take in a checkpoint of ``run``."""
        return 0


def cost_probes(
    plugins: list[DrafterPlugin], model: PreTrainedModel, backend: str | None, saved: Path | None = None
) -> ProbeFactory:
    """The latency profile's probes (`fastgrpo.speculative.profiler.ProbeFactory`) of those of ``plugins`` that have
    one, for the drafters they build from ``saved``."""

    def probes(tokens: tuple[int, ...], context_length: int, skip: set[str]) -> dict[str, CostProbe]:
        made = {
            p.name: p.cost_probe(model, tokens, context_length, backend, saved) for p in plugins if p.name not in skip
        }
        return {name: probe for name, probe in made.items() if probe is not None}

    return probes
