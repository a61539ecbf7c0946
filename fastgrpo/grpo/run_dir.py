"""A run owns its ``output_dir``: it marks what it writes, deletes nothing it did not write, and holds a lock on the
directory while it runs.

``fastgrpo_run.json`` names the run (a random id); every checkpoint, and every temporary of one, holds the id in
``fastgrpo_run_id``. Only entries carrying the id (and the run's own files: ``config.yaml``, ``metrics.jsonl``, its
``report/`` and ``tensorboard/``) are ever deleted, so a TRL checkpoint or anything else found there survives. A new
run refuses a directory that holds anything, unless ``overwrite_output_dir``: then the earlier fastgrpo run's files
are deleted and everything else is kept. The lock is an exclusive ``flock`` on ``.fastgrpo.lock``: the system
releases it when its process ends however it ends, so a dead run's lock never blocks the next one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import yaml

from fastgrpo.paths import free_bytes, size_text, write_atomically

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from fastgrpo.config import GRPOConfig

logger = logging.getLogger(__name__)

RUN_FILE = "fastgrpo_run.json"
MARK_FILE = "fastgrpo_run_id"
LOCK_FILE = ".fastgrpo.lock"
RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", "report", "tensorboard")  # what a run writes besides checkpoints
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")  # a checkpoint's directory
# what `fastgrpo.paths.write_atomically` leaves of the run's own files when killed while writing them
TEMPORARIES = tuple(f".{name}.tmp" for name in (RUN_FILE, "config.yaml", "metrics.jsonl"))


class DirectoryLock:
    """An exclusive lock on ``directory`` for as long as this object holds it (`release`, or the process's end)."""

    def __init__(self, directory: Path):
        import fcntl

        path = directory / LOCK_FILE
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if path.is_symlink():
                raise ValueError(f"{path} is a symbolic link: a run writes no file through a link; remove it")
            # O_NOFOLLOW: a link made after the check is refused too, never followed to truncate its target
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
            self.file: IO[str] | None = os.fdopen(fd, "a+")
        except OSError as e:
            raise ValueError(f"output_dir {directory} cannot be written: {path}: {e.strerror or e}") from None
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            self.file = None
            raise ValueError(
                f"output_dir {directory} is in use by another run ({holder}); wait for it to end, or choose "
                "another output_dir"
            ) from None
        self.file.seek(0)
        self.file.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
        self.file.flush()

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # closing the file releases the lock
            self.file = None


def checkpoints_written(
    start_step: int, max_steps: int, save_steps: int, save_total_limit: int | None, existing: int = 0
) -> int:
    """How many more checkpoints than the ``existing`` ones a run from ``start_step`` to ``max_steps`` holds on disk
    at once at most: it saves every ``save_steps`` and at the end, keeping at most ``save_total_limit`` (its
    existing ones included) plus the one being written before the oldest is removed."""
    steps = range(start_step + 1, max_steps + 1)
    saves = sum(1 for step in steps if step % save_steps == 0 or step == max_steps)
    peak = existing + saves if save_total_limit is None else min(existing + saves, max(existing, save_total_limit) + 1)
    return max(peak - existing, 0)


def check_disk_space(out: Path, checkpoint_bytes: int, checkpoints: int, freed: int = 0) -> None:
    """Refuse a run whose ``checkpoints`` more checkpoints (`checkpoints_written`) of ``checkpoint_bytes`` each cannot
    fit on ``out``'s disk (``out`` need not exist yet), ``freed`` bytes there being deleted first (an overwritten
    run's); warn when they leave less than a tenth of the free space."""
    free = free_bytes(out) + freed
    needed = checkpoint_bytes * checkpoints
    if needed > free:
        raise ValueError(
            f"output_dir {out}: its checkpoints need about {size_text(needed)} ({checkpoints} more of "
            f"{size_text(checkpoint_bytes)} on disk at once), more than the {size_text(free)} free on its disk; free "
            "space, lower save_total_limit, set save_only_model: true, or choose another output_dir"
        )
    if needed > 0.9 * free:
        logger.warning(
            "output_dir %s: its checkpoints will take %s of the %s free", out, size_text(needed), size_text(free)
        )


def read_run_id(out: Path) -> str | None:
    """The id of the run that owns ``out`` (None when no fastgrpo run wrote there)."""
    try:
        return json.loads((out / RUN_FILE).read_text())["id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mark(directory: Path, run_id: str) -> None:
    """Record in ``directory`` (a checkpoint, or its temporary) that run ``run_id`` wrote it."""
    (directory / MARK_FILE).write_text(run_id + "\n")


def marked_by(directory: Path, run_id: str | None) -> bool:
    try:
        return run_id is not None and (directory / MARK_FILE).read_text().strip() == run_id
    except OSError:
        return False


def _new_run(out: Path) -> str:
    run_id = uuid.uuid4().hex
    write_atomically(out / RUN_FILE, json.dumps({"id": run_id, "created": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    return run_id


def _owned(out: Path, run_id: str | None) -> list[Path]:
    """What in ``out`` belongs to the fastgrpo run ``run_id``: its own files and whatever carries its mark."""
    if run_id is None:
        return []
    own = (RUN_FILE, *RUN_OUTPUTS, *TEMPORARIES)
    return [p for p in out.iterdir() if p.name in own or (p.is_dir() and marked_by(p, run_id))]


def _written_by_runs(name: str) -> bool:
    """Whether a fastgrpo run writes (or deletes) a path of this name in its output_dir."""
    return (
        name in (RUN_FILE, LOCK_FILE, *RUN_OUTPUTS, *TEMPORARIES)
        or bool(CHECKPOINT_RE.match(name))
        or name.startswith(".checkpoint-")
    )


def _refuse_links(out: Path) -> None:
    """Refuse an output_dir where a path the run writes is a symbolic link: a run never writes or deletes through
    one (it would write into, truncate or delete what the link points to)."""
    links = sorted(p.name for p in out.iterdir() if p.is_symlink() and _written_by_runs(p.name))
    if links:
        raise ValueError(
            f"output_dir {out}: {', '.join(links)} {'is a symbolic link' if len(links) == 1 else 'are symbolic links'}"
            ", where the run writes its own files; a run writes and deletes nothing through a link: remove "
            f"{'it' if len(links) == 1 else 'them'} or choose another output_dir"
        )


def _earlier_run(out: Path, resume: bool, overwrite: bool) -> tuple[str | None, list[Path], list[str]]:
    """What `claim_output_dir` finds in ``out``: the id of the run there (None: none), what of it a new run deletes
    (with ``overwrite``) and the names it keeps; raises where ``out`` cannot be this run's."""
    _refuse_links(out)
    run_id = read_run_id(out)
    # a run file alone is a run that wrote nothing yet (a trainer built and not trained): the directory is free
    entries = [p for p in out.iterdir() if p.name not in (LOCK_FILE, RUN_FILE)]
    if resume:
        if run_id is None:
            raise FileNotFoundError(
                f"--resume: no checkpoint under {out} (no fastgrpo run wrote there; a directory written by a fastgrpo "
                "older than its run marks cannot be resumed)"
            )
        return run_id, [], []
    if not entries:
        return run_id, [], []
    owned = _owned(out, run_id)
    foreign = sorted(p.name for p in entries if p not in owned)
    if not overwrite:
        a_run = run_id is not None
        what = "another run" if a_run else "files that no fastgrpo run wrote"
        names = ", ".join(sorted(p.name for p in entries)[:8]) + (", ..." if len(entries) > 8 else "")
        resumable = a_run and any(CHECKPOINT_RE.match(p.name) and marked_by(p, run_id) for p in entries)
        if a_run and not resumable:
            what += " that saved no checkpoint yet (so --resume cannot continue it)"
        raise ValueError(
            f"output_dir {out} holds {what} ({names}): "
            + ("continue it with --resume, " if resumable else "")
            + "choose another output_dir, or start a new run there with --overwrite_output_dir true (which "
            "deletes an earlier fastgrpo run's files and keeps everything else)"
        )
    clashing = [name for name in foreign if _written_by_runs(name)]
    if (out / RUN_FILE).exists() and run_id is None:
        clashing.insert(0, RUN_FILE)
    if clashing:
        raise ValueError(
            f"output_dir {out} holds {', '.join(clashing)}, which "
            + ("no fastgrpo run wrote" if run_id is None else "the run there did not write")
            + " and which this run would write over; overwrite_output_dir keeps what it did not write, so move "
            f"{'it' if len(clashing) == 1 else 'them'} away or choose another output_dir"
        )
    return run_id, owned, foreign


def check_output_dir(out: Path, resume: bool, overwrite: bool) -> int:
    """Refuse now what `claim_output_dir` would refuse, deleting nothing (a run checks this before its long set-up and
    claims the directory after it); returns the bytes an overwrite would free there."""
    if not out.is_dir():
        return 0
    _, owned, _ = _earlier_run(out, resume, overwrite)
    files = [f for path in owned for f in ([path] if not path.is_dir() else path.rglob("*"))]
    return sum(f.lstat().st_size for f in files if not f.is_dir())


def claim_output_dir(out: Path, resume: bool, overwrite: bool) -> str:
    """Make ``out`` this run's and return the run's id (the caller holds the directory's `DirectoryLock`).

    A new run needs an empty directory; with ``overwrite`` it deletes the earlier fastgrpo run's files there and keeps
    everything else, and refuses (before deleting anything) a directory where something the earlier run did not
    write has the name of a file the run writes. ``resume`` continues the run found there. Temporaries the run left
    behind when it was killed are removed."""
    out.mkdir(parents=True, exist_ok=True)
    run_id, owned, foreign = _earlier_run(out, resume, overwrite)
    if owned or foreign:
        for path in owned:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        if owned:
            logger.warning("overwrite_output_dir: deleted the earlier run's files in %s", out)
        if foreign:
            logger.warning("overwrite_output_dir: kept what no fastgrpo run wrote there: %s", ", ".join(foreign))
        run_id = None
    if run_id is None:
        run_id = _new_run(out)
    for path in remove_leftovers(out, run_id):
        logger.warning("removed %s, left behind by an interrupted run", path)
    return run_id


def check_saves_ahead(out: Path, run_id: str, steps: list[int]) -> None:
    """Refuse a resumed run of ``run_id`` where a checkpoint it did not write sits at a step it will save (``steps``):
    the run would stop there, its steps since the last save lost."""
    others = [f"checkpoint-{s}" for s in steps if (out / f"checkpoint-{s}").exists()]
    others = [name for name in others if not marked_by(out / name, run_id)]
    if others:
        raise ValueError(
            f"--resume: {out} holds {', '.join(others)}, which this run did not write and would save over; move "
            f"{'it' if len(others) == 1 else 'them'} away"
        )


def remove_leftovers(out: Path, run_id: str) -> list[Path]:
    """Delete the temporaries of saves and deletions (``.checkpoint-*``) that carry ``run_id``'s mark, and those of
    the run's own files (`TEMPORARIES`). Returns what was removed."""
    removed = []
    for path in sorted(out.iterdir()):
        if path.name.startswith(".checkpoint-") and path.is_dir() and marked_by(path, run_id):
            shutil.rmtree(path)
            removed.append(path)
        elif path.name in TEMPORARIES and not path.is_symlink():
            path.unlink()
            removed.append(path)
    return removed


# Options a resumed run may change: how long it runs and what it logs and saves, where and how fast it computes
# (speculation and the draft change how fast completions come, never what they are). Any other change would mix two
# runs in one, and is refused.
SAFE_TO_CHANGE = {
    "max_steps", "num_train_epochs", "save_steps", "save_total_limit", "save_only_model", "logging_steps",
    "log_completions", "num_completions_to_print", "log_completions_steps", "progress_bar", "report_to",
    "overwrite_output_dir", "cpu_threads", "device", "ddp_timeout", "check_memory", "fsdp", "gradient_checkpointing",
    "dtype", "master_weights", "logprob_chunk_tokens", "compile", "reward_timeout", "tool_timeout", "tool_workers",
    "heartbeat_stale_after_s",
}  # fmt: skip
OPTION_GROUPS = ("dataset", "eval_dataset", "speculation", "draft_training")  # options of their own, `name.option`
SAFE_PREFIXES = ("speculation.", "draft_training.")


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _unknown_options(on_disk: dict[str, Any], given: dict[str, Any]) -> list[str]:
    """The keys of ``on_disk`` (a run's config.yaml) that name no option of ``given`` (all the options): at the top,
    and within the option groups (`OPTION_GROUPS`); the keys of an option whose value is a mapping of the user's
    (``chat_template_kwargs``) are not options."""
    unknown = [key for key in on_disk if key not in given]
    for group in OPTION_GROUPS:
        inner, known = on_disk.get(group), given.get(group)
        if isinstance(inner, dict) and isinstance(known, dict):
            unknown += [f"{group}.{key}" for key in inner if key not in known]
    return sorted(unknown)


def resumed_options(out: Path, given: dict[str, Any], saved: dict[str, Any] | None = None) -> list[str]:
    """Check the options of a resumed run (``given``, as `fastgrpo.config.config_to_dict` makes them) against those
    the run was started with: ``saved``, those its checkpoint was written with, else (a checkpoint of an older
    fastgrpo) its ``out/config.yaml``. Raise ``ValueError`` listing every option that differs and may not change
    (with its saved and given value); return a line for each that may (`SAFE_TO_CHANGE`), and one where
    ``config.yaml`` is missing, empty or unreadable (the run rewrites it); refuse a ``config.yaml`` key that names no
    option (a typo added to it would be dropped). Options the saved ones do not hold (added to fastgrpo since) are
    taken as they are given; ``output_dir`` is not compared: the run is the one whose run file
    the directory holds, however it is spelt and wherever it moved."""
    path = out / "config.yaml"
    notes = []
    try:
        on_disk = yaml.safe_load(path.read_text()) if path.is_file() else None
        problem = None if isinstance(on_disk, dict) else "missing" if not path.is_file() else "empty or not options"
    except (OSError, ValueError, yaml.YAMLError) as e:  # ValueError: not UTF-8 text
        on_disk, problem = None, f"unreadable ({type(e).__name__})"
    now = _flatten(given)
    unknown = _unknown_options(on_disk, given) if problem is None else []
    if unknown:
        raise ValueError(
            f"--resume: {path} holds {', '.join(unknown)}, which no fastgrpo option is named: a resumed run would drop "
            "it and write config.yaml over; remove it from config.yaml (or give the option it was meant to be)"
        )
    if saved is None:
        if problem == "missing":
            return []
        if problem is not None:
            raise ValueError(
                f"--resume: {path} is {problem} and the run's checkpoint, written by an older fastgrpo, holds no copy "
                "of the options the run was started with; restore config.yaml, or start a new run"
            )
        saved = on_disk
    elif problem is not None:
        notes.append(f"{path} is {problem}: it is written again with this run's options (the checkpoint's, and the "
                     "changes listed here)")  # fmt: skip
    saved = _flatten(saved or {})
    compared = sorted(saved.keys() & now.keys() - {"output_dir"})
    changed = {k: (saved[k], now[k]) for k in compared if saved[k] != now[k]}
    refused = {k: v for k, v in changed.items() if k not in SAFE_TO_CHANGE and not k.startswith(SAFE_PREFIXES)}
    if refused:
        listed = "; ".join(f"{k}: {old!r} when started, {new!r} now" for k, (old, new) in refused.items())
        raise ValueError(
            f"--resume: the run in {out} was started with other options, and a resumed run keeps them: {listed}. "
            "Give the values it was started with (its config.yaml), or start a new run"
        )
    return notes + [f"{k} changes from {old!r} to {new!r}" for k, (old, new) in changed.items()]


def checkpoint_bytes(config: GRPOConfig, model_config: PretrainedConfig, device: Any) -> int:
    """About what one checkpoint of the run takes on disk: the policy's weights (a LoRA run's adapters only), and
    unless ``save_only_model`` AdamW's two moments with float32 master weights where the weights are low precision;
    each drafter's files and learner's state (`DrafterPlugin.checkpoint_bytes`), of every rollout process."""
    from fastgrpo.memory.shapes import lora_shape
    from fastgrpo.memory_plan.plan import planned_run
    from fastgrpo.speculative.registry import plugins

    run = planned_run(config, model_config, device)
    shape, width = run.shape, run.dtype_bytes
    # AdamW's state per trained parameter: two moments in the parameter's dtype, or float32 moments and masters
    adam_state = 2 * width if width >= 4 else 12
    if config.use_peft:  # peft keeps the adapters in float32
        trained = lora_shape(shape, config).params
        weights, state = trained * 4, 8
    else:
        trained = shape.num_parameters()
        weights, state = trained * width, adam_state
    optimizer = 0 if config.save_only_model else trained * state
    drafts = sum(plugin.checkpoint_bytes(run) for plugin in plugins(config.speculation))
    return weights + optimizer + drafts * max(config.rollout_processes, 1)  # each rollout process's own
