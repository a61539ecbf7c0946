"""Which prompts each training step samples, and their token ids."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from fastgrpo.models import encode_prompts

logger = logging.getLogger(__name__)


class StepPrompts:
    """The dataset's rows in a seeded order per epoch, cut into generations of ``global_prompts`` rows of which each of
    the ``world_size`` processes takes ``per_rank`` consecutive ones, encoded once each."""

    def __init__(
        self,
        dataset: list[dict[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        per_rank: int,
        rank: int,
        world_size: int,
        seed: int,
        max_prompt_length: int,
        shuffle: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        render: Callable[[dict[str, Any]], tuple[Any, dict[str, Any]]] | None = None,
    ):
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.per_rank = per_rank
        self.rank = rank
        self.global_prompts = per_rank * world_size
        self.seed = seed
        self.max_prompt_length = max_prompt_length
        self.shuffle = shuffle
        self.chat_template_kwargs = chat_template_kwargs
        self.render = render  # with tools: a row's prompt messages and the chat-template keywords that show them
        self.encoded: dict[int, list[int]] = {}
        self._warned_truncation = False

    def rows(self, generation: int) -> list[dict[str, Any]]:
        """This process's prompts of a generation: a seeded permutation per epoch, so a resumed run sees the same
        ones (the dataset's order without ``shuffle``); an epoch is as many whole generations as the dataset holds,
        the rows past the last left out, as TRL's sampler leaves them.

        The generation's prompts for the whole job are cut into one consecutive share per rank, so a run on N
        processes sees the prompts, in the same order, that one process sees with an N times larger batch."""
        epoch, within = divmod(generation, max(len(self.dataset) // self.global_prompts, 1))
        first = within * self.global_prompts + self.rank * self.per_rank
        rows = []
        for k in range(first, first + self.per_rank):
            index = k % len(self.dataset)
            if not self.shuffle:  # TRL's shuffle_dataset: false
                rows.append(self.dataset[index])
                continue
            order = torch.randperm(
                len(self.dataset), generator=torch.Generator(device="cpu").manual_seed(self.seed + epoch), device="cpu"
            )
            rows.append(self.dataset[int(order[index])])
        return rows

    def encode(self, rows: list[dict[str, Any]]) -> list[list[int]]:
        """Token ids of the rows' prompts (chat template applied, with ``render``'s tools shown), keeping the last
        ``max_prompt_length``."""
        out = []
        for row in rows:
            key = id(row)
            if key not in self.encoded:
                prompt, shown = self.render(row) if self.render is not None else (row["prompt"], {})
                self.encoded[key] = self.encode_prompt(prompt, shown)
            out.append(self.encoded[key])
        return out

    def encode_prompt(self, prompt: Any, shown: dict[str, Any] | None = None) -> list[int]:
        """Token ids of one prompt, with ``shown`` beside the run's chat-template keywords, keeping the last
        ``max_prompt_length``."""
        limit = self.max_prompt_length
        kwargs = {**(self.chat_template_kwargs or {}), **shown} if shown else self.chat_template_kwargs
        ids = encode_prompts(self.tokenizer, [prompt], limit + 1, kwargs)[0]
        if len(ids) > limit and not self._warned_truncation:
            self._warned_truncation = True
            logger.warning(
                "a prompt is longer than max_prompt_length (%d tokens): it keeps its last %d tokens and loses "
                "its beginning, the chat template's header included; raise max_prompt_length (later prompts "
                "are cut without another warning)",
                limit,
                limit,
            )
        return ids[-limit:]
