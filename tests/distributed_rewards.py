"""Reward functions the distributed tests name as ``distributed_rewards:...`` (their processes import them)."""

from __future__ import annotations

import os


def length_reward(completions: list[str], **kwargs) -> list[float]:
    """Varies across random completions, so that advantages, and so the updates, are not zero."""
    return [float(len(c) % 7) for c in completions]


def fail_on_rank_1(completions: list[str], **kwargs) -> list[float]:
    """Raises on rank 1 (and only there), as a user's reward function with a bug would."""
    if os.environ.get("RANK") == "1":
        raise RuntimeError("reward function failed on rank 1")
    return length_reward(completions)


def length_reward_after_step_1(completions: list[str], trainer_state, **kwargs) -> list[float]:
    """`length_reward`, but the same for every completion of step 1's generation: its advantages are 0 and its update
    runs no backward."""
    if trainer_state.global_step == 0:
        return [0.0] * len(completions)
    return length_reward(completions)
