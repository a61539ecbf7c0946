"""A training run's tools and environments: resolved from the config before anything loads, shown to the model in
every prompt, run for every rollout (`fastgrpo.tools.turns.ToolTurns`) and logged."""

from __future__ import annotations

import logging
import threading
from typing import Any

from transformers import PreTrainedTokenizerBase

from fastgrpo.config import GRPOConfig
from fastgrpo.errors import EnvironmentFault
from fastgrpo.grpo.prompts import StepPrompts
from fastgrpo.tools.environments import Environments
from fastgrpo.tools.format import ToolFormat
from fastgrpo.tools.functions import Tool, resolve_tools
from fastgrpo.tools.runner import ToolRunner
from fastgrpo.tools.turns import ToolTurns

__all__ = ["RunTools", "ToolTurns", "check_tool_rows", "resolve_run_tools", "rollout_prompts", "with_observation"]

logger = logging.getLogger(__name__)


def check_tool_rows(
    tools: bool, environments: Environments | None, rows: list[dict[str, Any]], label: str = "dataset"
) -> None:
    """With tools or environments, refuse a row whose prompt is a plain string, or (with a dict of environments)
    whose ``environment`` names none; ``label`` names the rows' dataset."""
    if not tools and environments is None:
        return
    plain = next((i for i, row in enumerate(rows) if isinstance(row.get("prompt"), str)), None)
    if plain is not None:
        raise ValueError(f"{label} row {plain}: its prompt is a plain string; tools need chat prompts (message lists)")
    if environments is not None:
        environments.check_rows(rows, label)


def reset(instance: Any, row: dict[str, Any], index: int, timeout: float) -> str | None:
    """``instance.reset(**row)`` for completion ``index``, on a thread of its own (as the environment's methods run,
    called as tools), within ``timeout`` seconds (``tool_timeout``): None or the text appended to its prompt."""
    name = type(instance).__name__
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = instance.reset(**row)
        except BaseException as exc:  # noqa: BLE001 - user code: any failure, SystemExit too, is named below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name=f"{name}.reset")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise EnvironmentFault(
            f"{name}.reset did not return within tool_timeout ({timeout:g} s) on completion {index}; raise "
            "tool_timeout if it needs longer"
        )
    if "error" in outcome:
        exc = outcome["error"]
        raise EnvironmentFault(f"{name}.reset raised on completion {index}: {type(exc).__name__}: {exc}") from exc
    observation = outcome["value"]
    if observation is not None and not isinstance(observation, str):
        raise EnvironmentFault(
            f"{name}.reset returned {type(observation).__name__} on completion {index}: it returns the text appended "
            "to the prompt, or None"
        )
    return observation


def with_observation(prompt: list[dict[str, Any]], observation: str) -> list[dict[str, Any]]:
    """``prompt`` with ``observation`` appended to its last message (as TRL appends what ``reset`` returns)."""
    return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]


def resolve_run_tools(
    config: GRPOConfig, reward_funcs: list[Any], dataset: list[dict[str, Any]]
) -> tuple[list[Tool], Environments | None]:
    """``tools`` and ``environment_factory`` resolved and probed before any model loads, every dataset row's prompt
    (chat messages) and environment checked; the ``get_reward`` of its environments joins ``reward_funcs`` (in
    place)."""
    tools = resolve_tools(config.tools)
    environments = Environments(config.environment_factory, tools) if config.environment_factory else None
    check_tool_rows(bool(tools), environments, dataset)
    if environments is None:
        return tools, None
    reward_funcs += environments.reward_funcs
    if not reward_funcs:
        raise ValueError(
            "no reward source: reward_funcs is empty and no environment of environment_factory defines get_reward"
        )
    return tools, environments


def rollout_prompts(
    tools: RunTools | None, rows: list[dict[str, Any]], generations: int, prompts: StepPrompts
) -> tuple[list[list[int]], int, ToolTurns | None]:
    """A rollout's ``(prompt ids, completions per prompt id, turns)``: the rows' prompts, or with tools
    `RunTools.start`'s."""
    if tools is None:
        return prompts.encode(rows), generations, None
    return tools.start(rows, generations, prompts)


class RunTools:
    """``tools`` (and ``environments``' methods) as ``tokenizer``'s chat template shows them (or the fallback
    format), run on one `ToolRunner`."""

    def __init__(
        self,
        tools: list[Tool],
        environments: Environments | None,
        tokenizer: PreTrainedTokenizerBase,
        config: GRPOConfig,
    ):
        self.tokenizer, self.config, self.environments = tokenizer, config, environments
        shown = environments.tools if environments is not None else {None: tools}
        strict = config.strict_tool_calls
        self.formats = {name: ToolFormat(tokenizer, listed, strict) for name, listed in shown.items()}
        self.runner = ToolRunner(config.tool_workers, config.tool_timeout, strict=strict)
        self.warned: set[str] = set()  # the tools whose failure the log has shown (once each per run)
        for name, fmt in self.formats.items():
            where = "" if name is None else f" (environment {name!r})"
            logger.info("tools %s%s, shown and read in %s", [t.name for t in fmt.tools], where, fmt.name)

    def environment(self, row: dict[str, Any]) -> str | None:
        """The environment of a dataset row (None without environments, or with a single factory)."""
        return self.environments.name(row) if self.environments is not None else None

    def render(self, row: dict[str, Any], prompt: Any = None) -> tuple[Any, dict[str, Any]]:
        """A row's prompt messages (or ``prompt``) with its tools shown, and the chat-template keywords that show
        them."""
        prompt = row["prompt"] if prompt is None else prompt  # chat messages: `check_tool_rows` refused strings
        return self.formats[self.environment(row)].conversation(prompt)

    def start(
        self, rows: list[dict[str, Any]], generations: int, prompts: StepPrompts
    ) -> tuple[list[list[int]], int, ToolTurns]:
        """A rollout's prompts and tools: ``(prompt ids, completions per prompt id, the turns)``. With environments,
        each completion's instance is reset with its row; when a reset returns text, the prompts are the
        completions' own (one per completion, unless each group's are the same)."""
        ids, per_prompt, turns = self._start(rows, generations, prompts)
        turns.prompt_ids = [ids[i // per_prompt] for i in range(len(rows) * generations)]
        return ids, per_prompt, turns

    def _start(
        self, rows: list[dict[str, Any]], generations: int, prompts: StepPrompts
    ) -> tuple[list[list[int]], int, ToolTurns]:
        """`start`'s prompts and turns, without each row's prompt ids (which `start` gives the turns' parser)."""
        cfg, n = self.config, len(rows) * generations
        names = [self.environment(row) for row in rows for _ in range(generations)]
        fmt = self.formats[names[0]]  # parsing and the tool turn's tokens are the template's, whatever the tools
        limits = (cfg.max_completion_length, cfg.max_tool_calling_iterations, self.warned)
        if self.environments is None:
            return prompts.encode(rows), generations, ToolTurns(self.tokenizer, fmt, self.runner, n, *limits)
        instances = self.environments.draw(names, busy=self.runner.busy_owners())
        expanded = [row for row in rows for _ in range(generations)]
        keywords = [self.environments.reset_keywords(row) for row in expanded]
        observations = [reset(instances[k], row, k, cfg.tool_timeout) for k, row in enumerate(keywords)]
        row_tools = [self.environments.bind(i, name) for i, name in zip(instances, names, strict=True)]
        turns = ToolTurns(self.tokenizer, fmt, self.runner, n, *limits, row_tools=row_tools)
        turns.environments = instances
        if all(o is None for o in observations):
            return prompts.encode(rows), generations, turns
        turns.prompts = [
            row["prompt"] if o is None else with_observation(row["prompt"], o)
            for row, o in zip(expanded, observations, strict=True)
        ]
        ids = [prompts.encode_prompt(*self.render(r, p)) for r, p in zip(expanded, turns.prompts, strict=True)]
        if all(ids[i] == ids[i - i % generations] for i in range(n)):  # each group shares its prompt
            return ids[::generations], generations, turns
        return ids, 1, turns

    def close(self) -> None:
        self.runner.close()
