"""FastGRPO's concurrency-aware rule (`PaperController`): from the verification capacity ``C_peak``,
``N = clamp(C_peak // B, 1, N_max)``, ``K = min(N - 1, K_max)``, ``L = clamp(floor(log2(N / alpha)), L_min, L_max)``;
and the paper's tree for a number of verified tokens (`shape_for`), which the adaptive controller's candidates are
too."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fastgrpo.config import ControllerLimits
from fastgrpo.rollout.scheduling import AUTOREGRESSIVE, StatelessController
from fastgrpo.rollout.tree import TreeShape


def shape_for(limits: ControllerLimits, n_verify: int, drafter: str = "") -> TreeShape:
    """The paper's tree for ``n_verify`` verified tokens per row (autoregressive for 1), drafted by ``drafter``."""
    n = max(1, min(n_verify, limits.n_max))
    if n == 1:
        return AUTOREGRESSIVE
    k = min(n - 1, limits.k_max)
    depth = min(max(math.floor(math.log2(n / limits.alpha)), limits.l_min), limits.l_max)
    return TreeShape(n, k, depth, drafter)


def largest_shape(limits: ControllerLimits) -> TreeShape:
    """The bounds of every shape the limits allow."""
    return TreeShape(limits.n_max, limits.k_max, limits.l_max)


@dataclass
class PaperController(StatelessController):
    """FastGRPO's concurrency-aware rule: ``N_verify = C_peak // B`` tokens per row, recomputed every step."""

    c_peak: int
    limits: ControllerLimits = field(default_factory=ControllerLimits)
    drafter: str = ""  # who drafts every tree (`TreeShape.drafter`)

    def __post_init__(self) -> None:
        if self.c_peak < 1:
            raise ValueError(f"c_peak must be >= 1, got {self.c_peak}")
        self.limits.validate()

    @property
    def max_shape(self) -> TreeShape:
        return largest_shape(self.limits)

    @property
    def shapes(self) -> list[TreeShape]:
        """The rule's shape at every row count (``N = 1`` from ``C_peak + 1`` rows on)."""
        chosen = {self.choose(rows) for rows in range(1, self.c_peak + 2)}
        return sorted(chosen, key=lambda s: (s.nodes, s.top_k, s.max_levels))

    def choose(self, rows: int, backlog: int = 0) -> TreeShape:
        return shape_for(self.limits, self.c_peak // max(rows, 1), self.drafter)
