"""Calling reward functions as TRL does: the keyword arguments TRL passes besides the batch's (`TrainerState`,
`RewardLog`'s ``log_metric`` and ``log_extra``), the name in metrics (`reward_name`), the synchronous functions one
after another and the async ones concurrently (`call_reward_funcs`), and a failing function named with its first
failing row (`RewardFunctionError`)."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastgrpo.answers import content_text
from fastgrpo.errors import RewardFunctionError

RewardFunc = Callable[..., list[float | None]]

_EXCERPT_CHARS = 80


@dataclass
class TrainerState:
    """What a reward function gets as TRL's ``trainer_state`` keyword argument (for rewards shaped by the training's
    progress): the optimizer steps done so far and the run's last step."""

    global_step: int
    max_steps: int


class RewardLog:
    """TRL's ``log_metric(name, value)`` and ``log_extra(column, values)`` callbacks for reward functions: the values
    given to ``log_metric`` during a step are averaged over the step (and over the processes) into its metrics, the
    columns given to ``log_extra`` are printed beside the sample completions."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}
        self.columns: dict[str, list[Any]] = {}

    def log_metric(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list[Any]) -> None:
        self.columns.setdefault(column, []).extend(values)

    def keywords(self, state: TrainerState) -> dict[str, Any]:
        """The keyword arguments TRL passes every reward function besides the batch's."""
        return {"trainer_state": state, "log_metric": self.log_metric, "log_extra": self.log_extra}

    def metrics(self) -> dict[str, float]:
        """Each ``log_metric`` name's mean over the step's values of every process (the sum over the count)."""
        from fastgrpo import distributed

        parts = distributed.gather({name: (sum(v), len(v)) for name, v in self.values.items()})
        totals: dict[str, list[float]] = {}
        for part in parts:
            for name, (total, count) in part.items():
                totals.setdefault(name, [0.0, 0])
                totals[name][0] += total
                totals[name][1] += count
        return {name: total / count for name, (total, count) in sorted(totals.items())}


def reward_name(func: RewardFunc) -> str:
    """Name used in metrics: the function's ``__name__``, else its class name."""
    return getattr(func, "__name__", None) or type(func).__name__


def _row_slice(batch: dict[str, Any], index: int) -> dict[str, Any]:
    """Keyword arguments restricted to the row ``index`` (each list cut to one element; the trainer's state and the
    logging callbacks are passed as they are)."""
    return {key: value[index : index + 1] if isinstance(value, list) else value for key, value in batch.items()}


def row_label(prompts: Sequence[Any] | None, index: int) -> str:
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
                    f"reward function {name!r} failed on {row_label(batch['prompts'], index)}: {_failure(row_error)}"
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


def is_async(func: RewardFunc) -> bool:
    """Whether calling ``func`` returns a coroutine (an ``async def`` function, or an object whose ``__call__`` is
    one), as TRL's async reward functions."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def call_reward_funcs(
    funcs: Sequence[RewardFunc], batch: dict[str, Any], size: int, timeout: float | None = None
) -> list[Any]:
    """Every function's output on ``batch``: the synchronous ones one after another, then the async ones
    concurrently (``asyncio.gather`` in an event loop of their own, as TRL runs them), each within ``timeout``
    seconds (None: no deadline; past it, a `RewardFunctionError` naming the function and the ``reward_timeout``
    option). A failing async function is named with its first failing row as a synchronous one is
    (`_call_reward`)."""
    outputs: list[Any] = [None] * len(funcs)
    waiting = []
    for i, func in enumerate(funcs):
        if is_async(func):
            waiting.append(i)
        else:
            outputs[i] = _call_reward(func, batch, size)
    if waiting:

        async def guarded(i: int) -> Any:
            try:
                return await funcs[i](**batch)
            except (Exception, SystemExit):  # a TimeoutError of its own too: not ours
                return _CallFailed()

        async def run(i: int) -> Any:
            task = asyncio.ensure_future(guarded(i))
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                task.cancel()
                return _TimedOut()
            return task.result()

        async def run_all() -> list[Any]:
            return await asyncio.gather(*(run(i) for i in waiting))

        for i, output in zip(waiting, asyncio.run(run_all()), strict=True):
            if isinstance(output, _TimedOut):
                raise RewardFunctionError(
                    f"reward function {reward_name(funcs[i])!r} did not return within reward_timeout ({timeout:g} s) "
                    f"on a batch of {size} completions; raise reward_timeout if it needs longer"
                )
            if isinstance(output, _CallFailed):  # called again one row at a time, to name the row that fails
                output = _call_reward(_synchronous(funcs[i], timeout), batch, size)
            outputs[i] = output
    return outputs


class _CallFailed:
    """The result of an async reward function that raised on the whole batch."""


class _TimedOut:
    """The result of an async reward function that outlived its deadline."""


def _synchronous(func: RewardFunc, timeout: float | None = None) -> RewardFunc:
    """An async reward function as a synchronous one (each call runs to completion, or to ``timeout``), named as it
    is."""

    @functools.wraps(func)
    def call(**kwargs: Any) -> Any:
        return asyncio.run(asyncio.wait_for(func(**kwargs), timeout))

    call.__name__ = reward_name(func)
    return call
