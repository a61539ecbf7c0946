"""What every benchmark records besides its printed tables: ``runs/bench/<benchmark>.json`` with the command, the
commit, the machine (CPU model and flags, cores, torch and transformers versions) and each table's rows, so that
``docs/benchmarks.md`` can be regenerated from it: ``python benchmarks/record.py runs/bench/bench_engine.json``.

A benchmark makes one `Record`, prints its tables through `Record.table` and calls `Record.save` at the end. It also
sets glibc to keep freed memory, as the ``fastgrpo`` command line does (`fastgrpo.malloc`)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def machine() -> dict[str, Any]:
    """The machine a figure was measured on."""
    import os

    import torch
    import transformers

    from fastgrpo.machine import cpu_model

    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "cpu": cpu_model(),
        "cpu_flags": [f for f in CPU_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def commit(directory: Path = REPO) -> str:
    """The commit checked out in ``directory``, with ``-dirty`` when tracked files have uncommitted changes;
    ``unknown`` where there is no git on the PATH or ``directory`` is not in a repository."""

    def git(*args: str) -> str:
        try:
            run = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True)
        except OSError:  # no git executable (or the directory is gone)
            return ""
        return run.stdout.strip() if run.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def markdown(columns: list[str], rows: list[list[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class Record:
    """The tables of one benchmark run, printed as they come and saved together with what produced them."""

    def __init__(self, name: str):
        from fastgrpo.malloc import keep_freed_memory

        keep_freed_memory()
        self.name = name
        self.started = time.time()
        self.tables: list[dict[str, Any]] = []
        self.notes: dict[str, Any] = {}

    def table(self, title: str, columns: list[str], rows: list[list[Any]]) -> None:
        """Print a markdown table under ``title`` (cells formatted as they should read) and keep it."""
        print(f"\n{title}\n\n{markdown(columns, rows)}", flush=True)
        self.tables.append({"title": title, "columns": columns, "rows": [[str(c) for c in r] for r in rows]})

    def save(self, directory: str | Path = REPO / "runs" / "bench") -> Path:
        """Write ``<directory>/<name>.json`` (replacing the previous run's) and print where."""
        path = Path(directory) / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "benchmark": self.name,
            "command": " ".join(["python", *sys.argv]),
            "commit": commit(),
            "date": time.strftime("%Y-%m-%d", time.gmtime(self.started)),
            "wall_seconds": round(time.time() - self.started, 1),
            "machine": machine(),
            "notes": self.notes,
            "tables": self.tables,
        }
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"\nfigures: {path}")
        return path


def to_markdown(data: dict[str, Any]) -> str:
    """A saved record as the section body of ``docs/benchmarks.md``."""
    m = data["machine"]
    where = m["gpu"] or f"{m['cpu']} ({', '.join(m['cpu_flags']) or 'no AVX2'}), {m['torch_threads']} threads"
    lines = [
        f"`{data['command']}` at commit {data['commit']}, {data['date']}; {where}; torch {m['torch']}, "
        f"transformers {m['transformers']}; {data['wall_seconds']:.0f} s.",
    ]
    for table in data["tables"]:
        lines += ["", f"**{table['title']}**", "", markdown(table["columns"], table["rows"])]
    return "\n".join(lines)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(to_markdown(json.loads(Path(arg).read_text())) + "\n")
