"""Config fields that carry their own help text and allowed values, as TRL's and transformers' argument dataclasses
do: `fastgrpo train --help` and ``docs/options.md`` are made from this metadata, and validation reads ``choices``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    choices: tuple[Any, ...] = (),
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field with ``help`` (one or two sentences) and, for a closed set of values, ``choices``."""
    metadata: dict[str, Any] = {"help": help}
    if choices:
        metadata["choices"] = tuple(choices)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
