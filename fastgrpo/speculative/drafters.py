"""The drafters a run can draft with, by name (``speculation.drafter``): ``eagle`` (the learned EAGLE head,
`fastgrpo.speculative.eagle.drafter`), ``suffix`` (trees from earlier completions, `fastgrpo.speculative.suffix.drafter`), or several
joined by ``+`` (``eagle+suffix``), between which the adaptive controller chooses at every step, merged trees of them
included. A new drafter is a class with the methods of `fastgrpo.rollout.drafter.Drafter` and one line in
`BUILDERS` (or a `register_drafter` call)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedModel

from fastgrpo.config import DraftTrainConfig, SpeculationConfig
from fastgrpo.rollout.drafter import Drafter
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.eagle.training import DraftTrainer, EagleLearner
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.profiler import LatencyProfile
from fastgrpo.speculative.suffix.drafter import SuffixDrafter


@dataclass
class DrafterContext:
    """What a drafter may be built from: the target ``model``, the learned ``draft`` (None while a fresh draft waits
    for its vocabulary), the ``compile`` backend, the latency ``profile`` (None when no controller needs one) and the
    run's options."""

    model: PreTrainedModel
    draft: DraftHead | None
    compile: str | None
    profile: LatencyProfile | None
    speculation: SpeculationConfig
    draft_training: DraftTrainConfig


def _eagle(ctx: DrafterContext) -> Drafter | None:
    if ctx.draft is None:
        return None
    learner = None
    if ctx.draft_training.online:
        embed, head = ctx.model.get_input_embeddings(), ctx.model.get_output_embeddings()
        learner = EagleLearner(DraftTrainer(ctx.draft, embed, head, ctx.draft_training))
    return EagleDrafter(ctx.draft, ctx.model, ctx.compile, ctx.profile, learner)


def _suffix(ctx: DrafterContext) -> Drafter:
    return SuffixDrafter(ctx.speculation.suffix_memory_tokens)


# name -> builder (None: the drafter cannot be built yet, as the EAGLE head before a fresh draft has its vocabulary)
BUILDERS: dict[str, Callable[[DrafterContext], Drafter | None]] = {"eagle": _eagle, "suffix": _suffix}


def register_drafter(name: str, build: Callable[[DrafterContext], Drafter | None]) -> None:
    """Make ``name`` a drafter ``speculation.drafter`` can name."""
    if not name or "+" in name:
        raise ValueError(f"a drafter's name must be non-empty and hold no '+', got {name!r}")
    BUILDERS[name] = build


def drafter_names(choice: str) -> list[str]:
    """The drafters ``speculation.drafter`` names (``eagle+suffix``: both), checked."""
    names = choice.split("+")
    unknown = [n for n in names if n not in BUILDERS]
    if unknown or len(set(names)) != len(names):
        raise ValueError(
            f"speculation.drafter must be one of {sorted(BUILDERS)} or several joined by '+' (each once), "
            f"got {choice!r}"
        )
    return names


def build_drafters(ctx: DrafterContext) -> list[Drafter]:
    """The drafters of ``speculation.drafter`` that can be built now, in the order named."""
    built = [BUILDERS[name](ctx) for name in drafter_names(ctx.speculation.drafter)]
    return [d for d in built if d is not None]


def needs_draft_head(speculation: SpeculationConfig) -> bool:
    """Whether the run drafts with the learned EAGLE head."""
    return speculation.mode != "off" and "eagle" in drafter_names(speculation.drafter)
