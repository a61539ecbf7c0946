"""A run resumed from its checkpoint: the optimizer, schedule, master weights, drafters, random generators and
counters of the trainer it was saved by."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from fastgrpo import distributed
from fastgrpo.grpo.checkpoint import set_rng_state
from fastgrpo.training_rollouts import DRAFT_DIR, drafts_folder

logger = logging.getLogger(__name__)


def restore_run(trainer: Any, checkpoint: Path, state: dict[str, Any]) -> None:
    """Give ``trainer`` (a `GRPOTrainer` whose model holds the checkpoint's weights) the rest of ``checkpoint``'s
    ``state``; a rollout process, which trains nothing, takes its drafters, generators and counters only."""
    update = trainer.update
    if update is not None:
        distributed.load_optimizer_state(update.policy, update.optimizer, state["optimizer"])
        update.scheduler.load_state_dict(state["scheduler"])
        if update.keeps_masters:
            if "master_weights" not in state:
                raise ValueError(
                    f"--resume: {checkpoint} holds no float32 master weights (it was saved by a run of another "
                    "dtype, or without them): resume with the dtype it was saved with, or with master_weights: "
                    "false to go on in low precision"
                )
            update.load_masters(state["master_weights"])
        elif "master_weights" in state:
            update.load_masters_unless_kept(state["master_weights"])
        if "entropy_control" in state:
            update.entropy.load_state_dict(state["entropy_control"])
    # first: loading a draft draws from the random generators; a rollout process reads its own drafters
    folder = drafts_folder(torch.distributed.get_rank(), trainer.dist.shares) if trainer.dist.rollout else DRAFT_DIR
    trainer.rollouts.restore(checkpoint, folder)
    set_rng_state(state["rng"])
    trainer.start_step, trainer.num_tokens = state["step"], state.get("num_tokens", 0.0)
    trainer.generations_dropped = state.get("generations_dropped", 0)  # by an asynchronous run's training process
    trainer.resumed_from = checkpoint
    logger.info("resumed from %s at step %d", checkpoint, trainer.start_step)
