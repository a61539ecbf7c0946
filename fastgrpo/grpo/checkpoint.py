"""Atomic checkpoints: the policy in transformers' own format plus the trainer state needed to resume.

A checkpoint is written to a temporary directory beside its final place and renamed into place, so a run that
dies mid-write leaves either the previous checkpoints or a complete new one, never a half-written one.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.pt"


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(
    output_dir: Path,
    step: int,
    write_model: Callable[[Path], None],
    state: dict[str, Any],
    save_total_limit: int | None = None,
) -> Path:
    """Write ``output_dir/checkpoint-{step}`` atomically.

    Args:
        write_model: writes the policy (and tokenizer) into the directory it is given.
        state: optimizer, scheduler and anything else to restore; the step and RNG state are added.
        save_total_limit: keep at most this many checkpoints (oldest removed first).
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"checkpoint-{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".checkpoint-{step}.", dir=output_dir))
    try:
        write_model(tmp)
        torch.save({**state, "step": step, "rng": rng_state()}, tmp / STATE_FILE)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if save_total_limit is not None:
        for old in list_checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(old)
    return final


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints under ``output_dir``, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found) if (p / STATE_FILE).is_file()]


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def load_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state saved with a checkpoint (RNG state is restored by the caller via `set_rng_state`)."""
    return torch.load(checkpoint / STATE_FILE, weights_only=False)
