"""Raw records of dataset files (``.jsonl``, ``.json``, ``.parquet``) and of Hugging Face hub datasets, each with
where it came from ("line 3", "row 7") for error messages."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastgrpo.paths import read_lines, read_text

Record = tuple[str, Any]
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


class DatasetSourceError(ValueError):
    """The dataset name is neither a local file nor a hub dataset that could be loaded."""


def _read_jsonl(path: Path) -> list[Record]:
    """Objects of a JSON Lines file (blank lines skipped), located by line number."""
    records = []
    for number, line in read_lines(path):
        if not line.strip():
            continue
        try:
            records.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {number} is not valid JSON: {exc.msg}") from exc
    return records


def _read_json(path: Path) -> list[Record]:
    """Objects of a JSON file holding a list of objects or ``{"data": [...]}``, located by row (1-based)."""
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if isinstance(data, dict) and "data" in data:
        data = data["data"]
    if not isinstance(data, list):
        raise ValueError(f'{path}: expected a JSON list of objects or {{"data": [...]}}')
    return [(f"row {index}", record) for index, record in enumerate(data, start=1)]


def _read_parquet(path: Path) -> list[Record]:
    """Rows of a parquet file (needs pyarrow), located by row (1-based)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from exc
    return [(f"row {index}", record) for index, record in enumerate(pq.read_table(path).to_pylist(), start=1)]


_READERS: dict[str, Callable[[Path], list[Record]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
}


def read_file(path: Path) -> list[Record]:
    """Raw records of a ``.jsonl``, ``.json`` or ``.parquet`` file."""
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(FILE_SUFFIXES)}")
    return reader(path)


def read_hub(dataset_id: str, config_name: str | None, split: str) -> list[Record]:
    """Raw records of a Hugging Face hub dataset split, loaded with the ``datasets`` package."""
    try:
        import datasets
    except ImportError as exc:
        raise DatasetSourceError(
            f"dataset {dataset_id!r} is not a local file, and loading it from the Hugging Face hub needs "
            "the `datasets` package (pip install datasets)"
        ) from exc
    try:
        loaded = datasets.load_dataset(dataset_id, config_name, split=split)
    except Exception as exc:  # datasets raises many unrelated types for unreachable or unknown datasets
        raise DatasetSourceError(
            f"dataset {dataset_id!r} (split {split!r}) is neither a local file nor a reachable Hugging Face "
            f"hub dataset; check the name (this machine may be offline): {type(exc).__name__}: {exc}"
        ) from exc
    return [(f"row {index}", dict(record)) for index, record in enumerate(loaded, start=1)]
