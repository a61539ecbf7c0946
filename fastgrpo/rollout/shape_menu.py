"""The shapes a run's compiled decoding steps can meet, known before the first step: every row bucket and every tree
the controller may choose. The engine runs each of them once before a call's first step
(`fastgrpo.rollout.engine.RolloutEngine.settle`), as vLLM and SGLang capture their batch sizes at start-up, so that
nothing compiles or records a CUDA graph while a rollout runs, and no step's time is the compiler's.

Compiled steps take their rows and tree sizes as symbolic sizes (``torch.compile(dynamic=True)``,
`fastgrpo.rollout.compiled`) and read the keys over the whole cache (flex attention skips the blocks past each row's
length): the target compiles one graph per set of sampling filters (top-k, top-p, min-p; every temperature and
greedy decoding alike, `fastgrpo.rollout.graph_sampling`) for its plain step, and one for its tree step, whose
acceptance walk (an unrolled loop) is as deep as the deepest tree the run may verify (`walk_depth`: a walk past a
tree's deepest node accepts nothing more). On a GPU each (rows, tree size) is then a CUDA graph of its own, recorded
at start-up.
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
from fastgrpo.rollout.compiled import row_bucket
from fastgrpo.rollout.drafter import Drafter
from fastgrpo.rollout.forward import decoder_and_head
from fastgrpo.rollout.graph_sampling import GraphSampling
from fastgrpo.rollout.scheduling import Controller
from fastgrpo.rollout.target_step import TargetStep
from fastgrpo.rollout.tree import DraftTree, TreeShape, empty_tree
from fastgrpo.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Engine(Protocol):
    """What settling reads of a `fastgrpo.rollout.engine.RolloutEngine`."""

    model: nn.Module
    target: TargetStep
    cache: RowCache
    controller: Controller | None
    drafters: dict[str, Drafter]
    settled: set[tuple]  # (sampling filters, caches' serials) whose shapes have all run, for the current drafters

    def drafters_of(self, shape: TreeShape) -> list[Drafter]: ...

    def tree_depth(self, shape: TreeShape) -> int: ...


def row_buckets(max_rows: int) -> list[int]:
    """Every row count a compiled step over at most ``max_rows`` live rows computes (`row_bucket`): 2, 4, ... up to
    ``row_bucket(max_rows)``."""
    top = row_bucket(max_rows)
    return [1 << i for i in range(1, top.bit_length())]


def depth_bucket(levels: int) -> int:
    """The acceptance walk's depth of a compiled merge of trees of up to ``levels`` levels: the smallest power of two
    at or above it."""
    return 1 << (levels - 1).bit_length()


@dataclass(frozen=True)
class ShapeMenu:
    """The shapes of a run's compiled target steps: ``rows`` (`row_buckets`), ``extent`` the slots every step's keys
    span (`read_slots` of the cache), ``nodes`` the size of every tree the controller may choose and ``depth`` the
    acceptance walk's depth of every tree step (`walk_depth`)."""

    rows: tuple[int, ...]
    extent: int
    nodes: tuple[int, ...]
    depth: int

    @property
    def graphs(self) -> int:
        """Graphs the target's steps compile per set of sampling filters: the plain step's, and the tree step's."""
        return 1 + bool(self.nodes)

    @property
    def recordings(self) -> int:
        """CUDA graphs the target's steps record on a GPU per set of sampling filters: one per rows of the plain step,
        and per (rows, nodes) of the tree step."""
        return len(self.rows) * (1 + len(self.nodes))

    def describe(self) -> str:
        return (
            f"{len(self.rows)} row buckets ({', '.join(map(str, self.rows))}) x {1 + len(self.nodes)} step kinds "
            f"(plain, trees of {', '.join(map(str, self.nodes)) or 'none'} nodes, walked {self.depth} deep) over "
            f"{self.extent} slots: {self.graphs} graphs, {self.recordings} shapes"
        )


def tree_shapes(engine: Engine) -> list[TreeShape]:
    """Every tree shape ``engine``'s controller may choose (none without one)."""
    return [] if engine.controller is None else [s for s in engine.controller.shapes if s.speculative]


def walk_depth(engine: Engine) -> int:
    """The acceptance walk's depth of ``engine``'s compiled tree steps: that of the deepest tree its controller may
    choose (`Engine.tree_depth`), so that one graph verifies them all."""
    return max((engine.tree_depth(s) for s in tree_shapes(engine)), default=1)


def menu_of(engine: Engine) -> ShapeMenu:
    """The shapes ``engine``'s compiled target steps can meet over its current caches: its row buckets, and every
    tree size its controller may choose."""
    rows, nodes = tuple(row_buckets(engine.cache.max_rows)), tuple(sorted({s.nodes for s in tree_shapes(engine)}))
    return ShapeMenu(rows, read_slots(engine.cache.max_len), nodes, walk_depth(engine))


def settle_engine(engine: Engine, params: SamplingParams) -> None:
    """Run every shape of `menu_of` once (`settle_target`), and the drafters' compiled shapes (`Drafter.settle`),
    before a call's first step, unless the same caches have met them for the same sampling filters already: the
    call's steps then compile and record nothing. A no-op unless ``engine``'s steps run compiled."""
    caches = (engine.cache, *(c for d in engine.drafters.values() for c in d.caches()))
    key = (GraphSampling.filters(params), *(c.serial for c in caches))  # every temperature, greedy too, alike
    if not engine.target.compiled or key in engine.settled:
        return
    menu, t0 = menu_of(engine), time.perf_counter()
    settle_target(engine.target, *decoder_and_head(engine.model), engine.cache, menu, params)
    shapes = tree_shapes(engine)
    for drafter in engine.drafters.values():
        drafter.settle(list(menu.rows), [s for s in shapes if drafter in engine.drafters_of(s)])
    if engine.controller is not None:
        engine.controller.drafters_settled()
    engine.settled.add(key)
    logger.info("compiled decoding steps settled in %.1f s: %s", time.perf_counter() - t0, menu.describe())


def settle_target(
    target: TargetStep, decoder: nn.Module, head: nn.Module, cache: RowCache, menu: ShapeMenu, params: SamplingParams
) -> None:
    """Run ``target``'s plain step at every rows of ``menu``, and its tree step for every tree size there too, as many
    times as a new shape runs before its graph replays (`TargetStep.warm_calls`), on dummy inputs sampled with
    ``params`` (`fastgrpo.rollout.engine.RolloutEngine.settle`). They write finite values into ``cache`` slots that
    every step overwrites before it reads them."""
    device, noise, extent = cache.layers[0].keys.device, not params.greedy, menu.extent
    for rows, _ in itertools.product(menu.rows, range(target.warm_calls(device))):
        zeros = torch.zeros(rows, dtype=torch.long, device=device)
        uniforms = torch.zeros(rows, dtype=torch.float64, device=device) if noise else None
        target.plain(decoder, head, cache, zeros, zeros + extent - 1, [extent - 1] * rows, uniforms, params)
        for nodes in menu.nodes:
            tree = star_tree(rows, nodes, menu.depth, device)
            uniforms = torch.zeros(rows, menu.depth + 1, dtype=torch.float64, device=device) if noise else None
            start = extent - max(nodes, menu.depth + 1)  # the walk's moves, however deep, stay inside the cache
            target.tree(decoder, head, cache, tree, zeros + start, [start] * rows, uniforms, params)


def star_tree(rows: int, nodes: int, levels: int, device: torch.device) -> DraftTree:
    """``[rows, nodes]`` trees whose draft nodes are all children of the root, of acceptance depth ``levels``: the
    shapes of a real tree of that size, with scores, for `settle_target` and the drafters' `Drafter.settle`
    (`empty_tree`'s, its scores 0)."""
    tree = empty_tree(rows, nodes, levels, device)
    return dataclasses.replace(tree, score=torch.zeros_like(tree.score))
