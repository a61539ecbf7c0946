"""Dataset formats (presets for GSM8K, MATH, DAPO-Math, SimpleRL) and the conversion of raw records into rows: a
chat ``prompt``, the gold ``answer`` and every other column for the reward functions."""

from __future__ import annotations

import logging
from typing import Any

from fastgrpo.data.config import DataConfig
from fastgrpo.data.files import Record, read_file, read_hub
from fastgrpo.data.presets import PRESETS, Preset
from fastgrpo.data.prompts import build_prompt, prompt_problem

logger = logging.getLogger(__name__)

Row = dict[str, Any]


class ConversationalRow(dict):
    """A row whose dataset gave its prompt as chat messages (TRL's conversational format): its completions reach the
    reward functions as TRL hands them, ``[{"role": "assistant", "content": text}]``
    (`fastgrpo.grpo.trl_form.reward_completion`); rows whose prompt was text get the text."""


_MISSING = object()


def _layout(cfg: DataConfig, preset: Preset | None) -> Preset:
    """The column layout to read with: the preset's, with the columns the config sets explicitly."""
    if preset is None:
        answer_columns = (cfg.answer_column,) if cfg.answer_column else ("answer",)
        return Preset(cfg.prompt_column, answer_columns, answer_required=cfg.answer_column is not None)
    return Preset(
        prompt_column=cfg.prompt_column if cfg.prompt_column != "prompt" else preset.prompt_column,
        answer_columns=(cfg.answer_column,) if cfg.answer_column else preset.answer_columns,
        parse_answer=preset.parse_answer,
        instruction=preset.instruction,
        answer_required=preset.answer_required,
    )


def _get_column(record: dict[str, Any], column: str) -> Any:
    """``record[column]``, following dots into nested dicts when there is no such top-level key."""
    if column in record:
        return record[column]
    value: Any = record
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _find_answer(record: dict[str, Any], columns: tuple[str, ...]) -> tuple[str | None, Any]:
    """The first of ``columns`` present in ``record`` and its value, or ``(None, _MISSING)``."""
    for column in columns:
        value = _get_column(record, column)
        if value is not _MISSING and value is not None:
            return column, value
    return None, _MISSING


def _to_row(record: Any, layout: Preset, where: str, system_prompt: str | None, instruction: str | None) -> Row | None:
    """Convert one raw record; None when its gold answer cannot be extracted (the row is skipped)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with named columns, got {type(record).__name__}")
    question = _get_column(record, layout.prompt_column)
    if question is _MISSING:
        columns = ", ".join(map(str, record)) or "none"
        raise ValueError(f"{where}: missing prompt column {layout.prompt_column!r} (columns: {columns})")
    problem = prompt_problem(question)
    if problem is not None:
        raise ValueError(f"{where}: prompt column {layout.prompt_column!r} {problem}")
    kind = ConversationalRow if isinstance(question, list) else dict
    row = kind((key, value) for key, value in record.items() if key != layout.prompt_column)
    row["prompt"] = build_prompt(question, system_prompt, instruction)
    column, raw = _find_answer(record, layout.answer_columns)
    if column is None:
        if layout.answer_required:
            raise ValueError(f"{where}: missing answer column {' or '.join(map(repr, layout.answer_columns))}")
        return row
    answer = layout.parse_answer(raw)
    if answer is None:
        return None
    if column == "answer" and str(raw).strip() != answer:
        row.setdefault("solution", raw)
    row["answer"] = answer
    return row


def _convert(
    records: list[Record], layout: Preset, source: str, system_prompt: str | None, instruction: str | None
) -> list[Row]:
    """Convert raw records into rows, skipping (and reporting) rows without a usable gold answer."""
    rows = []
    for location, record in records:
        row = _to_row(record, layout, f"{source} {location}", system_prompt, instruction)
        if row is not None:
            rows.append(row)
    skipped = len(records) - len(rows)
    if skipped:
        logger.warning(
            "%s: skipped %d of %d rows whose gold answer could not be extracted",
            source,
            skipped,
            len(records),
        )
    if not rows:
        reason = f" (none of its {len(records)} rows has a usable answer)" if records else ""
        raise ValueError(f"dataset {source} is empty{reason}")
    return rows


def _read_source(cfg: DataConfig, preset: Preset | None) -> tuple[str, list[Record]]:
    """The source's label and raw records: the preset's file or hub dataset, a local file, or a hub id."""
    if preset is not None and cfg.path is None:
        if preset.hub_id is None:
            raise ValueError(f"dataset preset {cfg.name!r} has no default hub dataset; set dataset.path to a file")
        return preset.hub_id, read_hub(preset.hub_id, preset.hub_config, cfg.split)
    path = cfg.local_file()
    if path is None:
        return cfg.name, read_hub(cfg.name, cfg.config, cfg.split)
    if path.is_dir():
        via = f" (a link to {path.resolve()})" if path.is_symlink() else ""
        raise ValueError(f"dataset: {path}{via} is a directory, not a dataset file (.jsonl, .json or .parquet)")
    if not path.is_file():
        dangling = f" (a link to {path.resolve()}, which does not exist)" if path.is_symlink() else ""
        raise FileNotFoundError(f"dataset file not found: {path}{dangling}")
    return str(path), read_file(path)


def load_external(cfg: DataConfig) -> list[Row]:
    """Rows of a preset, local file or hub dataset."""
    preset = PRESETS.get(cfg.name)
    layout = _layout(cfg, preset)
    instruction = cfg.instruction if cfg.instruction is not None else layout.instruction
    source, records = _read_source(cfg, preset)
    return _convert(records, layout, source, cfg.system_prompt, instruction)
