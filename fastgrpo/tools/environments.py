"""Environments, as TRL's ``environment_factory`` takes them: a factory (or a dict of factories chosen by each row's
``environment`` column) of objects whose public methods are tools, with ``reset(**row)`` (its string, when it returns
one, is appended to the prompt's last message) and optionally ``get_reward()``, an extra reward source logged under
the class's name. Each completion gets its own instance, reset before its rollout; instances are reused across steps
(constructed once, reset often)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Collection, Sequence
from typing import Any

from fastgrpo.errors import EnvironmentFault
from fastgrpo.rewards import import_function
from fastgrpo.tools.functions import Tool, resolve_tools

EnvironmentSpec = str | Callable[[], Any]
_NOT_TOOLS = ("reset", "get_reward")


def _factory(spec: EnvironmentSpec, label: str) -> Callable[[], Any]:
    if callable(spec):
        return spec
    if isinstance(spec, str) and ":" in spec:
        return import_function(spec, f"{label} factory")
    raise ValueError(f"{label}: {spec!r} is not a factory; give 'module.path:ClassOrFunction' or a callable")


def _reward(cls: type) -> Callable[..., list[float | None]]:
    """A reward function scoring each completion whose environment is exactly ``cls`` by its ``get_reward()``."""
    if inspect.iscoroutinefunction(cls.get_reward):

        async def reward(environments: list[Any], **kwargs: Any) -> list[float | None]:
            return [await e.get_reward() if type(e) is cls else None for e in environments]

    else:

        def reward(environments: list[Any], **kwargs: Any) -> list[float | None]:
            return [e.get_reward() if type(e) is cls else None for e in environments]

    reward.__name__ = reward.__qualname__ = cls.__name__
    return reward


class Environments:
    """``spec`` resolved and probed before any model loads: one instance of each environment is made, its class must
    have ``reset``, and its public methods must be tools (typed, documented, named apart from ``standalone``'s)."""

    def __init__(
        self,
        spec: EnvironmentSpec | dict[str, EnvironmentSpec],
        standalone: Sequence[Tool] = (),
        option: str = "environment_factory",
    ):
        self.routed = isinstance(spec, dict)  # one environment per row, by its `environment` column
        specs: dict[str | None, EnvironmentSpec] = dict(spec) if isinstance(spec, dict) else {None: spec}
        if not specs:
            raise ValueError(f"{option} is an empty mapping; name at least one environment")
        self.factories: dict[str | None, Callable[[], Any]] = {}
        self.tools: dict[str | None, list[Tool]] = {}  # what each environment's prompts show: standalone + methods
        self.methods: dict[str | None, dict[str, str]] = {}  # each environment's tools: tool name -> attribute
        self.pool: dict[str | None, list[Any]] = {}
        self.reward_funcs: list[Callable[..., list[float | None]]] = []
        rewarded: list[type] = []
        for name, entry in specs.items():
            label = option if name is None else f"{option}[{name!r}]"
            factory = _factory(entry, label)
            try:
                instance = factory()
            except Exception as exc:  # user code: any failure is named with its environment
                raise ValueError(f"{label}: making an environment raised {type(exc).__name__}: {exc}") from exc
            cls = type(instance)
            members = [n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)]  # on the class: no property
            if "reset" not in members:
                raise ValueError(f"{label}: {cls.__name__} has no reset method; an environment needs reset(**row)")
            attributes = [n for n in members if n not in _NOT_TOOLS and not n.startswith("_")]
            own = resolve_tools([getattr(instance, n) for n in attributes], f"{label} ({cls.__name__})")
            clash = {t.name for t in own} & {t.name for t in standalone}
            if clash:
                raise ValueError(f"{label}: {cls.__name__}'s methods {sorted(clash)} have the names of tools in tools")
            if not own and not standalone:
                raise ValueError(f"{label}: {cls.__name__} has no public methods to call and tools is empty")
            self.factories[name], self.pool[name] = factory, [instance]
            self.tools[name] = [*standalone, *own]
            self.methods[name] = {t.name: n for t, n in zip(own, attributes, strict=True)}
            if "get_reward" in members and cls not in rewarded:  # one reward per class, as TRL
                rewarded.append(cls)
                self.reward_funcs.append(_reward(cls))

    def name(self, row: dict[str, Any]) -> str | None:
        """The environment of a dataset row (None with a single factory)."""
        return row.get("environment") if self.routed else None

    def reset_keywords(self, row: dict[str, Any]) -> dict[str, Any]:
        """What ``reset`` is called with: the row, without the ``environment`` column that routes it (as TRL)."""
        return {k: v for k, v in row.items() if k != "environment"} if self.routed else row

    def check_rows(self, rows: Sequence[dict[str, Any]], label: str = "dataset") -> None:
        """Refuse a row whose ``environment`` column is missing or names no environment (with a dict of factories),
        and one whose columns its environment's ``reset`` cannot take as keywords (no ``**row``, a column named
        ``self``), naming the row."""
        for index, row in enumerate(rows):
            if self.routed and row.get("environment") not in self.factories:
                raise ValueError(
                    f"{label} row {index}: environment {row.get('environment')!r} is not among the environments of "
                    f"environment_factory ({', '.join(map(str, self.factories))}); each row names one in its "
                    "'environment' column"
                )
            instance = self.pool[self.name(row)][0]
            try:
                inspect.signature(type(instance).reset).bind(instance, **self.reset_keywords(row))
            except TypeError as exc:
                raise ValueError(
                    f"{label} row {index}: {type(instance).__name__}.reset cannot take the row's columns "
                    f"{sorted(self.reset_keywords(row))} as keywords ({exc}); define it as reset(self, **row)"
                ) from None

    def draw(self, names: Sequence[str | None], busy: Collection[int] = ()) -> list[Any]:
        """One instance per completion, by environment name: the pool's, made anew only when it holds too few. An
        instance whose id is in ``busy`` (a call given up at its deadline still runs on it) is dropped from the
        pool."""
        for name, pool in self.pool.items():
            self.pool[name] = [instance for instance in pool if id(instance) not in busy]
        handed: dict[str | None, int] = {}
        out = []
        for name in names:
            pool, index = self.pool[name], handed.get(name, 0)
            if index == len(pool):
                try:
                    pool.append(self.factories[name]())
                except Exception as exc:  # user code: named with its environment
                    label = "environment_factory" if name is None else f"environment_factory[{name!r}]"
                    raise EnvironmentFault(
                        f"{label}: making environment {index + 1} raised {type(exc).__name__}: {exc}"
                    ) from exc
            handed[name] = index + 1
            out.append(pool[index])
        return out

    def bind(self, instance: Any, name: str | None) -> dict[str, Tool]:
        """The tools a completion with environment ``instance`` calls: its methods and the standalone tools."""
        own = self.methods[name]
        return {
            t.name: dataclasses.replace(t, function=getattr(instance, own[t.name])) if t.name in own else t
            for t in self.tools[name]
        }
