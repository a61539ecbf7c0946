"""Reward functions with TRL's calling convention and reward aggregation (answers are read by `fastgrpo.answers`).

A reward function is called as ``f(prompts=..., completions=..., completion_ids=..., **columns)``: every
dataset column except ``prompt`` arrives as a list aligned with ``completions``. Completions are strings,
or lists of ``{"role": "assistant", "content": ...}`` messages for conversational prompts
(see :func:`completion_text`). A function returns one ``float`` per completion, or ``None`` for a row it
cannot score. `fastgrpo.reward_calls` calls them (async ones too, with TRL's keyword arguments).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from fastgrpo.answers import (
    completion_text,
    extract_boxed,
    extract_hash_answer,
    extract_last_number,
    normalize_number,
)
from fastgrpo.reward_calls import RewardFunc, call_reward_funcs, reward_name, row_label
from fastgrpo.reward_model import RewardModel

logger = logging.getLogger(__name__)


MATH_VERIFY_TIMEOUT_S = 5


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


# The names TRL's `trl grpo` script takes in reward_funcs: functions of `trl.rewards` (the overlong punishment made
# with the script's values), logged under their own names as TRL logs them.
TRL_SCRIPT_REWARDS: dict[str, dict[str, int] | None] = {
    "accuracy_reward": None,
    "reasoning_accuracy_reward": None,
    "think_format_reward": None,
    "get_soft_overlong_punishment": {"max_completion_len": 1280, "soft_punish_cache": 256},
}
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")  # TRL's script's "my_lib.rewards.custom_reward"


def trl_script_reward(name: str) -> RewardFunc:
    """The reward function TRL's script names ``name`` (`TRL_SCRIPT_REWARDS`)."""
    func = import_function(f"trl.rewards:{name}")
    made = TRL_SCRIPT_REWARDS[name]
    return func if made is None else func(**made)


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


def import_function(spec: str, kind: str = "reward function") -> Callable[..., Any]:
    """Import a function given as ``"module.path:function"`` (a ``kind``: a reward function, a tool); a module in
    the current directory is found, as ``python -m`` finds it."""
    module_name, _, attribute = spec.partition(":")
    if not module_name.strip() or not attribute.strip():
        raise ValueError(f"{kind} {spec!r} must be 'module.path:function' (a module and a name, both given)")
    cwd = os.getcwd()
    searched = cwd not in sys.path and "" not in sys.path
    if searched:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} for {kind} {spec!r}: {exc}") from exc
    except Exception as exc:  # the module's own code failed as it ran (a SyntaxError names its file and line)
        raise ValueError(
            f"cannot import module {module_name!r} for {kind} {spec!r}: importing it raised {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        if searched:
            sys.path.remove(cwd)
    func = getattr(module, attribute, None)
    if not callable(func):
        raise ValueError(f"{kind} {spec!r}: module {module_name!r} has no callable {attribute!r}")
    return func


def resolve_reward_funcs(names_or_callables: Sequence[str | RewardFunc]) -> list[RewardFunc]:
    """Turn registry names (fastgrpo's, and TRL's script's `TRL_SCRIPT_REWARDS`), ``"module.path:function"`` (or
    TRL's script's ``"module.path.function"``) strings and callables into reward functions, and a model (a
    directory or hub id of a sequence-classification model, or a ``PreTrainedModel``) into a `RewardModel`, checked
    but not loaded (`fastgrpo.reward_model.load_reward_models` loads it beside the policy)."""
    funcs: list[RewardFunc] = []
    for spec in names_or_callables:
        if isinstance(spec, PreTrainedModel):  # a model object, as TRL takes one
            funcs.append(RewardModel(spec))
        elif callable(spec):
            funcs.append(spec)
        elif spec in REWARD_FUNCS:
            funcs.append(_named(REWARD_FUNCS[spec], spec))
        elif isinstance(spec, str) and ":" in spec:
            funcs.append(import_function(spec))
        elif spec in TRL_SCRIPT_REWARDS:
            funcs.append(trl_script_reward(spec))
        elif isinstance(spec, str) and ("/" in spec or os.path.isdir(os.path.expanduser(spec))):
            funcs.append(RewardModel(spec))  # a sequence-classification reward model, as TRL reads one
        elif isinstance(spec, str) and DOTTED.fullmatch(spec):
            module, _, name = spec.rpartition(".")
            funcs.append(import_function(f"{module}:{name}"))
        else:
            valid = ", ".join([*REWARD_FUNCS, *TRL_SCRIPT_REWARDS])
            raise ValueError(f"unknown reward function {spec!r}; valid names: {valid} (or 'module.path:function')")
    return funcs


def required_columns(func: RewardFunc) -> list[str]:
    """The dataset columns ``func`` takes without a default (besides prompts, completions, completion_ids and the
    keyword arguments the trainer passes)."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a callable without an inspectable signature
        return []
    given = {"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra", "environments"}
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


def _as_tensor(name: str, values: Any, size: int, prompts: Sequence[Any] | None) -> torch.Tensor:
    """Check a reward function's output and turn it into a float64 tensor with NaN for None (and for NaN, which
    TRL treats as None). An infinite reward is an error naming the function and the row: it would make every weight
    NaN at the next update."""
    if not isinstance(values, (list, tuple)) or len(values) != size:
        got = f"length {len(values)}" if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(f"reward function {name!r} must return a list of {size} floats or None, got {got}")
    for index, value in enumerate(values):
        if isinstance(value, (str, bytes)):
            raise ValueError(
                f"reward function {name!r} returned the text {value!r} for {row_label(prompts, index)}; rewards are "
                "numbers (or None for a row the function cannot score), not text"
            )
    _warn_once(name, "True/False", any(isinstance(v, bool) for v in values), "read as 1/0, as TRL reads them")
    _warn_once(
        name,
        "NaN",
        any(isinstance(v, float) and math.isnan(v) for v in values),
        "read as None (the row unscored by it), as TRL reads it; return None where a row cannot be scored",
    )
    try:
        floats = [math.nan if value is None else float(value) for value in values]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"reward function {name!r} returned a value that is not a number: {exc}") from exc
    for index, value in enumerate(floats):
        if math.isinf(value):
            raise ValueError(
                f"reward function {name!r} returned {value} for {row_label(prompts, index)}; rewards must be finite "
                "numbers, or None for a row the function cannot score. The run stopped before this step's update."
            )
    return torch.tensor(floats, dtype=torch.float64, device="cpu")


_WARNED: set[tuple[str, str]] = set()  # (reward function, what it returned) already logged in this process
_WARNED_LOCK = threading.Lock()


def _warn_once(name: str, what: str, returned: bool, meaning: str) -> None:
    """Log, the first time reward function ``name`` ``returned`` ``what``, how it is read (``meaning``)."""
    with _WARNED_LOCK:
        if not returned or (name, what) in _WARNED:
            return
        _WARNED.add((name, what))
    logger.warning("reward function %r returned %s: %s (said once)", name, what, meaning)


def _nan_mean_std(values: torch.Tensor) -> tuple[float, float]:
    """Mean and (unbiased) standard deviation over the non-NaN entries, as TRL's ``nanmean`` and ``nanstd``: NaN
    when there are none (the std also with one)."""
    valid = values[~torch.isnan(values)]
    if valid.numel() == 0:
        return math.nan, math.nan
    std = valid.std().item() if valid.numel() > 1 else math.nan
    return valid.mean().item(), std


def function_metrics(per_func: torch.Tensor, names: Sequence[str]) -> dict[str, float]:
    """``rewards/<name>/mean`` and ``rewards/<name>/std`` of each column of ``per_func`` (``[N, F]``), over the rows
    its function scored (NaN where it scored none)."""
    metrics: dict[str, float] = {}
    for name, values in zip(names, per_func.unbind(dim=1), strict=True):
        metrics[f"rewards/{name}/mean"], metrics[f"rewards/{name}/std"] = _nan_mean_std(values)
    return metrics


def _resolve_weights(weights: Sequence[float] | None, count: int) -> torch.Tensor:
    """Weights as a tensor; None means 1.0 for every reward function."""
    if weights is None:
        return torch.ones(count, dtype=torch.float64, device="cpu")
    if len(weights) != count:
        raise ValueError(f"got {len(weights)} reward weights for {count} reward functions")
    return torch.tensor([float(weight) for weight in weights], dtype=torch.float64, device="cpu")


def _columns(rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """Every column except ``prompt`` as a list aligned with ``rows`` (None where a row lacks it)."""
    keys = dict.fromkeys(key for row in rows for key in row if key != "prompt")
    return {key: [row.get(key) for row in rows] for key in keys}


def reward_matrix(
    funcs: Sequence[RewardFunc],
    prompts: Sequence[Any] | None,
    completions: Sequence[Any],
    completion_ids: Sequence[Any] | None,
    rows: Sequence[dict[str, Any]],
    extra: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Score completions with every reward function (async ones within ``timeout`` seconds, `call_reward_funcs`).

    Each function is called with ``prompts``, ``completions``, ``completion_ids``, every dataset column but
    ``prompt`` (`_columns`) and ``extra`` (the trainer passes TRL's ``trainer_state``, ``log_metric`` and
    ``log_extra``). Returns the ``[len(completions), len(funcs)]`` float64 rewards, NaN where a function returned
    None (or NaN), and the metrics ``rewards/<name>/mean`` and ``rewards/<name>/std`` over the rows each function
    scored (as TRL's). A completion that no function scores is warned about, naming the functions and its row.
    """
    if not funcs:
        raise ValueError("at least one reward function is needed")
    size = len(completions)
    for label, values in (("prompts", prompts), ("completion_ids", completion_ids), ("rows", rows)):
        if values is not None and len(values) != size:
            raise ValueError(f"got {len(values)} {label} for {size} completions")
    batch = {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": completion_ids,
        **_columns(rows),
        **(extra or {}),
    }
    outputs = call_reward_funcs(funcs, batch, size, timeout)
    names = [reward_name(f) for f in funcs]
    per_func = torch.stack(
        [_as_tensor(name, output, size, prompts) for name, output in zip(names, outputs, strict=True)], dim=1
    )
    unscored = torch.isnan(per_func).all(dim=1)
    if unscored.any():
        first = int(unscored.nonzero()[0])
        logger.warning(
            "%d of %d completions got no reward from any reward function (%s returned None or NaN; the first is %s); "
            "as in TRL, their reward is NaN, left out of their group's mean and std, and their advantage is 0",
            int(unscored.sum()),
            size,
            ", ".join(repr(name) for name in names),
            row_label(prompts, first),
        )
    return per_func, function_metrics(per_func, names)


def weighted_rewards(per_func: torch.Tensor, weights: Sequence[float] | None) -> torch.Tensor:
    """The weighted sum of each row's rewards (``per_func`` ``[N, F]`` -> ``[N]``, float64): a None reward counts as
    0 in the sum (TRL's ``nansum``), and a row that no function scored is NaN."""
    weight_tensor = _resolve_weights(weights, per_func.shape[1]).to(per_func.dtype)
    total = (per_func * weight_tensor.unsqueeze(0)).nansum(dim=1)
    return total.masked_fill(torch.isnan(per_func).all(dim=1), math.nan)


def compute_rewards(
    funcs: Sequence[RewardFunc],
    weights: Sequence[float] | None,
    prompts: Sequence[Any] | None,
    completions: Sequence[Any],
    completion_ids: Sequence[Any] | None,
    rows: Sequence[dict[str, Any]],
    extra: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Score completions with every reward function (async ones within ``timeout`` seconds) and combine them
    (`reward_matrix`, `weighted_rewards`).

    Returns the weighted sum per completion (float64, shape ``[len(completions)]``; a None reward counts as 0 in the
    sum, as TRL's ``nansum``, and a completion no function scores is NaN) and the metrics ``rewards/<name>/mean`` and
    ``rewards/<name>/std`` computed over the rows each function could score.
    """
    _resolve_weights(weights, len(funcs))  # refused before any function runs
    per_func, metrics = reward_matrix(funcs, prompts, completions, completion_ids, rows, extra, timeout)
    return weighted_rewards(per_func, weights), metrics
