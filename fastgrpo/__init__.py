"""fastgrpo: GRPO fine-tuning with speculative rollouts. ``from fastgrpo import GRPOConfig, GRPOTrainer`` takes TRL's
form, ``GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)``, as well as fastgrpo's.
Both are imported when first asked for, so that ``fastgrpo --help`` loads neither torch nor transformers."""

from __future__ import annotations

from typing import Any

__all__ = ["GRPOConfig", "GRPOTrainer"]


def __getattr__(name: str) -> Any:
    if name == "GRPOConfig":
        from fastgrpo.config import GRPOConfig

        return GRPOConfig
    if name == "GRPOTrainer":
        from fastgrpo.grpo.trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module 'fastgrpo' has no attribute {name!r}")
