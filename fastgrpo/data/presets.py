"""Dataset formats: where a preset's prompt and gold answer are, how the answer is read, its default instruction
and hub dataset."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastgrpo.answers import extract_boxed, extract_hash_answer

GSM8K_INSTRUCTION = "Solve step by step and give the final answer after '####'."
BOXED_INSTRUCTION = "Solve step by step and put the final answer within \\boxed{}."


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
