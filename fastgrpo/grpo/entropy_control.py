"""The entropy bonus's coefficient: `entropy_coef`, fixed, or with ``use_adaptive_entropy`` moved after every
optimizer step towards a target entropy (Skywork-OR1's adaptive entropy control, as TRL runs it)."""

from __future__ import annotations

import math
from typing import Any

from fastgrpo.config import GRPOConfig


class EntropyControl:
    """The coefficient of the entropy bonus of ``config``: `applied` is what the next optimizer step subtracts times
    the mean entropy of its tokens; with ``use_adaptive_entropy`` `observe` takes each step's entropy (all processes'
    tokens together), raising the coefficient by ``entropy_coef_delta`` (up to ``entropy_coef_max``) while it is at
    or below ``entropy_target`` and lowering it (down to ``entropy_coef_min``) otherwise, and the bonus applies only
    after a step whose entropy was at or below the target (none before the first)."""

    def __init__(self, config: GRPOConfig):
        self.config = config
        self.coef = config.entropy_coef
        self.last_entropy = math.inf

    @property
    def enabled(self) -> bool:
        """Whether the loss has the bonus (fixed and above 0, or adaptive whatever its value now)."""
        return self.config.entropy_coef != 0 or self.config.use_adaptive_entropy

    def applied(self) -> float:
        """The coefficient the next optimizer step applies."""
        if self.config.use_adaptive_entropy and self.last_entropy > self.config.entropy_target:
            return 0.0
        return self.coef

    def observe(self, entropy_sum: float, tokens: float) -> None:
        """A step's entropies: their sum over its trained tokens of every process, and those tokens' count."""
        cfg = self.config
        if not cfg.use_adaptive_entropy:
            return
        entropy = entropy_sum / max(tokens, 1.0)
        if entropy <= cfg.entropy_target:
            self.coef = min(self.coef + cfg.entropy_coef_delta, cfg.entropy_coef_max)
        else:
            self.coef = max(self.coef - cfg.entropy_coef_delta, cfg.entropy_coef_min)
        self.last_entropy = entropy

    def state_dict(self) -> dict[str, Any]:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef, self.last_entropy = float(state["entropy_coef"]), float(state["last_world_entropy"])
