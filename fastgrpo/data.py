"""Prompt datasets: a synthetic arithmetic generator, local files, presets for math datasets and the hub.

A dataset is a ``list[dict]`` of rows (TRL's convention). Every row has a ``prompt`` column holding a list
of chat messages (``[{"role": "user", "content": ...}]``, preceded by a system message when a system prompt
is configured) and, where the gold final answer is known, an ``answer`` column holding it as a string.
Every other column is handed to reward functions as a keyword argument.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastgrpo.fields import option
from fastgrpo.rewards import extract_boxed, extract_hash_answer

logger = logging.getLogger(__name__)

Row = dict[str, Any]
Messages = list[dict[str, Any]]
Record = tuple[str, Any]  # a raw record and where it came from ("line 3", "row 7"), for error messages

ARITHMETIC_OPERATORS = "+-*"
CHAT_ROLES = ("system", "user", "assistant", "tool")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
GSM8K_INSTRUCTION = "Solve step by step and give the final answer after '####'."
BOXED_INSTRUCTION = "Solve step by step and put the final answer within \\boxed{}."
_MISSING = object()


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
    split: str = option("train", help="split of a hub dataset")
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


class DatasetSourceError(ValueError):
    """The dataset name is neither a local file nor a hub dataset that could be loaded."""


def _plain_answer(value: Any) -> str | None:
    """The gold answer as given, as a stripped string."""
    return str(value).strip() or None


def _gsm8k_answer(value: Any) -> str | None:
    """The normalised number after ``####`` in a GSM8K solution."""
    return extract_hash_answer(str(value))


def _boxed_answer(value: Any) -> str | None:
    """The content of the last ``\\boxed{}`` in a worked solution (MATH style)."""
    return extract_boxed(str(value)) or None


@dataclass(frozen=True)
class Preset:
    """Column layout and defaults of a dataset format.

    ``answer_columns`` are tried in order (dotted names reach into nested records); ``parse_answer`` turns
    the raw value into the gold answer string, or None when it has none (such rows are skipped with a
    warning). ``answer_required=False`` lets rows without any answer column through unchanged.
    """

    prompt_column: str
    answer_columns: tuple[str, ...]
    parse_answer: Callable[[Any], str | None] = _plain_answer
    instruction: str | None = None
    hub_id: str | None = None
    hub_config: str | None = None
    answer_required: bool = True


PRESETS: dict[str, Preset] = {
    # GSM8K: {"question", "answer": "...reasoning...\n#### 72"}; the full answer text is kept as `solution`.
    "gsm8k": Preset("question", ("answer",), _gsm8k_answer, GSM8K_INSTRUCTION, "openai/gsm8k", "main"),
    # MATH: {"problem", "solution"} where the final answer is the solution's last \boxed{...}.
    "math": Preset("problem", ("solution",), _boxed_answer, BOXED_INSTRUCTION, "DigitalLearningGmbH/MATH-lighteval"),
    # DAPO-Math-17k: chat-list `prompt` (instructions included), answer in `solution` (open-r1's processed
    # copy) or `reward_model.ground_truth` (the original release).
    "dapo-math": Preset("prompt", ("solution", "reward_model.ground_truth"), hub_id="BytedTsinghua-SIA/DAPO-Math-17k"),
    # SimpleRL-Zoo data: {"question", "gt_answer" or "answer"}; the hub repository holds several subsets,
    # so give the chosen parquet/jsonl file as dataset.path.
    "simplerl": Preset("question", ("gt_answer", "answer"), instruction=BOXED_INSTRUCTION),
}


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


def _prompt_problem(value: Any) -> str | None:
    """Why ``value`` is not a usable prompt, or None when it is."""
    if isinstance(value, str):
        return None if value.strip() else "is an empty string"
    if not isinstance(value, list) or not value:
        return f"must be a non-empty string or a list of {{role, content}} messages, got {type(value).__name__}"
    for message in value:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            return "must be a list of {role, content} messages; found an entry without a string 'role'"
        if not isinstance(message.get("content"), str):
            return "must be a list of {role, content} messages; found a message without string 'content'"
        if message["role"] not in CHAT_ROLES:
            return f"has a message with role {message['role']!r}; roles are {', '.join(CHAT_ROLES)}"
    if not any(message["role"] == "user" for message in value):
        return "has no user message"
    return None


def build_prompt(question: str | Messages, system_prompt: str | None, instruction: str | None) -> Messages:
    """Chat messages for a question (a string or messages), with the system prompt and instruction applied.

    The instruction goes on a new line after the last user message; the system prompt becomes the first
    message, replacing a system message the prompt already has.
    """
    if isinstance(question, str):
        messages: Messages = [{"role": "user", "content": question}]
    else:
        messages = [dict(message) for message in question]
    if instruction:
        last_user = max(i for i, message in enumerate(messages) if message["role"] == "user")
        content = messages[last_user]["content"].rstrip()
        messages[last_user]["content"] = f"{content}\n{instruction.strip()}"
    if system_prompt is not None:
        if messages[0]["role"] == "system":
            messages = messages[1:]
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


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
    problem = _prompt_problem(question)
    if problem is not None:
        raise ValueError(f"{where}: prompt column {layout.prompt_column!r} {problem}")
    row = {key: value for key, value in record.items() if key != layout.prompt_column}
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


def _read_jsonl(path: Path) -> list[Record]:
    """Objects of a JSON Lines file (blank lines skipped), located by line number."""
    records = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
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
        data = json.loads(path.read_text(encoding="utf-8"))
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


def _read_file(path: Path) -> list[Record]:
    """Raw records of a ``.jsonl``, ``.json`` or ``.parquet`` file."""
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(FILE_SUFFIXES)}")
    return reader(path)


def _read_hub(dataset_id: str, config_name: str | None, split: str) -> list[Record]:
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


def _read_source(cfg: DataConfig, preset: Preset | None) -> tuple[str, list[Record]]:
    """The source's label and raw records: the preset's file or hub dataset, a local file, or a hub id."""
    if preset is not None and cfg.path is None:
        if preset.hub_id is None:
            raise ValueError(f"dataset preset {cfg.name!r} has no default hub dataset; set dataset.path to a file")
        return preset.hub_id, _read_hub(preset.hub_id, preset.hub_config, cfg.split)
    target = cfg.path if preset is not None else cfg.name
    path = Path(target).expanduser()
    if path.is_file():
        return str(path), _read_file(path)
    if preset is not None or path.suffix.lower() in FILE_SUFFIXES:
        raise FileNotFoundError(f"dataset file not found: {path}")
    return target, _read_hub(target, None, cfg.split)


def _load_external(cfg: DataConfig) -> list[Row]:
    """Rows of a preset, local file or hub dataset."""
    preset = PRESETS.get(cfg.name)
    layout = _layout(cfg, preset)
    instruction = cfg.instruction if cfg.instruction is not None else layout.instruction
    source, records = _read_source(cfg, preset)
    return _convert(records, layout, source, cfg.system_prompt, instruction)


def load_gsm8k(path: str | Path, instruction: str | None = None, system_prompt: str | None = None) -> list[Row]:
    """Rows of a GSM8K-format JSONL/JSON/parquet file.

    Each row has ``prompt`` (question plus instruction; None means :data:`GSM8K_INSTRUCTION`, ``""`` none),
    ``answer`` (the number after ``####``, normalised: ``"1,000"`` -> ``"1000"``) and ``solution`` (the
    original answer text).
    """
    cfg = DataConfig(name="gsm8k", path=str(path), instruction=instruction, system_prompt=system_prompt)
    return load_dataset(cfg)


_ADDITION_TEMPLATES = (
    "{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
    "There are {a} {item} in a basket and {name} puts in {b} more. How many {item} are in the basket?",
    "{name} found {a} {item} in the morning and {b} {item} in the afternoon. How many did {name} find?",
)
_SUBTRACTION_TEMPLATES = (
    "{name} has {a} {item} and gives {b} of them to a friend. How many {item} does {name} have left?",
    "A shelf holds {a} {item}. {name} takes {b} of them away. How many {item} are left on the shelf?",
)
_MULTIPLICATION_TEMPLATES = (
    "{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have?",
    "Each box holds {b} {item}. How many {item} are in {a} boxes?",
)
_NAMES = ("Sam", "Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Lena")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "shells")


def _evaluate(numbers: list[int], operators: list[str]) -> int:
    """Exact value of ``numbers[0] op numbers[1] op ...`` with ``*`` binding tighter than ``+`` and ``-``."""
    terms = [numbers[0]]
    for operator, number in zip(operators, numbers[1:], strict=True):
        if operator == "*":
            terms[-1] *= number
        else:
            terms.append(number if operator == "+" else -number)
    return sum(terms)


def _word_problem(rng: random.Random, numbers: list[int], operators: list[str]) -> str | None:
    """A word problem for ``a op b`` when a template fits (two operands, no negative remainders)."""
    if len(numbers) != 2:
        return None
    (a, b), operator = numbers, operators[0]
    if operator == "+":
        templates = _ADDITION_TEMPLATES
    elif operator == "-" and a >= b:
        templates = _SUBTRACTION_TEMPLATES
    elif operator == "*":
        templates = _MULTIPLICATION_TEMPLATES
    else:
        return None
    return rng.choice(templates).format(name=rng.choice(_NAMES), item=rng.choice(_ITEMS), a=a, b=b)


def _plain_question(numbers: list[int], operators: list[str]) -> str:
    """``"What is 3 + 4 * 2?"``."""
    parts = [str(numbers[0])]
    for operator, number in zip(operators, numbers[1:], strict=True):
        parts += [operator, str(number)]
    return f"What is {' '.join(parts)}?"


def make_arithmetic(cfg: DataConfig) -> list[Row]:
    """Synthetic arithmetic prompts, deterministic in ``cfg.seed``.

    Each example has ``cfg.operands`` numbers of 1 to ``cfg.digits`` digits joined by operators drawn from
    ``cfg.operators`` (usual precedence). Rows hold ``prompt`` (chat messages with the bare question, plus
    ``cfg.instruction`` only if set) and ``answer`` (the exact integer result as a string).
    """
    cfg.validate()
    rng = random.Random(cfg.seed)
    high = 10**cfg.digits - 1
    rows = []
    for _ in range(cfg.num_examples):
        numbers = [rng.randint(1, high) for _ in range(cfg.operands)]
        operators = [rng.choice(cfg.operators) for _ in range(cfg.operands - 1)]
        question = (_word_problem(rng, numbers, operators) if cfg.word_problems else None) or _plain_question(
            numbers, operators
        )
        prompt = build_prompt(question, cfg.system_prompt, cfg.instruction)
        rows.append({"prompt": prompt, "answer": str(_evaluate(numbers, operators))})
    return rows


def load_dataset(cfg: DataConfig) -> list[Row]:
    """Load the dataset ``cfg`` describes (see :class:`DataConfig`), keeping at most ``cfg.limit`` rows."""
    cfg.validate()
    rows = make_arithmetic(cfg) if cfg.name == "arithmetic" else _load_external(cfg)
    return rows if cfg.limit is None else rows[: cfg.limit]
