"""The built-in synthetic dataset: arithmetic questions with exact answers, as bare expressions or word problems."""

from __future__ import annotations

import itertools
import logging
import os
import random
import zlib
from typing import Any, Protocol

from fastgrpo.data.prompts import build_prompt


class ArithmeticOptions(Protocol):
    """The ``dataset.*`` options the generator reads (`fastgrpo.data.config.DataConfig`'s, which validates with this
    module's estimate, `rows_bytes`: so this module does not import it)."""

    split: str
    seed: int
    num_examples: int
    digits: int
    operands: int
    operators: str
    word_problems: bool
    instruction: str | None
    system_prompt: str | None

    def validate(self) -> None: ...


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
logger = logging.getLogger(__name__)
MAX_DRAWS = 10_000  # draws for one question of the split before the split is taken to be empty
COUNTED = 100_000  # questions in all up to which a split's distinct questions are counted (above: estimated)
# What a row holds in memory (measured with tracemalloc: 550 bytes for a one-digit sum) besides the characters of its
# question and answer, its copy of the instruction, a word problem's words and, with a system prompt, its message.
ROW_BYTES = 600
WORD_PROBLEM_BYTES = 100
SYSTEM_MESSAGE_BYTES = 250
DRAW_BYTES = 150  # per operand, while a question is drawn (its numbers, operators and their text)
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


def held_out(question: str) -> bool:
    """Whether ``question`` (as `_plain_question` words it, whatever wording a row uses) belongs to the test split:
    one in five questions, chosen by a hash, so that the two splits never share one."""
    return zlib.crc32(question.encode()) % 5 == 0


def _draw(
    rng: random.Random, cfg: ArithmeticOptions, high: int, drawn: set[str] | None
) -> tuple[list[int], list[str]] | None:
    """Numbers and operators of a question of ``cfg.split`` not in ``drawn`` (None: repeats allowed), drawn until
    one comes; None after `MAX_DRAWS` draws without one."""
    for _ in range(MAX_DRAWS):
        numbers = [rng.randint(1, high) for _ in range(cfg.operands)]
        operators = [rng.choice(cfg.operators) for _ in range(cfg.operands - 1)]
        question = _plain_question(numbers, operators)
        if held_out(question) != (cfg.split == "test"):
            continue
        if drawn is None:
            return numbers, operators
        if question not in drawn:
            drawn.add(question)
            return numbers, operators
    return None


def answer_digits(cfg: ArithmeticOptions) -> int:
    """The most digits an answer can have (a product of every operand where ``*`` is drawn)."""
    return cfg.digits * cfg.operands if "*" in cfg.operators else cfg.digits + len(str(cfg.operands))


def rows_bytes(cfg: ArithmeticOptions) -> int:
    """About the memory the generator takes for ``cfg.num_examples`` rows: `ROW_BYTES` each with the characters of
    their question and answer, their copies of the instruction and system message, and what drawing a question
    holds for a while."""
    question = cfg.operands * (cfg.digits + 3) + (WORD_PROBLEM_BYTES if cfg.word_problems else 0)
    extras = len((cfg.instruction or "").encode()) + (SYSTEM_MESSAGE_BYTES if cfg.system_prompt is not None else 0)
    return cfg.num_examples * (ROW_BYTES + question + answer_digits(cfg) + extras) + cfg.operands * DRAW_BYTES


def physical_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def split_size(cfg: ArithmeticOptions) -> int:
    """The distinct questions of ``cfg.split``: counted where the questions number at most `COUNTED` in all, else the
    split's expected share of them (a fifth for ``test``)."""
    operators = sorted(set(cfg.operators))
    high = 10**cfg.digits - 1
    operands = min(cfg.operands, 20)  # beyond 9**20 questions the count outnumbers any num_examples memory allows
    total = high**operands * len(operators) ** (operands - 1)
    if total > COUNTED:
        return total // 5 if cfg.split == "test" else total - total // 5
    numbers = itertools.product(range(1, high + 1), repeat=cfg.operands)
    questions = itertools.product(numbers, itertools.product(operators, repeat=cfg.operands - 1))
    return sum(held_out(_plain_question(list(n), list(o))) == (cfg.split == "test") for n, o in questions)


def make_arithmetic(cfg: ArithmeticOptions) -> list[dict[str, Any]]:
    """Synthetic arithmetic prompts, deterministic in ``cfg.seed``.

    Each example has ``cfg.operands`` numbers of 1 to ``cfg.digits`` digits joined by operators drawn from
    ``cfg.operators`` (usual precedence). ``cfg.split`` is ``train`` or ``test``: a fixed fifth of the possible
    questions (`held_out`) is only ever drawn for ``test``, so an evaluation on it measures questions training never
    saw. ``train`` draws ``cfg.num_examples`` questions with repeats (and says so when there are fewer distinct ones);
    ``test`` draws distinct ones, as many as the split has when that is fewer (one-digit sums have 14). Rows hold
    ``prompt`` (chat messages with the bare question, plus ``cfg.instruction`` only if set) and ``answer`` (the exact
    integer result as a string).
    """
    cfg.validate()
    rng = random.Random(cfg.seed)
    high = 10**cfg.digits - 1
    rows = []
    drawn: set[str] | None = set() if cfg.split == "test" else None
    for _ in range(cfg.num_examples):
        question_terms = _draw(rng, cfg, high, drawn)
        if question_terms is None:
            break
        numbers, operators = question_terms
        question = (_word_problem(rng, numbers, operators) if cfg.word_problems else None) or _plain_question(
            numbers, operators
        )
        prompt = build_prompt(question, cfg.system_prompt, cfg.instruction)
        rows.append({"prompt": prompt, "answer": str(_evaluate(numbers, operators))})
    if not rows:
        raise ValueError(
            f"dataset: the arithmetic questions of {cfg.digits}-digit numbers with {cfg.operands} operands and "
            f"operators {cfg.operators!r} have no {cfg.split} split; allow more digits, operands or operators"
        )
    if len(rows) < cfg.num_examples:
        logger.info(
            "dataset: the arithmetic %s split has %d distinct questions, fewer than num_examples (%d): all of them",
            cfg.split,
            len(rows),
            cfg.num_examples,
        )
    elif cfg.split == "train" and (distinct := split_size(cfg)) < cfg.num_examples:
        logger.info(
            "dataset: the arithmetic train split has %d distinct questions, fewer than num_examples (%d): they repeat",
            distinct,
            cfg.num_examples,
        )
    return rows
