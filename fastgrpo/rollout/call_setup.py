"""What the steps of a generation call run inside (`CallSetup`): inference mode, the rollout's attention
(`fastgrpo.rollout.attention`) and linear routes (`fastgrpo.rollout.linear`), the model and the drafters in eval mode,
all left while the call pauses between steps (`CallSetup.paused`: for scoring and the drafters' learning, in the
modules' own modes, with autograd); and for the call's whole length, pauses included, the policy's LoRA adapters merged
into its base weights (`fastgrpo.rollout.lora`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from fastgrpo.rollout.attention import rollout_attention
from fastgrpo.rollout.drafter import Drafter
from fastgrpo.rollout.linear import LinearRoutes
from fastgrpo.rollout.lora import MergedAdapters, merged_lora


class Engine(Protocol):
    """What the setup reads and sets of the engine (`fastgrpo.rollout.engine.RolloutEngine`)."""

    model: PreTrainedModel
    drafters: dict[str, Drafter]
    routes: LinearRoutes
    target: Any  # a `fastgrpo.rollout.target_step.TargetStep`
    merge_lora: bool
    merged: MergedAdapters


@contextmanager
def stepping(engine: Engine) -> Iterator[None]:
    """Inference mode, the rollout's attention and linear routes (none for compiled steps), and the model and the
    drafters in eval mode (each module's own mode restored after)."""
    extra = tuple(m for d in engine.drafters.values() for m in d.modules)
    modes = [(m, m.training) for m in (engine.model, *extra)]  # a draft learns in training mode between calls
    for module, _ in modes:
        module.eval()
    try:
        with (
            torch.inference_mode(),
            rollout_attention(engine.model, *extra),
            nullcontext() if engine.target.compiled else engine.routes.applied(engine.model, *extra),
        ):
            yield
    finally:
        for module, training in modes:
            module.train(training)


@contextmanager
def merged_adapters(engine: Engine) -> Iterator[None]:
    """The policy's LoRA adapters merged into its base weights (with ``engine.merge_lora``), which ``engine.merged``
    names inside the block."""
    outer = engine.merged  # (a call inside another's block merges nothing more)
    try:
        with merged_lora(engine.model) if engine.merge_lora else nullcontext(MergedAdapters()) as merged:
            engine.merged = merged if merged else outer
            yield
    finally:
        engine.merged = outer


class CallSetup:
    """A call's setup for ``engine``, entered at once: `stepping` within `merged_adapters`; `paused` leaves the
    first for a while, `close` both."""

    def __init__(self, engine: Engine):
        self._engine, self._stack, self._outer = engine, ExitStack(), ExitStack()
        self._outer.enter_context(merged_adapters(engine))
        try:
            self._stack.enter_context(stepping(engine))
        except BaseException:
            self._outer.close()
            raise
        self._paused = False

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            self._outer.close()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Outside `stepping` inside the block (the modules in their own modes and attention, autograd on; LoRA
        adapters still merged), within it again after. Not nested, nor around another call's steps."""
        if self._paused:
            raise RuntimeError("the call is paused already")
        self._stack.close()
        self._paused = True
        try:
            yield
        finally:
            self._stack, self._paused = ExitStack(), False
            self._stack.enter_context(stepping(self._engine))
