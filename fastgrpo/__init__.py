"""fastgrpo: GRPO fine-tuning with speculative rollouts. ``from fastgrpo import GRPOConfig, GRPOTrainer`` takes TRL's
form, ``GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)``, as well as fastgrpo's."""

from fastgrpo.config import GRPOConfig
from fastgrpo.grpo.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
