"""Reward functions with TRL's calling convention and reward aggregation (answers are read by `fastgrpo.answers`).

A reward function is called as ``f(prompts=..., completions=..., completion_ids=..., **columns)``: every
dataset column except ``prompt`` arrives as a list aligned with ``completions``. Completions are strings,
or lists of ``{"role": "assistant", "content": ...}`` messages for conversational prompts
(see :func:`completion_text`). A function returns one ``float`` per completion, or ``None`` for a row it
cannot score.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastgrpo.answers import (
    completion_text,
    content_text,
    extract_boxed,
    extract_hash_answer,
    extract_last_number,
    normalize_number,
)
from fastgrpo.errors import RewardFunctionError

RewardFunc = Callable[..., list[float | None]]
logger = logging.getLogger(__name__)


MATH_VERIFY_TIMEOUT_S = 5
_EXCERPT_CHARS = 80


def _gold_number(answer: Any) -> str | None:
    """Normalised gold number; a full GSM8K solution (``... #### 72``) is reduced to its final answer."""
    if answer is None:
        return None
    text = str(answer)
    gold = extract_hash_answer(text) if "####" in text else normalize_number(text)
    return gold or None


def _score_numbers(
    completions: Sequence[Any], answer: Sequence[Any], extract: Callable[[str], str | None]
) -> list[float | None]:
    """1.0 where ``extract`` finds the gold number in the completion, 0.0 where not, None without gold."""
    scores: list[float | None] = []
    for completion, gold_answer in zip(completions, answer, strict=True):
        gold = _gold_number(gold_answer)
        scores.append(None if gold is None else float(extract(completion_text(completion)) == gold))
    return scores


def gsm8k_strict(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when the number after the completion's last ``####`` equals the gold answer, else 0.0."""
    return _score_numbers(completions, answer, extract_hash_answer)


def gsm8k_flexible(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when the last number in the completion equals the gold answer, else 0.0."""
    return _score_numbers(completions, answer, extract_last_number)


def _math_verify_timeout() -> int | None:
    """math_verify's timeout: it uses SIGALRM, which only works in the main thread on POSIX systems."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    return MATH_VERIFY_TIMEOUT_S if in_main_thread and os.name == "posix" else None


def _verify_math(text: str, gold_answer: Any, timeout: int | None) -> float | None:
    """1.0/0.0 for a completion against a gold answer with math_verify; None if the gold does not parse."""
    from math_verify import parse, verify

    gold_text = "" if gold_answer is None else str(gold_answer).strip()
    if gold_text and "\\boxed" not in gold_text and "$" not in gold_text:
        gold_text = f"\\boxed{{{gold_text}}}"
    gold = parse(gold_text, parsing_timeout=timeout) if gold_text else []
    if not gold:
        return None
    prediction = parse(text, parsing_timeout=timeout)
    return float(verify(gold, prediction, timeout_seconds=timeout))


def math_accuracy(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when math_verify finds the completion's final (boxed) answer equivalent to the gold answer.

    Plain gold answers (``"0.5"``, ``"\\frac{1}{2}"``) are boxed before parsing. Rows whose gold answer
    cannot be parsed score None. The timeout is disabled outside the main thread, where signals fail.
    """
    timeout = _math_verify_timeout()
    return [
        _verify_math(completion_text(completion), gold, timeout)
        for completion, gold in zip(completions, answer, strict=True)
    ]


def format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion states a final answer as ``#### N`` or ``\\boxed{...}``, else 0.0."""
    scores: list[float | None] = []
    for completion in completions:
        text = completion_text(completion)
        scores.append(float(extract_hash_answer(text) is not None or bool(extract_boxed(text))))
    return scores


REWARD_FUNCS: dict[str, RewardFunc] = {
    "gsm8k_strict": gsm8k_strict,
    "gsm8k_flexible": gsm8k_flexible,
    "accuracy": gsm8k_flexible,
    "math_accuracy": math_accuracy,
    "format": format_reward,
}


def _named(func: RewardFunc, name: str) -> RewardFunc:
    """``func`` under the name it was asked for, so that its metrics are ``rewards/<name>/...`` (``accuracy`` is
    `gsm8k_flexible`)."""
    if func.__name__ == name:
        return func

    @functools.wraps(func)
    def reward(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    reward.__name__ = reward.__qualname__ = name
    return reward


def _import_reward(spec: str) -> RewardFunc:
    """Import a reward function given as ``"module.path:function"``; a module in the current directory is found, as
    ``python -m`` finds it."""
    module_name, _, attribute = spec.partition(":")
    cwd = os.getcwd()
    searched = cwd not in sys.path and "" not in sys.path
    if searched:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} for reward function {spec!r}: {exc}") from exc
    finally:
        if searched:
            sys.path.remove(cwd)
    func = getattr(module, attribute, None)
    if not callable(func):
        raise ValueError(f"reward function {spec!r}: module {module_name!r} has no callable {attribute!r}")
    return func


def resolve_reward_funcs(names_or_callables: Sequence[str | RewardFunc]) -> list[RewardFunc]:
    """Turn registry names, ``"module.path:function"`` strings and callables into reward functions."""
    funcs: list[RewardFunc] = []
    for spec in names_or_callables:
        if callable(spec):
            funcs.append(spec)
        elif spec in REWARD_FUNCS:
            funcs.append(_named(REWARD_FUNCS[spec], spec))
        elif isinstance(spec, str) and ":" in spec:
            funcs.append(_import_reward(spec))
        else:
            valid = ", ".join(REWARD_FUNCS)
            raise ValueError(f"unknown reward function {spec!r}; valid names: {valid} (or 'module.path:function')")
    return funcs


def required_columns(func: RewardFunc) -> list[str]:
    """The dataset columns ``func`` takes without a default (besides prompts, completions and completion_ids)."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a callable without an inspectable signature
        return []
    given = {"prompts", "completions", "completion_ids"}
    return [
        p.name
        for p in parameters
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in given
    ]


def check_columns(funcs: Sequence[RewardFunc], rows: Sequence[dict[str, Any]], checked: int = 8) -> None:
    """Raise ``ValueError`` when a reward function needs a column that one of the first ``checked`` rows lacks,
    before any rollout is spent on a batch it cannot score."""
    for func in funcs:
        for column in required_columns(func):
            for index, row in enumerate(rows[:checked]):
                if column not in row:
                    raise ValueError(
                        f"reward function {reward_name(func)!r} needs the dataset column {column!r}, which row {index} "
                        f"of the dataset does not have (its columns: {', '.join(row)}); name the column with "
                        "dataset.answer_column, or choose reward_funcs that fit the data"
                    )


def reward_name(func: RewardFunc) -> str:
    """Name used in metrics: the function's ``__name__``, else its class name."""
    return getattr(func, "__name__", None) or type(func).__name__


def _row_slice(batch: dict[str, Any], index: int) -> dict[str, Any]:
    """Keyword arguments restricted to the row ``index`` (each list cut to one element)."""
    return {key: None if value is None else value[index : index + 1] for key, value in batch.items()}


def _row(prompts: Sequence[Any] | None, index: int) -> str:
    """``row N`` and, when the prompts are known, an excerpt of its prompt, for error messages."""
    return f"row {index}" + ("" if prompts is None else f" (prompt: {_excerpt(prompts[index])!r})")


def _excerpt(prompt: Any) -> str:
    """Short text of a prompt (a string or chat messages) for error messages."""
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        text = content_text(prompt[-1].get("content"))
    else:
        text = repr(prompt)
    return text if len(text) <= _EXCERPT_CHARS else text[:_EXCERPT_CHARS] + "..."


def _call_reward(func: RewardFunc, batch: dict[str, Any], size: int) -> Any:
    """Call ``func`` on the batch; if it raises (or calls ``sys.exit``, which would end the run without a word),
    raise a `RewardFunctionError` naming the first failing row."""
    try:
        return func(**batch)
    except (Exception, SystemExit) as batch_error:
        name = reward_name(func)
        for index in range(size):
            try:
                func(**_row_slice(batch, index))
            except (Exception, SystemExit) as row_error:
                raise RewardFunctionError(
                    f"reward function {name!r} failed on {_row(batch['prompts'], index)}: {_failure(row_error)}"
                ) from row_error
        raise RewardFunctionError(
            f"reward function {name!r} failed on a batch of {size} completions (no single row fails alone): "
            f"{_failure(batch_error)}"
        ) from batch_error


def _failure(error: BaseException) -> str:
    """What a reward function did wrong, in words: the exception, or the ``sys.exit`` it called."""
    if isinstance(error, SystemExit):
        code = "" if error.code is None else repr(error.code)
        return f"it called sys.exit({code}); a reward function must return its rewards, not end the process"
    return f"{type(error).__name__}: {error}"


def _as_tensor(name: str, values: Any, size: int, prompts: Sequence[Any] | None) -> torch.Tensor:
    """Check a reward function's output and turn it into a float32 tensor with NaN for None (and for NaN, which
    TRL treats as None). An infinite reward is an error naming the function and the row: it would make every weight
    NaN at the next update."""
    if not isinstance(values, (list, tuple)) or len(values) != size:
        got = f"length {len(values)}" if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(f"reward function {name!r} must return a list of {size} floats or None, got {got}")
    try:
        floats = [math.nan if value is None else float(value) for value in values]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"reward function {name!r} returned a value that is not a number: {exc}") from exc
    for index, value in enumerate(floats):
        if math.isinf(value):
            raise ValueError(
                f"reward function {name!r} returned {value} for {_row(prompts, index)}; rewards must be finite "
                "numbers, or None for a row the function cannot score. The run stopped before this step's update."
            )
    return torch.tensor(floats, dtype=torch.float32, device="cpu")


def _nan_mean_std(values: torch.Tensor) -> tuple[float, float]:
    """Mean and (unbiased) standard deviation over the non-NaN entries; NaN when there are none."""
    valid = values[~torch.isnan(values)]
    if valid.numel() == 0:
        return math.nan, math.nan
    std = valid.std().item() if valid.numel() > 1 else 0.0
    return valid.mean().item(), std


def _resolve_weights(weights: Sequence[float] | None, count: int) -> torch.Tensor:
    """Weights as a tensor; None means 1.0 for every reward function."""
    if weights is None:
        return torch.ones(count, device="cpu")
    if len(weights) != count:
        raise ValueError(f"got {len(weights)} reward weights for {count} reward functions")
    return torch.tensor([float(weight) for weight in weights], dtype=torch.float32, device="cpu")


def _columns(rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """Every column except ``prompt`` as a list aligned with ``rows`` (None where a row lacks it)."""
    keys = dict.fromkeys(key for row in rows for key in row if key != "prompt")
    return {key: [row.get(key) for row in rows] for key in keys}


def compute_rewards(
    funcs: Sequence[RewardFunc],
    weights: Sequence[float] | None,
    prompts: Sequence[Any] | None,
    completions: Sequence[Any],
    completion_ids: Sequence[Any] | None,
    rows: Sequence[dict[str, Any]],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Score completions with every reward function and combine them.

    Returns the weighted sum per completion (float32, shape ``[len(completions)]``; a None reward counts
    as 0 in the sum, as TRL's ``nansum``) and the metrics ``rewards/<name>/mean`` and ``rewards/<name>/std``
    computed over the rows each function could score.
    """
    if not funcs:
        raise ValueError("at least one reward function is needed")
    size = len(completions)
    for label, values in (("prompts", prompts), ("completion_ids", completion_ids), ("rows", rows)):
        if values is not None and len(values) != size:
            raise ValueError(f"got {len(values)} {label} for {size} completions")
    weight_tensor = _resolve_weights(weights, len(funcs))
    batch = {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": completion_ids,
        **_columns(rows),
    }
    per_func = torch.stack([_as_tensor(reward_name(f), _call_reward(f, batch, size), size, prompts) for f in funcs])
    unscored = int(torch.isnan(per_func).all(dim=0).sum())
    if unscored:
        logger.warning(
            "%d of %d completions got no reward from any reward function (all returned None or NaN); as in TRL, "
            "they count as reward 0",
            unscored,
            size,
        )
    total = (per_func * weight_tensor.unsqueeze(1)).nansum(dim=0)
    metrics: dict[str, float] = {}
    for func, values in zip(funcs, per_func, strict=True):
        mean, std = _nan_mean_std(values)
        metrics[f"rewards/{reward_name(func)}/mean"] = mean
        metrics[f"rewards/{reward_name(func)}/std"] = std
    return total, metrics
