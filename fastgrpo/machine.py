"""What a measurement of this machine's speed is keyed by when it is cached on disk: a CPU's model and instruction
set, the thread count, and the torch version (a profile or a linear-layer route measured on an AVX-512 CPU, or with
another torch's kernels, is wrong here), and how such a measurement is written to the cache."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what the platform says where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def file_key(*parts: str) -> str:
    """``parts`` joined into one file-name-safe key."""
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", part) for part in parts)


def device_key(device: torch.device) -> str:
    """A GPU's name, or the CPU's model, instruction set and thread count; with the torch version."""
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = f"cpu-{cpu_model()}-{torch.backends.cpu.get_cpu_capability()}-{torch.get_num_threads()}threads"
    return file_key(hardware, f"torch{torch.__version__}")


def write_atomically(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary of this process beside it, renamed into place: a reader never
    sees half a file, and processes that write the same file at once (ranks measuring alike) do not collide."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
