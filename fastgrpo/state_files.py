"""Reading the ``.pt`` state files a run saves (a checkpoint's ``trainer_state.pt``, a drafters' ``learners.pt``) as
data only: ``torch.load(weights_only=True)``, whose unpickler builds tensors, numbers, strings and containers of them
and nothing else. A file that asks for more (a pickled call, as a tampered checkpoint holds) is refused before any of
it is built: its code never runs, and the message names the file and what it asked for."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch


class UnsafeStateFile(ValueError):
    """A state file that holds more than data (a pickled reference to a function or class fastgrpo never saves)."""


class DamagedStateFile(ValueError):
    """A state file that is not one `torch.save` wrote whole (empty, truncated, corrupt); ``reason`` says how, after
    the file's name (``is empty (EOFError)``)."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path} {reason}")
        self.reason = reason


def _refused_global(error: Exception) -> str | None:
    """The global (function or class) torch's restricted unpickler refused to build, from its message; None where it
    refused the file for another reason (a corrupt one)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    return found.group(1) if found else None


def _first_line(error: Exception) -> str:
    """The first specific line of a torch error (its weights-only preamble left out), or the error's type."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    specific = [line for line in lines if not line.startswith(("Weights only load failed", "Please file an issue"))]
    return f"{type(error).__name__}: {specific[0][:200]}" if specific else type(error).__name__


def load_data(path: Path, mmap: bool = False) -> Any:
    """The tensors and plain data `torch.save` wrote to ``path``, read into host memory (``mmap``: the archive is
    mapped, not its tensors' data read). A file that needs more than that is refused with `UnsafeStateFile`, one that
    cannot be read with `DamagedStateFile` (both one line naming the file); a missing file raises `OSError`."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except OSError:
        raise
    except Exception as e:  # torch raises several types (EOFError, RuntimeError, UnpicklingError, KeyError) per damage
        refused = _refused_global(e) if isinstance(e, pickle.UnpicklingError) else None
        if refused is not None:
            raise UnsafeStateFile(
                f"{path} holds more than data (a pickled reference to {refused}), which fastgrpo never saves: refused, "
                "and nothing of it was run or loaded; use a checkpoint this run wrote, or delete the file"
            ) from None
        empty = path.is_file() and path.stat().st_size == 0
        raise DamagedStateFile(path, f"is {'empty' if empty else 'unreadable'} ({_first_line(e)})") from None
