"""A training run's tools: resolved from the config before anything loads, shown to the model in every prompt,
run for every rollout (`fastgrpo.tools.turns.ToolTurns`) and logged."""

from __future__ import annotations

import logging
from typing import Any

from transformers import PreTrainedTokenizerBase

from fastgrpo.config import GRPOConfig
from fastgrpo.tools.format import ToolFormat
from fastgrpo.tools.functions import Tool
from fastgrpo.tools.runner import ToolRunner
from fastgrpo.tools.turns import ToolTurns

logger = logging.getLogger(__name__)


class RunTools:
    """``tools`` as ``tokenizer``'s chat template shows them (or the fallback format), run on one `ToolRunner`."""

    def __init__(self, tools: list[Tool], tokenizer: PreTrainedTokenizerBase, config: GRPOConfig):
        self.tokenizer, self.config = tokenizer, config
        self.format = ToolFormat(tokenizer, tools)
        self.runner = ToolRunner(config.tool_workers, config.tool_timeout)
        logger.info("tools %s, shown and read in %s", [t.name for t in tools], self.format.name)

    def render(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        """A prompt's messages with the tools shown, and the chat-template keywords that show them."""
        if isinstance(prompt, str):
            raise ValueError("tools need chat prompts (lists of messages); a prompt is a plain string")
        return self.format.conversation(prompt)

    def turns(self, rows: int) -> ToolTurns:
        """The tools of one generation call of ``rows`` completions."""
        cfg = self.config
        return ToolTurns(
            self.tokenizer, self.format, self.runner, rows, cfg.max_completion_length, cfg.max_tool_calling_iterations
        )

    def close(self) -> None:
        self.runner.close()
