"""`DataConfig`: the ``dataset.*`` options."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastgrpo.data.arithmetic import answer_digits, physical_memory_bytes, rows_bytes
from fastgrpo.data.files import FILE_SUFFIXES
from fastgrpo.data.presets import PRESETS
from fastgrpo.fields import option

ARITHMETIC_OPERATORS = "+-*"
ARITHMETIC_SPLITS = ("train", "test")
ARITHMETIC_OPTIONS = ("num_examples", "digits", "operands", "operators", "word_problems", "seed")
MEMORY_SHARE = 0.25  # of the machine's memory, the most the generator's rows may take
GIB = 2**30


@dataclass
class DataConfig:
    """Where the prompts come from and how they are turned into chat prompts.

    ``name`` is ``"arithmetic"`` (synthetic, see :func:`make_arithmetic`), a preset from :data:`PRESETS`
    (read from the file ``path``, or from the preset's hub dataset when ``path`` is None), a local
    ``.jsonl``/``.json``/``.parquet`` file, or else a Hugging Face hub dataset id. ``prompt_column`` and
    ``answer_column`` are renamed to ``prompt`` and ``answer`` (they override a preset's columns when
    given; ``answer_column`` may be a dotted path into nested records such as ``reward_model.ground_truth``).
    ``instruction`` is appended on a new line to the user's question; None keeps the preset's default and
    ``""`` disables it. ``system_prompt`` adds (or replaces) the system message. ``limit`` keeps the first
    rows. ``seed`` and the remaining fields drive the arithmetic generator (whose rows are bounded by the machine's
    memory); set for another dataset they are refused, as is ``split`` for a local file (`check_given`).
    """

    name: str = option(
        "arithmetic",
        help="`arithmetic` (built-in generator), a preset (`gsm8k`, `math`, `dapo-math`, `simplerl`), a .jsonl, "
        ".json or .parquet file, or a Hugging Face datasets id (needs `datasets` and a network)",
        path=True,
    )
    path: str | None = option(None, help="the file a preset reads (None: the preset's hub dataset)", path=True)
    config: str | None = option(None, help="the configuration (subset) of a hub dataset, as TRL's dataset_config")
    split: str = option(
        "train",
        help="split of a hub dataset, or of the arithmetic generator: `train`, or `test` (the questions `train` never "
        "draws; `fastgrpo eval` takes it unless told otherwise)",
    )
    prompt_column: str = option("prompt", help="column holding the question or chat messages")
    answer_column: str | None = option(
        None, help="column holding the gold answer (a dotted path into nested records works); None: the preset's"
    )
    system_prompt: str | None = option(None, help="a system message added to every prompt")
    instruction: str | None = option(
        None, help="appended on a new line to every question; None keeps the preset's, an empty string disables it"
    )
    limit: int | None = option(None, help="keep the first rows only")
    seed: int = option(0, help="seed of the arithmetic generator")
    num_examples: int = option(2000, help="rows the arithmetic generator makes")
    digits: int = option(1, help="digits per arithmetic operand")
    operands: int = option(2, help="operands per arithmetic question")
    operators: str = option("+", help="arithmetic operators to draw from, characters of `+-*`")
    word_problems: bool = option(False, help="phrase arithmetic questions as short word problems")

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        _require(bool(self.name.strip()), "name", "must not be empty", self.name)
        _require(bool(self.split.strip()), "split", "must not be empty", self.split)
        _require(
            self.name != "arithmetic" or self.split in ARITHMETIC_SPLITS,
            "split",
            f"of the arithmetic generator must be one of {', '.join(ARITHMETIC_SPLITS)}",
            self.split,
        )
        _require(bool(self.prompt_column.strip()), "prompt_column", "must not be empty", self.prompt_column)
        _require(
            self.answer_column is None or bool(self.answer_column.strip()),
            "answer_column",
            "must be None or a column name",
            self.answer_column,
        )
        _require(
            self.path is None or self.name in PRESETS,
            "path",
            f"is only used with a preset name ({', '.join(PRESETS)}); give other files as dataset.name",
            self.path,
        )
        _require(self.limit is None or self.limit >= 1, "limit", "must be None or >= 1", self.limit)
        _require(self.num_examples >= 1, "num_examples", "must be >= 1", self.num_examples)
        _require(self.digits >= 1, "digits", "must be >= 1", self.digits)
        _require(self.operands >= 2, "operands", "must be >= 2", self.operands)
        _require(
            bool(self.operators) and set(self.operators) <= set(ARITHMETIC_OPERATORS),
            "operators",
            f"must be a non-empty string of characters from {ARITHMETIC_OPERATORS!r}",
            self.operators,
        )
        if self.name == "arithmetic":
            _check_arithmetic_size(self)

    def local_file(self) -> Path | None:
        """The local file the rows are read from (it may not exist): ``path`` of a preset, or ``name`` where it is a
        file or has a file's suffix; None for the arithmetic generator and a hub dataset."""
        if self.name in PRESETS:
            return None if self.path is None else Path(self.path).expanduser()
        path = Path(self.name).expanduser()
        if self.name == "arithmetic" or not (path.is_file() or path.suffix.lower() in FILE_SUFFIXES):
            return None
        return path

    def check_given(self, given: Mapping[str, Any]) -> None:
        """Refuse an option the user set (a key of ``given``) that does not apply to this dataset, rather than ignore
        it: the arithmetic generator's for another dataset, ``split`` for a local file (whose rows are all read)."""
        key = next((k for k in ARITHMETIC_OPTIONS if k in given), None)
        if self.name != "arithmetic" and key is not None:
            raise ValueError(
                f"dataset.{key} applies to the arithmetic generator only, not to the dataset {self.name}: remove it"
                + (" (dataset.limit keeps the first rows)" if key == "num_examples" else "")
            )
        file = self.local_file()
        if "config" in given and (file is not None or self.name == "arithmetic" or self.name in PRESETS):
            raise ValueError(f"dataset.config names a configuration of a hub dataset, not of {self.name}: remove it")
        if "split" in given and file is not None:
            raise ValueError(
                f"dataset.split applies to hub datasets and the arithmetic generator, not to the local file {file}, "
                "whose rows are all read: remove it (dataset.limit keeps the first rows)"
            )


def _check_arithmetic_size(cfg: DataConfig) -> None:
    """Refuse answers longer than Python writes as text (``sys.get_int_max_str_digits``), and rows that would take
    more than `MEMORY_SHARE` of the machine's memory (they are all held at once)."""
    digits, limit = answer_digits(cfg), getattr(sys, "get_int_max_str_digits", lambda: 0)()  # 3.10.7+
    if limit and digits > limit:
        raise ValueError(
            f"dataset.digits: answers of {cfg.digits}-digit numbers with {cfg.operands} operands and operators "
            f"{cfg.operators!r} have up to {digits} digits, more than the {limit} Python writes as text; use fewer "
            "digits or operands"
        )
    need, memory = rows_bytes(cfg), physical_memory_bytes()
    if need > MEMORY_SHARE * memory:
        raise ValueError(
            f"dataset.num_examples: {cfg.num_examples} arithmetic rows (operands: {cfg.operands}, digits: "
            f"{cfg.digits}) would take about {need / GIB:.1f} GiB of memory ({need // cfg.num_examples} bytes each), "
            f"more than {MEMORY_SHARE:.0%} of this machine's {memory / GIB:.1f} GiB; make fewer rows, operands or "
            "digits"
        )


def _require(condition: bool, field: str, requirement: str, value: Any) -> None:
    """Raise ``ValueError("dataset.<field> <requirement>, got <value>")`` unless ``condition`` holds."""
    if not condition:
        raise ValueError(f"dataset.{field} {requirement}, got {value!r}")
