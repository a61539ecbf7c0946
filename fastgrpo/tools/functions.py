"""Tool functions, as TRL takes them: plain or async Python functions with type hints and a docstring, from which
transformers builds the JSON schema the chat template shows the model (``get_json_schema``). Given by name in a
config, a tool is ``module.path:function`` or one of the built-in `TOOLS`."""

from __future__ import annotations

import ast
import inspect
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from fastgrpo.rewards import import_function

_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def concurrent(function: Callable[..., Any]) -> Callable[..., Any]:
    """Declare a plain tool safe to run in several calls at once (it keeps no state, or guards its own): the runner
    then calls it on up to ``tool_workers`` threads at once. Other plain tools run one call at a time (per
    environment instance, for an environment's methods), as TRL's loop calls them; async tools run concurrently on
    one event loop, as TRL gathers them."""
    function.fastgrpo_concurrent = True
    return function


def is_concurrent(function: Callable[..., Any]) -> bool:
    """Whether ``function`` (or the function of a bound method) was declared `concurrent`."""
    return bool(getattr(getattr(function, "__func__", function), "fastgrpo_concurrent", False))


@concurrent
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression, for example "12 * (3 + 4)".
    """

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    result = value(ast.parse(expression.strip(), mode="eval").body)
    return str(int(result) if isinstance(result, float) and result.is_integer() else result)


TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}


@dataclass(frozen=True)
class Tool:
    """A callable tool: its ``name``, the ``function``, its JSON ``schema`` and whether it is a coroutine function."""

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]
    is_async: bool


def resolve_tools(specs: Sequence[str | Callable[..., Any]], option: str = "tools") -> list[Tool]:
    """Tools from callables, ``module.path:function`` names and built-in names, each checked before any model loads:
    it imports, has type hints and a docstring that give a JSON schema, and no other tool has its name."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        if callable(spec):
            function = spec
        elif isinstance(spec, str) and spec in TOOLS:
            function = TOOLS[spec]
        elif isinstance(spec, str) and ":" in spec:
            function = import_function(spec, f"{option} entry")
        else:
            raise ValueError(
                f"{option}: unknown tool {spec!r}; valid names: {', '.join(TOOLS)} (or 'module.path:function')"
            )
        name = getattr(function, "__name__", repr(function))
        try:
            schema = get_json_schema(function)
        except Exception as exc:  # transformers raises its own types for missing hints and docstrings
            raise ValueError(f"{option}: tool {name!r} cannot be described to the model: {exc}") from exc
        if name in tools:
            raise ValueError(f"{option}: two tools are named {name!r}; tool names must differ")
        tools[name] = Tool(name, function, schema, inspect.iscoroutinefunction(function))
    return list(tools.values())
