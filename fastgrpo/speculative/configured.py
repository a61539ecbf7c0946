"""The controller a ``speculation`` config section asks for, and the largest tree a run of it verifies."""

from __future__ import annotations

import dataclasses

from fastgrpo.config import SpeculationConfig
from fastgrpo.rollout.drafter import Drafter
from fastgrpo.rollout.scheduling import Controller, StaticController
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.speculative.controller import AdaptiveController
from fastgrpo.speculative.merged import priced
from fastgrpo.speculative.paper import PaperController, largest_shape
from fastgrpo.speculative.profiler import LatencyProfile


def tree_bound(spec: SpeculationConfig) -> TreeShape | None:
    """The largest tree a run of ``spec`` verifies (its controller's `max_shape`; None: speculation off)."""
    if spec.mode == "off":
        return None
    return TreeShape(spec.nodes, spec.top_k, spec.depth) if spec.mode == "static" else largest_shape(spec.limits())


def controller_from_config(
    spec: SpeculationConfig, profile: LatencyProfile | None, drafters: list[Drafter]
) -> Controller:
    """The controller a ``speculation`` config section asks for (its mode must not be ``off``) over the ``drafters``
    built: ``profile`` (needed by ``adaptive`` and by ``paper`` with ``c_peak: auto``) prices the target's forwards as
    the engine runs them. ``static`` and ``paper`` trees merge the trees of every drafter."""
    merged = "+".join(d.name for d in drafters)
    if spec.mode == "static":
        return StaticController(dataclasses.replace(tree_bound(spec), drafter=merged))
    limits = spec.limits()
    if spec.mode == "paper":
        return PaperController(profile.c_peak if spec.c_peak == "auto" else spec.c_peak, limits, merged)
    if spec.mode == "adaptive":
        return AdaptiveController(profile, limits, drafters=priced(drafters))
    raise ValueError(f"speculation.mode {spec.mode!r} has no controller")
