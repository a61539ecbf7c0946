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

from dataclasses import dataclass

from fastgrpo.rollout.compiled import EXTENT_BLOCK, row_bucket


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
