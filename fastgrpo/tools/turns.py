"""The tools of one generation call, as the engine asks for them (`fastgrpo.rollout.turns.Turns`): when a row's turn
ends, its text is parsed for calls, which run on the `ToolRunner`; when all of a row's calls have returned, the tool
turn's tokens continue the row. Each row keeps its conversation (the assistant's turns and the tools' results, as
TRL hands completions with tools to reward functions) and what its tools cost.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from fastgrpo.tools.format import ToolFormat
from fastgrpo.tools.functions import Tool
from fastgrpo.tools.runner import Result, ToolRunner, tool_error

logger = logging.getLogger(__name__)

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def argument_error(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """Why ``arguments`` do not fit ``tool``'s schema (missing, unknown or wrongly typed ones), None when they do."""
    parameters = tool.schema["function"].get("parameters", {})
    properties = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    unknown = [name for name in arguments if name not in properties]
    if missing or unknown:
        return f"error: tool {tool.name!r} takes {sorted(properties)}; missing {missing}, unknown {unknown}"
    for name, value in arguments.items():
        kinds = properties[name].get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds or []
        allowed = tuple(t for kind in kinds for t in _JSON_TYPES.get(kind, (object,)))
        wrong = allowed and (not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed))
        if wrong:
            return f"error: argument {name!r} of tool {tool.name!r} must be {'/'.join(kinds)}, got {value!r}"
    return None


@dataclass
class ToolRow:
    """One completion's conversation so far: its ``messages`` (assistant turns and tool results), where its current
    turn starts in the completion, its calls so far, their failures, the results it waits for and its tool time."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    turn_start: int = 0
    iterations: int = 0
    calls: int = 0
    failures: int = 0
    overlong: int = 0  # results that would not fit, rolled back
    seconds: float = 0.0
    length: int = 0  # completion tokens when its turn ended
    parsed: int = 0  # completion tokens its messages' turns cover (the last turn an EOS ended)
    waiting: list[Result | None] = field(default_factory=list)  # its calls' results by call number (None: running)
    names: list[str] = field(default_factory=list)  # its calls' tools by call number


class ToolTurns:
    """A generation call's tools, called as ``fmt`` shows and reads them, on ``runner``: ``fmt``'s tools, or each
    row's own (``row_tools``, by name: an environment's methods bound to the row's instance); each row calls tools in
    at most ``max_iterations`` turns; a completion holds at most ``max_tokens`` tokens. A tool's first failure is
    logged (``warned`` holds the tools already logged). With environments, ``environments`` holds each completion's
    instance, and ``prompts`` each completion's prompt with its reset's text appended (None where no reset returned
    text)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        fmt: ToolFormat,
        runner: ToolRunner,
        rows: int,
        max_tokens: int,
        max_iterations: int | None = None,
        warned: set[str] | None = None,
        row_tools: list[dict[str, Tool]] | None = None,
    ):
        self.tokenizer, self.format, self.runner = tokenizer, fmt, runner
        self.row_tools = row_tools or [{tool.name: tool for tool in fmt.tools}] * rows
        self.known = {name for tools in self.row_tools for name in tools}
        self.max_tokens, self.max_iterations = max_tokens, max_iterations
        self.warned = warned if warned is not None else set()  # tools whose failure was logged (shared by a run)
        self.rows = [ToolRow() for _ in range(rows)]
        self.environments: list[Any] | None = None
        self.prompts: list[Any] | None = None
        self.prompt_ids: list[list[int]] | None = None  # each row's prompt, which the template's parser reads

    def ended(self, index: int, completion: list[int]) -> bool:
        row = self.rows[index]
        prefix = (self.prompt_ids[index] if self.prompt_ids else []) + completion[: row.turn_start]
        message = self.format.parse(completion[row.turn_start :], prefix, list(self.row_tools[index].values()))
        row.messages.append(message)
        row.parsed = len(completion)
        calls = message.get("tool_calls") or []
        if not calls or (self.max_iterations is not None and row.iterations >= self.max_iterations):
            return False
        row.iterations += 1
        row.length, row.waiting, row.names = len(completion), [], []
        for k, call in enumerate(calls):
            row.calls += 1
            function = call.get("function") or {}
            name, arguments = function.get("name"), function.get("arguments", {})
            error, strict = call.get("error"), self.runner.strict  # an unreadable call's (strict only)
            if error is None and not (isinstance(name, str) and isinstance(arguments, dict)):
                error = tool_error(
                    f"a call needs a tool name and an object of arguments, got {function!r}"[:400], strict
                )
            name = name if isinstance(name, str) else "unreadable"
            row.names.append(name)
            row.waiting.append(None)
            tool = self.row_tools[index].get(name)
            if error is None and tool is None:  # TRL's words, or fastgrpo's
                known = f"unknown tool {name!r}; the tools are {sorted(self.row_tools[index])}"
                error = tool_error(known if strict else f"Tool {name} not found.", strict)
            if error is None and strict:  # else the tool's own call raises, as in TRL's loop
                error = argument_error(tool, arguments)
            if error is not None:
                row.waiting[k] = Result((index, k), error, True, 0.0)
            else:
                self.runner.submit((index, k), tool, arguments)
        return True

    def ready(self, block: bool) -> list[tuple[int, list[int] | None]]:
        out = []
        waiting = [i for i, row in enumerate(self.rows) if row.waiting]
        done = [i for i in waiting if None not in self.rows[i].waiting]
        results = self.runner.results(block=block and not done) if len(done) < len(waiting) else []
        for result in results:
            index, k = result.key
            self.rows[index].waiting[k] = result
            if index not in done and None not in self.rows[index].waiting:
                done.append(index)
        for index in done:
            out.append((index, self._continue(self.rows[index])))
        return out

    def _continue(self, row: ToolRow) -> list[int] | None:
        """The tokens of a row's tool turn, or None when they would not fit in the completion (TRL's rollback: the
        results are dropped and the row ends as it is); results that fill it exactly end it with them."""
        results, row.waiting = row.waiting, []
        row.failures += sum(r.failed for r in results)
        for name, result in zip(row.names, results, strict=True):
            known = name in self.known  # made-up names share one warning
            key = repr(name) if known else "unknown or unreadable calls"
            if result.failed and key not in self.warned:
                self.warned.add(key)
                logger.warning(
                    "%s ended in an error: the conversation gets the error as the call's result, counted in "
                    "tools/failure_frequency (later errors of %s are not logged): %s",
                    f"a call of tool {name!r}" if known else "a call of an unknown tool, or one that cannot be read,",
                    key,
                    result.content,
                )
        row.seconds += sum(r.seconds for r in results)
        messages = [{"role": "tool", "name": n, "content": r.content} for n, r in zip(row.names, results, strict=True)]
        tokens = self.format.suffix_ids(messages)
        if row.length + len(tokens) > self.max_tokens:
            row.overlong += 1
            return None
        row.messages += messages
        row.turn_start = row.length + len(tokens)
        return tokens

    def messages(self, completions: list[list[int]]) -> list[list[dict[str, Any]]]:
        """Each completion's messages, as TRL hands them to reward functions: its turns and the tools' results, and
        last the turn that the token budget cut off (no EOS ended it, so `ended` never read it), read as any turn is
        (`ToolFormat.parse`) but for calls that cannot be read, which TRL leaves as text (nothing runs them).
        ``completions``: the call's completion tokens, by completion."""
        out = []
        for index, (row, completion) in enumerate(zip(self.rows, completions, strict=True)):
            messages = list(row.messages)
            if len(completion) > row.turn_start and len(completion) != row.parsed:
                prefix = (self.prompt_ids[index] if self.prompt_ids else []) + completion[: row.turn_start]
                tools = list(self.row_tools[index].values())
                message = self.format.parse(completion[row.turn_start :], prefix, tools)
                calls = [c for c in message.pop("tool_calls", []) if "error" not in c]  # unreadable: text, as TRL
                messages.append({**message, "tool_calls": calls} if calls else message)
            out.append(messages)
        return out

    def metrics(self) -> dict[str, float]:
        """The call's tool metrics: TRL's ``tools/call_frequency`` and ``tools/failure_frequency`` (per completion, as
        TRL averages them) and fastgrpo's tool seconds and rolled-back results."""
        n = max(len(self.rows), 1)
        calls = sum(r.calls for r in self.rows)
        return {
            "tools/call_frequency": calls / n,
            "tools/failure_frequency": sum(r.failures for r in self.rows) / max(calls, 1),
            "tools/seconds": sum(r.seconds for r in self.rows),
            "tools/overlong": sum(r.overlong for r in self.rows) / n,
        }
