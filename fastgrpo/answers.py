"""Reading answers out of text: a completion's text, its final number (after ``####``, the last one, or inside
``\\boxed{}``) and numbers normalised for comparison."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

_UNICODE_MINUS = "\u2212"
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
# A leading "-" is a sign only when it does not follow a word, a digit or a closing bracket ("10-3" is 3).
_ANY_NUMBER_RE = re.compile(rf"(?:(?<![\w)\]])-)?(?<![\w.])(?:{_NUMBER})")
_HASH_NUMBER_RE = re.compile(rf"\s*\$?\s*(-?(?:{_NUMBER}))")
_BOX_COMMANDS = ("\\boxed{", "\\fbox{")


def completion_text(completion: str | list[dict[str, Any]] | dict[str, Any]) -> str:
    """Text of a completion given as a string or as (a list of) assistant chat messages."""
    if isinstance(completion, str):
        return completion
    messages = [completion] if isinstance(completion, dict) else completion
    if not isinstance(messages, list):
        raise TypeError(f"a completion must be a string or a list of messages, got {type(completion).__name__}")
    return "".join(content_text(message.get("content")) for message in messages if message.get("role") == "assistant")


def content_text(content: Any) -> str:
    """Text of a message ``content``: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def normalize_number(s: str) -> str:
    """Canonical form of a number so equal values compare equal as strings.

    Drops ``$``, thousands commas, blanks and a trailing period; integral values lose their decimals
    (``"1,000.00"`` -> ``"1000"``, ``"7.0"`` -> ``"7"``); other decimals lose trailing zeros. Text that
    is not a number is returned stripped but otherwise unchanged.
    """
    text = s.strip().replace(_UNICODE_MINUS, "-")
    cleaned = re.sub(r"[\s$,]", "", text).rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return text
    if not value.is_finite():
        return text
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_hash_answer(text: str) -> str | None:
    """Strict GSM8K answer: the number right after the last ``####``, normalised; None if there is none."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].replace(_UNICODE_MINUS, "-")
    match = _HASH_NUMBER_RE.match(tail)
    return normalize_number(match.group(1)) if match else None


def extract_last_number(text: str) -> str | None:
    """Flexible answer: the last number in ``text`` (signs, decimals, thousands commas), normalised."""
    matches = _ANY_NUMBER_RE.findall(text.replace(_UNICODE_MINUS, "-"))
    return normalize_number(matches[-1]) if matches else None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) (balanced braces); None if absent."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    opening = text.index("{", start)
    depth = 0
    for position in range(opening, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[opening + 1 : position].strip()
    return None
