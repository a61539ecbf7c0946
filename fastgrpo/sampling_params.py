"""How completions are sampled: the parameters every generation call takes (the engine, the trainers' configs)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def argmax(self) -> None:
        """Rows drawn by argmax though sampled: none (a compiled step's `fastgrpo.rollout.graph_sampling` has some)."""
        return None

    def noise(
        self, rows: int, generator: torch.Generator | None, uniforms: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor | None:
        """``[rows, max_new_tokens]`` float64 on ``device``: one uniform per (completion, position) that picks its
        sampled token (`fastgrpo.rollout.sampling.sample`), ``uniforms`` or drawn from ``generator``; None when
        greedy."""
        if self.greedy:
            return None
        if uniforms is None:
            where = generator.device if generator is not None else torch.device("cpu")
            uniforms = torch.rand((rows, self.max_new_tokens), generator=generator, dtype=torch.float64, device=where)
        return uniforms.to(device=device, dtype=torch.float64)
