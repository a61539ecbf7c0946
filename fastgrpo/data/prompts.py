"""Chat prompts: checking a dataset's prompt value and building the messages a model is given."""

from __future__ import annotations

from typing import Any

from fastgrpo.paths import unicode_problem

Messages = list[dict[str, Any]]
CHAT_ROLES = ("system", "user", "assistant", "tool")


def prompt_problem(value: Any) -> str | None:
    """Why ``value`` is not a usable prompt, or None when it is."""
    if isinstance(value, str):
        return unicode_problem(value) if value.strip() else "is an empty string"
    if not isinstance(value, list) or not value:
        return f"must be a non-empty string or a list of {{role, content}} messages, got {type(value).__name__}"
    for message in value:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            return "must be a list of {role, content} messages; found an entry without a string 'role'"
        if not isinstance(message.get("content"), str):
            return "must be a list of {role, content} messages; found a message without string 'content'"
        if message["role"] not in CHAT_ROLES:
            return f"has a message with role {message['role']!r}; roles are {', '.join(CHAT_ROLES)}"
        if message["role"] == "user" and not message["content"].strip():
            return "has a user message whose content is empty"
        problem = unicode_problem(message["content"])
        if problem is not None:
            return f"has a message whose content {problem}"
    if not any(message["role"] == "user" for message in value):
        return "has no user message"
    return None


def build_prompt(question: str | Messages, system_prompt: str | None, instruction: str | None) -> Messages:
    """Chat messages for a question (a string or messages), with the system prompt and instruction applied.

    The instruction goes on a new line after the last user message; the system prompt becomes the first
    message, replacing a system message the prompt already has.
    """
    if isinstance(question, str):
        messages: Messages = [{"role": "user", "content": question}]
    else:
        messages = [dict(message) for message in question]
    if instruction:
        last_user = max(i for i, message in enumerate(messages) if message["role"] == "user")
        content = messages[last_user]["content"].rstrip()
        messages[last_user]["content"] = f"{content}\n{instruction.strip()}"
    if system_prompt is not None:
        if messages[0]["role"] == "system":
            messages = messages[1:]
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
