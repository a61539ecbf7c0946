"""Atomic checkpoints: the policy in transformers' own format plus the trainer state needed to resume.

A checkpoint is written to a temporary directory beside its final place and renamed into place, so a run that
dies mid-write leaves either the previous checkpoints or a complete new one, never a half-written one.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fastgrpo.grpo.run_dir import (
    CHECKPOINT_RE,
    MARK_FILE,
    RUN_FILE,
    claim_output_dir,
    mark,
    marked_by,
    read_run_id,
)
from fastgrpo.state_files import DamagedStateFile, UnsafeStateFile, load_data

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
# The layout of what a checkpoint holds (its state's keys, the files beside the state, draft/), saved in its state:
# resuming from a checkpoint of another layout is refused, never misread. Raise it whenever what is saved changes.
LAYOUT = 3  # 3: an asynchronous run's generations dropped


def rng_state() -> dict[str, Any]:
    """Python's and torch's random state, and the current GPU's generator where CUDA is in use (LoRA dropout and
    anything else sampled on the GPU draws from it)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` saved (the GPU generator on the current GPU, when both sides had one)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _umask() -> int:
    """The process's file-mode creation mask, read without changing it (Linux), else the usual 0o022."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def save_checkpoint(
    output_dir: Path,
    step: int,
    write_model: Callable[[Path], None],
    state: dict[str, Any],
    run_id: str,
    save_total_limit: int | None = None,
) -> Path:
    """Write ``output_dir/checkpoint-{step}`` atomically, marked as run ``run_id``'s.

    Args:
        write_model: writes the policy (and tokenizer) into the directory it is given.
        state: optimizer, scheduler and anything else to restore; the step and RNG state are added.
        save_total_limit: keep at most this many of the run's checkpoints (oldest removed first).
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"checkpoint-{step}"
    if final.exists() and not marked_by(final, run_id):
        raise ValueError(f"{final} exists and was not written by this run; it is left as it is")
    tmp = Path(tempfile.mkdtemp(prefix=f".checkpoint-{step}.", dir=output_dir))
    try:
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; a checkpoint is as readable as any other directory
        mark(tmp, run_id)
        write_model(tmp)
        torch.save({**state, "step": step, "rng": rng_state(), "layout": LAYOUT}, tmp / STATE_FILE)
        if final.exists():
            _remove(final)
        os.replace(tmp, final)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(output_dir).free / 2**30
        latest = latest_checkpoint(output_dir)
        raise ValueError(
            f"could not write {final}: {e} ({free:.1f} GiB free on its disk); the latest complete checkpoint is "
            f"{latest or 'none'}: make room and continue with --resume"
        ) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if save_total_limit is not None:
        for old in list_checkpoints(output_dir, run_id)[:-save_total_limit]:
            _remove(old)
    return final


def _remove(checkpoint: Path) -> None:
    """Delete a checkpoint directory: first renamed to a temporary name, so that a run killed while deleting leaves
    a temporary (removed by `fastgrpo.grpo.run_dir.remove_leftovers`), never a checkpoint with part of its files."""
    doomed = checkpoint.with_name(f".{checkpoint.name}.removing")
    os.replace(checkpoint, doomed)
    shutil.rmtree(doomed)


def list_checkpoints(output_dir: Path, run_id: str | None = None) -> list[Path]:
    """Complete checkpoints of run ``run_id`` (by default the run that owns ``output_dir``), oldest first."""
    if not output_dir.is_dir():
        return []
    run_id = run_id or read_run_id(output_dir)
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found) if (p / STATE_FILE).is_file() and marked_by(p, run_id)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def load_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state saved with a checkpoint (RNG state is restored by the caller via `set_rng_state`), read into
    host memory: rank 0 saved it from its own GPU, and each rank's optimizer moves its state to its parameters'
    device when it loads it."""
    return load_data(checkpoint / STATE_FILE)


def damage(checkpoint: Path) -> str | None:
    """Why a checkpoint cannot be resumed from, or None: a weights file whose header is unreadable (truncated or
    corrupt), a JSON file that does not parse (the model's and draft's configs, the controller's state), or another
    state file (the drafters' learners) whose archive is unreadable. The trainer state is checked by loading it
    (`load_state`). A state file that holds more than data is refused (`UnsafeStateFile`), not passed over."""
    from safetensors import safe_open

    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        try:
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt"):
                    pass
            elif path.suffix == ".json":
                json.loads(path.read_bytes())
            elif path.suffix == ".pt" and path.name != STATE_FILE:
                load_data(path, mmap=True)  # its archive is read, not its tensors' data
        except UnsafeStateFile:
            raise
        except DamagedStateFile as e:
            return f"{path.relative_to(checkpoint)} {e.reason}"
        except Exception as e:  # safetensors and torch.load raise their own types for a truncated or corrupt file
            return f"{path.relative_to(checkpoint)} is unreadable ({type(e).__name__}: {e})"
    return None


def load_latest_intact(output_dir: Path) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """The newest checkpoint whose weights and trainer state are readable and its state (None and None when there
    is none), and why each newer one was passed over."""
    passed = []
    for checkpoint in reversed(list_checkpoints(output_dir)):
        problem = damage(checkpoint)
        if problem is None:
            try:
                return checkpoint, load_state(checkpoint), passed
            except DamagedStateFile as e:
                problem = f"{STATE_FILE} {e.reason}"
        passed.append(f"{checkpoint.name}: {problem}")
    return None, None, passed


def prepare_output_dir(
    out: Path, resume: bool, overwrite: bool, main: bool
) -> tuple[Path | None, dict[str, Any] | None, str]:
    """Make ``out`` this run's (`fastgrpo.grpo.run_dir.claim_output_dir`; ``main``: this process writes, the others
    read the run's id after it) and pick the checkpoint to resume from: the newest of the run's whose weights and
    state are readable, refused unless it has this fastgrpo's `LAYOUT`. Returns it and its state (None and None for
    a new run), and the run's id."""
    if main:
        run_id = claim_output_dir(out, resume, overwrite)
    else:
        run_id = read_run_id(out)
        if run_id is None:
            raise FileNotFoundError(f"output_dir {out}: rank 0 made no run there")
    if not resume:
        return None, None, run_id
    checkpoint, state, passed = load_latest_intact(out)
    for reason in passed:
        logger.warning("--resume: passing over %s", reason)
    if checkpoint is None:
        intact, detail = (" intact", f" ({'; '.join(passed)})") if passed else ("", "")
        others = sorted(
            (p.name for p in out.iterdir() if CHECKPOINT_RE.match(p.name) and not marked_by(p, run_id)),
            key=lambda name: int(name.split("-")[1]),
        )
        if others:
            detail += (
                f" of the run whose {RUN_FILE} is there ({', '.join(others)} {'was' if len(others) == 1 else 'were'} "
                f"written by another run: its id is in their {MARK_FILE}; a run resumes with its own {RUN_FILE})"
            )
        raise FileNotFoundError(f"--resume: no{intact} checkpoint under {out}{detail}")
    layout = state.get("layout", 1) if isinstance(state, dict) else None
    if type(layout) is not int:
        raise ValueError(
            f"--resume: {checkpoint / STATE_FILE} holds {'no mapping' if layout is None else f'layout {layout!r}'}, "
            "not the whole-number layout a fastgrpo checkpoint records: it was not written by fastgrpo and cannot be "
            "resumed"
        )
    if layout != LAYOUT:
        age = "a newer" if layout > LAYOUT else "an older"
        raise ValueError(
            f"--resume: {checkpoint} was written by {age} fastgrpo (checkpoint layout {layout}, this one reads "
            f"{LAYOUT}) and cannot be resumed; start a new run from its weights with --model"
        )
    if "optimizer" not in state:
        raise ValueError(
            f"--resume: {checkpoint} was saved with save_only_model: true and holds no optimizer state to resume "
            "from; start a new run from its weights with --model instead"
        )
    return checkpoint, state, run_id
