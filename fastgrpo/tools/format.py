"""How a chat template shows tools to the model, how the model's calls are read, and the tokens of a tool turn.

A template that renders tools (``apply_chat_template(tools=...)`` shows them, and a conversation of a call and its
result keeps the call's name, its arguments and the result) is used as it is, and calls are parsed by transformers'
``parse_response`` where the tokenizer has a ``response_template``. Other templates, the embedded SmolLM2's among them,
get the fallback format: the tools' JSON schemas in the system message, a call written as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the assistant's turn, and each result a message of
role ``tool``. Either way the tool turn's tokens are the template's own: those a conversation gains from the tool
messages and the next assistant header, after the turn's EOS.
"""

from __future__ import annotations

import json
import re
from typing import Any

from transformers import PreTrainedTokenizerBase

from fastgrpo.tools.functions import Tool

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FALLBACK_SYSTEM = (
    "You can call these tools, each described by a JSON schema:\n{schemas}\n"
    'To call a tool, write <tool_call>{{"name": <tool name>, "arguments": {{<argument>: <value>}}}}</tool_call> '
    "and end your turn; the tool's result comes back in a message from the tool. For example:\n"
    '<tool_call>{{"name": "{first}", "arguments": {example}}}</tool_call>'
)


def renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template shows the tools it is given and keeps a call's name, arguments and result."""
    probe = {"type": "function", "function": {"name": "probe_tool_3f1", "description": "probe", "parameters": {}}}
    call = {"type": "function", "function": {"name": "probe_tool_3f1", "arguments": {"probe_arg_9c2": "value_7d4"}}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "probe_tool_3f1", "content": "result_5e8"},
    ]
    try:
        shown = tokenizer.apply_chat_template(messages[:1], tools=[probe], tokenize=False)
        plain = tokenizer.apply_chat_template(messages[:1], tokenize=False)
        exchange = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that refuses the roles or the tools (jinja raises its own errors)
        return False
    kept = ("probe_tool_3f1", "probe_arg_9c2", "value_7d4", "result_5e8")
    return shown != plain and all(s in exchange for s in kept)


def written_calls(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` written into its content in the fallback format (a template without
    tool support drops them), other messages as they are."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = "".join(
        "<tool_call>"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"].get("arguments", {})})
        + "</tool_call>"
        for c in calls
    )
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": (message.get("content") or "") + written}


def readable_calls(calls: Any) -> None:
    """Raise ``ValueError`` unless ``calls`` (a parsed turn's ``tool_calls``, or None) are a list of calls each
    naming its tool, as TRL's ``parse_response`` validates them; a call without arguments gets ``{}``."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("a tool call must name its tool")
        if function.get("arguments") is None:
            function["arguments"] = {}


class ToolFormat:
    """The tools of a run, shown to the model and read back from its turns by ``tokenizer``'s chat template (or the
    fallback format, `name` tells which). A turn whose calls cannot be read is text, as TRL reads it; ``strict`` (the
    ``strict_tool_calls`` option): each unreadable call is an error call instead (`parse`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: list[Tool], strict: bool = False):
        self.tokenizer, self.tools, self.strict = tokenizer, tools, strict
        self.native = renders_tools(tokenizer)
        self.parses = self.native and getattr(tokenizer, "response_template", None) is not None
        if not self.native:
            self.name = "the fallback tool format (<tool_call>)"
        else:  # a template without a response template: its calls are read as the fallback's
            how = "parse_response" if self.parses else "<tool_call> JSON, as the tokenizer has no response_template"
            self.name = f"the chat template's tool format, calls read by {how}"

    def conversation(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """A prompt's messages and the chat-template keywords that show the tools."""
        schemas = [tool.schema for tool in self.tools]
        if self.native:
            return prompt, {"tools": schemas}
        first = self.tools[0]
        example = {name: f"<{name}>" for name in first.schema["function"]["parameters"].get("properties", {})}
        listed = FALLBACK_SYSTEM.format(
            schemas="\n".join(json.dumps(s["function"]) for s in schemas), first=first.name, example=json.dumps(example)
        )
        shown = [written_calls(m) for m in prompt]  # worked examples in the prompt keep their calls
        if shown and shown[0]["role"] == "system":
            return [{"role": "system", "content": shown[0]["content"] + "\n\n" + listed}, *shown[1:]], {}
        return [{"role": "system", "content": listed}, *shown], {}

    def parse(self, turn: list[int], prefix: list[int], tools: list[Tool]) -> dict[str, Any]:
        """An assistant message from a turn's tokens (``prefix``: the tokens before it): ``content`` and, when it
        calls ``tools``, ``tool_calls`` in transformers' form (``{"type": "function", "function": {"name",
        "arguments"}}``). A turn with a call that cannot be read (or, as TRL validates them, a call without a tool
        name) is its text, as TRL's ``parse_response`` falls back to; ``strict``: the call has ``"error"`` instead of
        ``"function"``."""
        text = self.tokenizer.decode(turn, skip_special_tokens=True)
        if self.parses:
            schemas = [tool.schema for tool in tools]
            try:
                message = dict(self.tokenizer.parse_response(turn, prefix=prefix, tools=schemas))
                if not self.strict:
                    readable_calls(message.get("tool_calls"))
            except Exception as exc:  # the template's parser raises its own errors on a malformed call
                if not self.strict:
                    return {"role": "assistant", "content": text}
                error = f"error: the turn's tool calls cannot be read: {exc}"
                return {"role": "assistant", "content": text, "tool_calls": [{"type": "function", "error": error}]}
            message.setdefault("role", "assistant")
            # as TRL hands a turn to reward functions: content always a string, without an EOS the parser kept
            content = message.get("content")
            eos = self.tokenizer.eos_token or ""
            message["content"] = content.removesuffix(eos) if isinstance(content, str) else ""
            return message
        calls = []
        for body in CALL.findall(text):
            try:
                call = json.loads(body)
                if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                    raise ValueError('a call is an object with a "name" and "arguments"')
                arguments = call.get("arguments", {})
                if not isinstance(arguments, dict):
                    raise ValueError('"arguments" must be an object')
                calls.append({"type": "function", "function": {"name": call["name"], "arguments": arguments}})
            except ValueError as exc:
                if not self.strict:
                    return {"role": "assistant", "content": text}
                calls.append({"type": "function", "error": f"error: malformed tool call {body.strip()[:200]!r}: {exc}"})
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return message

    def suffix_ids(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        """The tokens after a turn's EOS that hold ``tool_messages`` and open the next assistant turn: what a
        conversation gains from them, cut after the EOS that ends the assistant's turn."""
        call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
        before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        kwargs = {"tokenize": True, "return_dict": False}
        prefix = list(self.tokenizer.apply_chat_template(before, **kwargs))
        full = list(self.tokenizer.apply_chat_template(before + tool_messages, add_generation_prompt=True, **kwargs))
        eos = self.tokenizer.eos_token_id
        ends = [i for i, token in enumerate(prefix) if token == eos]
        if ends:
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ValueError("the chat template renders a tool turn that does not extend the assistant's turn")
        return full[len(prefix) :]
