"""Config fields that carry their own help text and allowed values, as TRL's and transformers' argument dataclasses
do: `fastgrpo train --help` and ``docs/options.md`` are made from this metadata, and validation reads ``choices`` and
``valid`` (`check_ranges`); an option marked ``path`` has ``~`` expanded where options are read
(`fastgrpo.config.files`), so that the config holds, and ``config.yaml`` records, the path a command uses."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

# What a float32 (the dtype the options compute with: logits, losses, the optimizer's update) can hold: the largest
# finite value, and the smallest normal one (below it a value loses its precision and, divided by, overflows).
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid values of a numeric option: above ``low`` (or equal, unless ``low_open``) and below ``high`` (or
    equal, unless ``high_open``); None is unbounded on that side."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return f"{'<' if self.high_open else '<='} {self.high}"


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    choices: tuple[Any, ...] = (),
    valid: Range | None = None,
    default_factory: Callable[[], Any] | None = None,
    path: bool = False,
    joins: str | None = None,
) -> Any:
    """A dataclass field with ``help`` (one or two sentences) and, for a closed set of values, ``choices``, or for a
    numeric option its ``valid`` range; ``path``: the option names a file or directory (``~`` is expanded);
    ``joins``: a string option also given as a list of strings, read as them joined by ``joins``."""
    metadata: dict[str, Any] = {"help": help}
    if path:
        metadata["path"] = True
    if joins is not None:
        metadata["joins"] = joins
    if choices:
        metadata["choices"] = tuple(choices)
    if valid is not None:
        metadata["valid"] = valid
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def check_ranges(config: Any, prefix: str = "") -> None:
    """Raise ``ValueError`` naming the first option of ``config`` (``prefix`` + its name) outside its ``valid`` range
    (None, where an option allows it, is not checked)."""
    for f in dataclasses.fields(config):
        valid, value = f.metadata.get("valid"), getattr(config, f.name)
        if valid is None or value is None or isinstance(value, str):
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not valid.holds(value):
            raise ValueError(f"{prefix}{f.name} must be {valid}, got {value!r}")


def _number_problem(value: float) -> str | None:
    """Why a float option's value cannot be computed with, or None."""
    if not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if abs(value) > FLOAT32_MAX:
        return f"must fit a float32 (at most {FLOAT32_MAX:.4g} in size), which computes with it, got {value!r}"
    if 0 < abs(value) < FLOAT32_TINY:
        return (
            f"must be 0 or at least {FLOAT32_TINY:.4g} in size (the smallest normal float32, which computes with "
            f"it), got {value!r}"
        )
    return None


def check_numbers(config: Any, prefix: str = "") -> None:
    """Raise ``ValueError`` naming the first float option of ``config`` (nested ones dotted, list entries indexed)
    that is NaN or infinite, or that a float32 cannot hold (beyond its range, or a nonzero value below its smallest
    normal number): rewards, temperatures and rates are computed with in float32."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            check_numbers(value, f"{prefix}{f.name}.")
            continue
        items = list(enumerate(value)) if isinstance(value, list | tuple) else [(None, value)]
        for index, item in items:
            if isinstance(item, float) and (problem := _number_problem(item)) is not None:
                name = f"{prefix}{f.name}" + ("" if index is None else f"[{index}]")
                raise ValueError(f"{name} {problem}")


def joined(value: Any, joins: str | None) -> Any:
    """The value of an option marked ``joins`` (`option`) given as a list of strings, YAML's or a command line's
    ``[eagle, suffix]``, as its items joined (``eagle+suffix``); any other value as it is."""
    if joins and isinstance(value, str) and value.startswith("[") and value.endswith("]"):
        import yaml

        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
    if joins and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return joins.join(value)
    return value
