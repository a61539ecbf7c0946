"""The schedule stage of an engine step: a controller chooses each step's tree shape from the live number of active
rows (``nodes == 1``: a plain autoregressive step, no draft forward) and is told afterwards what the step cost and
how many draft tokens each row accepted. This module holds the interface and the fixed shape; the controllers that
adapt to the hardware and the draft live in `fastgrpo.speculative.controller`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fastgrpo.rollout.tree import TreeShape

AUTOREGRESSIVE = TreeShape(1, 1, 1)


class Controller(Protocol):
    """Chooses the tree shape of every engine step."""

    @property
    def max_shape(self) -> TreeShape:
        """Upper bounds of the nodes, top-k and depth it may ever choose (the engine sizes its caches by them)."""
        ...

    @property
    def shapes(self) -> list[TreeShape]:
        """Every shape it may choose (a compiled engine compiles each before a call's first step)."""
        ...

    def begin(self, draft_changed: bool = False) -> None:
        """A generation call starts; ``draft_changed`` when the draft's weights changed since the previous call
        (online draft learning), so that what was measured of its acceptance is out of date."""
        ...

    def choose(self, rows: int, backlog: int = 0) -> TreeShape:
        """The shape of the next step, with ``rows`` active rows; a speculative step first feeds the draft the
        ``backlog`` tokens per row it has not seen (those of the plain steps since its last tree)."""
        ...

    def observe(
        self,
        rows: int,
        shape: TreeShape,
        seconds: float | None,
        accepted: list[int] | None,
        path_rank: np.ndarray | None = None,
    ) -> float:
        """A step ran: its wall time (None when it compiled or warmed up a graph: that time is the compiler's) and,
        for a speculative step, the draft tokens each of the ``B`` rows accepted and (``[B, D]`` int64) the score rank
        of each accepted draft node (`DraftTree.rank`; at least ``N`` past the row's accepted ones), which tells what a
        smaller tree drafted from the same candidates would have accepted. Returns the seconds the step saved
        against plain steps emitting as many tokens, as far as it can tell (0.0 where it prices no step)."""
        ...

    def drafters_settled(self) -> None:
        """The drafters settled their compiled trees (`fastgrpo.rollout.drafter.Drafter.settle`): how deep a tree of
        each shape may go (`Drafter.deepest`) may have changed."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What it learnt from earlier steps, as JSON-able data (saved with a checkpoint, so that a resumed run
        chooses what the uninterrupted one would)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take up what `state_dict` saved."""
        ...


class StatelessController:
    """A controller whose choice does not depend on what earlier steps did: ``begin`` and ``observe`` do nothing."""

    def begin(self, draft_changed: bool = False) -> None:
        pass

    def drafters_settled(self) -> None:
        pass

    def observe(
        self,
        rows: int,
        shape: TreeShape,
        seconds: float | None,
        accepted: list[int] | None,
        path_rank: np.ndarray | None = None,
    ) -> float:
        return 0.0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@dataclass
class StaticController(StatelessController):
    """A fixed tree shape at every step."""

    shape: TreeShape

    @property
    def max_shape(self) -> TreeShape:
        return self.shape

    @property
    def shapes(self) -> list[TreeShape]:
        return [self.shape]

    def choose(self, rows: int, backlog: int = 0) -> TreeShape:
        return self.shape
