"""A controller's learnt state as JSON (`AdaptiveController.state_dict`, saved with a checkpoint): tree shapes, tuples
and sets, and dicts keyed by any of them, written as tagged JSON values and read back exactly (floats as Python
writes them, inf and nan included)."""

from __future__ import annotations

from typing import Any

from fastgrpo.rollout.tree import TreeShape


def to_json(value: Any) -> Any:
    """``value`` (of shapes, tuples, sets, dicts of any keys, lists and scalars) as JSON-able data."""
    if isinstance(value, TreeShape):
        return {"shape": [value.nodes, value.top_k, value.max_levels, value.drafter]}
    if isinstance(value, set):
        return {"set": [to_json(v) for v in sorted(value)]}
    if isinstance(value, tuple):
        return {"tuple": [to_json(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[to_json(k), to_json(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    return value


def from_json(value: Any) -> Any:
    """What `to_json` made, back."""
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    ((kind, items),) = value.items()
    if kind == "shape":
        return TreeShape(*items)
    if kind == "dict":
        return {from_json(k): from_json(v) for k, v in items}
    return {"tuple": tuple, "set": set}[kind](from_json(v) for v in items)
