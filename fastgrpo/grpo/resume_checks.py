"""What a resumed run must be to continue the run in its output directory, checked before its model loads."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastgrpo.config import GRPOConfig, config_to_dict
from fastgrpo.grpo.checkpoint import list_checkpoints
from fastgrpo.grpo.run_dir import check_disk_space, check_saves_ahead, checkpoints_written, resumed_options
from fastgrpo.grpo.run_log import logged_lines

logger = logging.getLogger(__name__)


def check_resumed(
    config: GRPOConfig,
    output_dir: Path,
    run_id: str,
    is_main: bool,
    checkpoint: Path,
    state: dict[str, Any],
    checkpoint_size: int,
) -> None:
    """Refuse a resumed run that would not continue the run in ``checkpoint`` (of ``output_dir``, its ``run_id``):
    options it may not change (`resumed_options`, against the options the checkpoint was saved with), ``max_steps``
    not beyond the checkpoint's step; and on the main process (``is_main``), a ``metrics.jsonl`` it cannot continue,
    another run's checkpoint where this one will save, and too little disk for the checkpoints still to come
    (``checkpoint_size`` bytes each)."""
    for change in resumed_options(output_dir, config_to_dict(config), state.get("config")):
        logger.warning("--resume: %s", change)
    done = state["step"]
    if config.max_steps <= done:
        raise ValueError(
            f"--resume: max_steps {config.max_steps} is not beyond the {done} steps the run in "
            f"{output_dir} has done ({checkpoint.name}); give a larger max_steps to train on"
        )
    if not is_main:
        return
    metrics = output_dir / "metrics.jsonl"
    if metrics.is_file():
        logged_lines(metrics)  # refused here, before the model loads, when it cannot be continued
    saves = [s for s in range(done + 1, config.max_steps + 1) if s % config.save_steps == 0 or s == config.max_steps]
    check_saves_ahead(output_dir, run_id, saves)
    existing = len(list_checkpoints(output_dir, run_id))
    written = checkpoints_written(done, config.max_steps, config.save_steps, config.save_total_limit, existing)
    check_disk_space(output_dir, checkpoint_size, written)
