"""The shapes a run's compiled decoding steps can meet, known before the first step: every row bucket, every extent
bucket and every tree the controller may choose. The engine runs each of them once before a call's first step
(`fastgrpo.rollout.engine.RolloutEngine.settle`), as vLLM and SGLang capture their batch sizes at start-up, so that
nothing compiles or records a CUDA graph while a rollout runs, and no step's time is the compiler's.

Compiled steps take their rows and the keys' extent as symbolic sizes (``torch.compile(dynamic=True)``,
`fastgrpo.rollout.compiled`): a function compiles one graph per sampling setting and, for trees, per acceptance-walk
depth (its loop is unrolled), which a compiled engine rounds up to a power of two (`depth_bucket`: a walk past a
tree's deepest node accepts nothing more); on a GPU each (rows, extent, tree size) is then a CUDA graph of its own,
recorded at start-up.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from fastgrpo.rollout.cache import RowCache, read_slots
from fastgrpo.rollout.compiled import EXTENT_BLOCK, row_bucket
from fastgrpo.rollout.drafter import Drafter
from fastgrpo.rollout.forward import decoder_and_head
from fastgrpo.rollout.scheduling import Controller
from fastgrpo.rollout.target_step import TargetStep
from fastgrpo.rollout.tree import DraftTree, TreeShape
from fastgrpo.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Engine(Protocol):
    """What settling reads of a `fastgrpo.rollout.engine.RolloutEngine`."""

    model: nn.Module
    target: TargetStep
    cache: RowCache
    controller: Controller | None
    drafters: dict[str, Drafter]
    settled: set[tuple]  # (sampling setting, caches' serials) whose shapes have all run, for the current drafters

    def drafters_of(self, shape: TreeShape) -> list[Drafter]: ...

    def tree_depth(self, shape: TreeShape) -> int: ...


def row_buckets(max_rows: int) -> list[int]:
    """Every row count a compiled step over at most ``max_rows`` live rows computes (`row_bucket`): 2, 4, ... up to
    ``row_bucket(max_rows)``."""
    top = row_bucket(max_rows)
    return [1 << i for i in range(1, top.bit_length())]


def depth_bucket(levels: int) -> int:
    """The acceptance walk's depth of a compiled tree step for trees of up to ``levels`` levels: the smallest power
    of two at or above it."""
    return 1 << (levels - 1).bit_length()


def extent_buckets(limit: int) -> list[int]:
    """Every extent `fastgrpo.rollout.compiled.extent_bucket` gives below ``limit`` slots: multiples of `EXTENT_BLOCK`,
    and ``limit`` itself."""
    return [min(k * EXTENT_BLOCK, limit) for k in range(1, -(-limit // EXTENT_BLOCK) + 1)]


@dataclass(frozen=True)
class ShapeMenu:
    """The shapes of a run's compiled target steps: ``rows`` (`row_buckets`), ``extents`` (`extent_buckets` of the
    cache's slots) and ``trees`` the (nodes, acceptance-walk depth) of every tree the controller may choose."""

    rows: tuple[int, ...]
    extents: tuple[int, ...]
    trees: tuple[tuple[int, int], ...]

    @property
    def graphs(self) -> int:
        """Graphs the target's steps compile per sampling setting: the plain step's, and one per tree depth."""
        return 1 + len({depth for _, depth in self.trees})

    @property
    def recordings(self) -> int:
        """CUDA graphs the target's steps record on a GPU per sampling setting: one per (rows, extent) of the plain
        step, and per (rows, extent, nodes, depth) of the tree step."""
        return len(self.rows) * len(self.extents) * (1 + len(self.trees))

    def describe(self) -> str:
        return (
            f"{len(self.rows)} row buckets ({', '.join(map(str, self.rows))}) x {len(self.extents)} extents "
            f"({', '.join(map(str, self.extents))}) x {1 + len(self.trees)} step kinds (plain, "
            f"{len(self.trees)} trees): {self.graphs} graphs, {self.recordings} shapes"
        )


def tree_shapes(engine: Engine) -> list[TreeShape]:
    """Every tree shape ``engine``'s controller may choose (none without one)."""
    return [] if engine.controller is None else [s for s in engine.controller.shapes if s.speculative]


def menu_of(engine: Engine) -> ShapeMenu:
    """The shapes ``engine``'s compiled target steps can meet over its current caches: its rows and extent buckets,
    and every tree its controller may choose, at the depth bucket of whoever drafts it."""
    shapes = tree_shapes(engine)
    trees = {(s.nodes, depth_bucket(engine.tree_depth(s))) for s in shapes}
    extents = extent_buckets(read_slots(engine.cache.max_len))
    return ShapeMenu(tuple(row_buckets(engine.cache.max_rows)), tuple(extents), tuple(sorted(trees)))


def settle_engine(engine: Engine, params: SamplingParams) -> None:
    """Run every shape of `menu_of` once (`settle_target`), and the drafters' compiled shapes (`Drafter.settle`),
    before a call's first step, unless the same caches have met them for the same sampling setting already: the
    call's steps then compile and record nothing. A no-op unless ``engine``'s steps run compiled."""
    caches = (engine.cache, *(c for d in engine.drafters.values() for c in d.caches()))
    key = (dataclasses.replace(params, max_new_tokens=1, stop=()), *(c.serial for c in caches))
    if not engine.target.compiled or key in engine.settled:
        return
    menu, t0 = menu_of(engine), time.perf_counter()
    settle_target(engine.target, *decoder_and_head(engine.model), engine.cache, menu, params)
    shapes = tree_shapes(engine)
    for drafter in engine.drafters.values():
        drafter.settle(list(menu.rows), [s for s in shapes if drafter in engine.drafters_of(s)])
    engine.settled.add(key)
    logger.info("compiled decoding steps settled in %.1f s: %s", time.perf_counter() - t0, menu.describe())


def settle_target(
    target: TargetStep, decoder: nn.Module, head: nn.Module, cache: RowCache, menu: ShapeMenu, params: SamplingParams
) -> None:
    """Run ``target``'s plain step at every rows and extent of ``menu``, and its tree step for every tree there too,
    as many times as a new shape runs before its graph replays (`TargetStep.warm_calls`), on dummy inputs sampled
    with ``params`` (`fastgrpo.rollout.engine.RolloutEngine.settle`). They write finite values into ``cache`` slots
    that every step overwrites before it reads them."""
    device, noise = cache.layers[0].keys.device, not params.greedy
    for rows, extent, _ in itertools.product(menu.rows, menu.extents, range(target.warm_calls(device))):
        zeros = torch.zeros(rows, dtype=torch.long, device=device)
        uniforms = torch.zeros(rows, dtype=torch.float64, device=device) if noise else None
        target.plain(decoder, head, cache, zeros, zeros + extent - 1, [extent - 1] * rows, uniforms, params)
        for nodes, depth in menu.trees:
            tree = star_tree(rows, nodes, depth, device)
            uniforms = torch.zeros(rows, depth + 1, dtype=torch.float64, device=device) if noise else None
            lengths = [extent - nodes] * rows
            target.tree(decoder, head, cache, tree, zeros + extent - nodes, lengths, uniforms, params)


def star_tree(rows: int, nodes: int, levels: int, device: torch.device) -> DraftTree:
    """``[rows, nodes]`` trees whose draft nodes are all children of the root, of acceptance depth ``levels``: the
    shapes of a real tree of that size, with scores, for `settle_target` and the drafters' `Drafter.settle`."""
    index = torch.arange(nodes, device=device).expand(rows, nodes)
    parent = torch.where(index > 0, 0, -1)
    depth = (index > 0).long()
    ancestors = (index[:, :, None] == index[:, None, :]) | (index[:, None, :] == 0)
    score = torch.zeros(rows, nodes, dtype=torch.float64, device=device)
    return DraftTree(torch.zeros_like(index), parent, depth, ancestors, index.clone(), levels, score)
