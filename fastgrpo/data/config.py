"""`DataConfig`: the ``dataset.*`` options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastgrpo.data.presets import PRESETS
from fastgrpo.fields import option

ARITHMETIC_OPERATORS = "+-*"
ARITHMETIC_SPLITS = ("train", "test")


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
    rows. ``seed`` and the remaining fields drive the arithmetic generator.
    """

    name: str = option(
        "arithmetic",
        help="`arithmetic` (built-in generator), a preset (`gsm8k`, `math`, `dapo-math`, `simplerl`), a .jsonl, "
        ".json or .parquet file, or a Hugging Face datasets id (needs `datasets` and a network)",
    )
    path: str | None = option(None, help="the file a preset reads (None: the preset's hub dataset)")
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


def _require(condition: bool, field: str, requirement: str, value: Any) -> None:
    """Raise ``ValueError("dataset.<field> <requirement>, got <value>")`` unless ``condition`` holds."""
    if not condition:
        raise ValueError(f"dataset.{field} {requirement}, got {value!r}")
