"""Prompt datasets: a synthetic arithmetic generator, local files, presets for math datasets and the hub.

A dataset is a ``list[dict]`` of rows (TRL's convention). Every row has a ``prompt`` column holding a list
of chat messages (``[{"role": "user", "content": ...}]``, preceded by a system message when a system prompt
is configured) and, where the gold final answer is known, an ``answer`` column holding it as a string.
Every other column is handed to reward functions as a keyword argument.
"""

from __future__ import annotations

from pathlib import Path

from fastgrpo.data.arithmetic import make_arithmetic
from fastgrpo.data.config import DataConfig
from fastgrpo.data.files import DatasetSourceError
from fastgrpo.data.presets import GSM8K_INSTRUCTION, PRESETS
from fastgrpo.data.prompts import build_prompt
from fastgrpo.data.records import Row, load_external

__all__ = [
    "GSM8K_INSTRUCTION",
    "PRESETS",
    "DataConfig",
    "DatasetSourceError",
    "build_prompt",
    "load_dataset",
    "load_gsm8k",
    "make_arithmetic",
]


def load_dataset(cfg: DataConfig) -> list[Row]:
    """Load the dataset ``cfg`` describes (see :class:`DataConfig`), keeping at most ``cfg.limit`` rows."""
    cfg.validate()
    rows = make_arithmetic(cfg) if cfg.name == "arithmetic" else load_external(cfg)
    return rows if cfg.limit is None else rows[: cfg.limit]


def load_gsm8k(path: str | Path, instruction: str | None = None, system_prompt: str | None = None) -> list[Row]:
    """Rows of a GSM8K-format JSONL/JSON/parquet file.

    Each row has ``prompt`` (question plus instruction; None means :data:`GSM8K_INSTRUCTION`, ``""`` none),
    ``answer`` (the number after ``####``, normalised: ``"1,000"`` -> ``"1000"``) and ``solution`` (the
    original answer text).
    """
    cfg = DataConfig(name="gsm8k", path=str(path), instruction=instruction, system_prompt=system_prompt)
    return load_dataset(cfg)
