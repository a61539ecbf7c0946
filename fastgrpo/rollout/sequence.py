"""The state of a generation call: one `Sequence` per completion, the `ActiveRows` still decoding (row ``i`` of every
tensor is cache row ``i``), and the call's `Generation` (sampling parameters, noise, statistics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from fastgrpo.rollout.stats import GenerationStats
from fastgrpo.sampling_params import SamplingParams


@dataclass
class Sequence:
    """One completion: its tokens, their log-probs, why it ended and, when captured, the target's hidden states of
    the tokens fed to it (``[n, H]`` pieces, prompt first). In a call with tools, ``tool_mask`` is 0 on the tokens
    of tool results (which the policy did not sample: their log-probs are 0) and 1 elsewhere."""

    index: int
    prompt_len: int
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    hidden: list[torch.Tensor] | None = None
    tool_mask: list[int] | None = None

    def append(self, tokens: list[int], logprobs: list[float], is_eos: list[bool], call: Generation) -> bool:
        """Append tokens until one ends the completion (EOS, a stop string or the length limit, even inside an
        accepted path); returns whether it ended."""
        for token, logprob, eos in zip(tokens, logprobs, is_eos, strict=True):
            self.completion_ids.append(token)
            self.logprobs.append(logprob)
            if self.tool_mask is not None:
                self.tool_mask.append(1)
            if eos or call.hit_stop(self.completion_ids):
                self.finish_reason = "stop"
                return True
            if len(self.completion_ids) >= call.params.max_new_tokens:
                return True
        return False

    def append_tool_result(self, tokens: list[int]) -> None:
        """Append the tokens of a tool turn (not sampled: log-prob 0, ``tool_mask`` 0); the completion goes on."""
        self.finish_reason = "length"
        self.completion_ids += tokens
        self.logprobs += [0.0] * len(tokens)
        self.tool_mask += [0] * len(tokens)


@dataclass
class ActiveRows:
    """The rows still decoding: ``seqs[i]`` is produced by cache row ``i`` (of the target's and the drafter's caches).

    ``ids`` ``[B]`` each row's completion index; ``row_len`` ``[B]`` filled target cache slots, and ``host_len`` the
    same on the host (the step never reads them back); ``pending`` ``[B]`` the last emitted token, not yet in the
    target cache; ``emitted`` ``[B]`` tokens of the completion so far. (Drafters keep their per-row state
    themselves, see `fastgrpo.rollout.drafter`.)
    """

    seqs: list[Sequence]
    ids: torch.Tensor
    row_len: torch.Tensor
    host_len: list[int]
    pending: torch.Tensor
    emitted: torch.Tensor

    @property
    def size(self) -> int:
        return len(self.seqs)

    def select(self, order: list[int], index: torch.Tensor) -> ActiveRows:
        """Row ``i`` of the result is row ``order[i]`` (``index``: the same on the device)."""
        return ActiveRows(
            [self.seqs[p] for p in order],
            self.ids[index],
            self.row_len[index],
            [self.host_len[p] for p in order],
            self.pending[index],
            self.emitted[index],
        )

    def extend(self, other: ActiveRows) -> ActiveRows:
        """These rows followed by ``other``'s (rows resuming after a tool call join after the live ones)."""
        cat = torch.cat
        return ActiveRows(
            self.seqs + other.seqs,
            cat([self.ids, other.ids]),
            cat([self.row_len, other.row_len]),
            self.host_len + other.host_len,
            cat([self.pending, other.pending]),
            cat([self.emitted, other.emitted]),
        )


def fill_holes(keep: list[int]) -> list[int]:
    """New order of the rows after dropping finished ones (``keep``: the kept positions, ascending): a kept row
    stays where it is unless it lies past the new batch size, then it moves into the slot of a finished row, so
    the caches copy one row per finished row instead of shifting every row after it."""
    kept, tail = set(keep), [p for p in keep if p >= len(keep)]
    return [p if p in kept else tail.pop() for p in range(len(keep))]


@dataclass
class GenerationOutput:
    """Completions in prompt-major order: row ``p * num_generations + g`` is sample ``g`` of prompt ``p``."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    stats: GenerationStats
    hidden_states: list[torch.Tensor] | None = None
    """With ``capture_hidden``: per row ``[prompt + completion - 1, H]`` target final hidden states of every token
    that was fed to the target (all but the last), from the forwards the decoding ran anyway."""
    tool_masks: list[list[int]] | None = None
    """In a call with tools: per row, 0 on the tokens of tool results and 1 on the policy's (`Sequence.tool_mask`)."""


@dataclass
class Generation:
    """One `RolloutEngine.generate` call: its parameters, its sequences and what it measured.

    ``noise`` ``[R, max_new_tokens]`` float64 holds one uniform per (noise row, position) when sampling (None when
    greedy), a completion's row its `Sequence.index` (a call that spans generations gives the rows of the completions
    it handed over to those it takes in later); ``eos`` ``[E]`` the ids that end a completion."""

    params: SamplingParams
    seqs: list[Sequence]
    eos: torch.Tensor
    noise: torch.Tensor | None
    tokenizer: PreTrainedTokenizerBase | None
    capture: bool
    stats: GenerationStats = field(default_factory=GenerationStats)
    parking: Any = None  # with tools: the rows waiting on them, a `fastgrpo.rollout.turns.Parking`

    @classmethod
    def start(
        cls,
        n_rows: int,
        params: SamplingParams,
        eos: torch.Tensor,
        noise: torch.Tensor | None,
        tokenizer: PreTrainedTokenizerBase | None,
        capture: bool,
        parking: Any = None,
    ) -> Generation:
        """A call of ``n_rows`` completions, none begun (with ``parking``, a call with tools: each masks their
        results, `Sequence.tool_mask`)."""
        tools = parking is not None
        seqs = [Sequence(i, 0, hidden=[] if capture else None, tool_mask=[] if tools else None) for i in range(n_rows)]
        return cls(params, seqs, eos, noise, tokenizer, capture, parking=parking)

    def uniforms(self, rows: ActiveRows, width: int) -> torch.Tensor | None:
        """``[B, width]`` uniforms of each row's next ``width`` completion positions (None when greedy)."""
        if self.noise is None:
            return None
        cols = rows.emitted[:, None] + torch.arange(width, device=self.noise.device)[None, :]
        return self.noise[rows.ids[:, None], cols.clamp(max=self.noise.shape[1] - 1)]

    def hit_stop(self, completion: list[int]) -> bool:
        """Whether the decoded tail of a completion contains one of the stop strings."""
        stop = self.params.stop
        if not stop:
            return False
        window = max(len(s) for s in stop) + 8
        text = self.tokenizer.decode(completion[-window:], skip_special_tokens=False)
        return any(s in text for s in stop)

    def output(self, seqs: list[Sequence] | None = None) -> GenerationOutput:
        """The completions of ``seqs`` (by default the call's), with the call's statistics."""
        seqs = self.seqs if seqs is None else seqs
        hidden = None
        if self.capture:
            hidden = [torch.cat(s.hidden)[: s.prompt_len + len(s.completion_ids) - 1] for s in seqs]
        return GenerationOutput(
            [s.completion_ids for s in seqs],
            [s.logprobs for s in seqs],
            [s.finish_reason for s in seqs],
            self.stats,
            hidden,
            None if self.parking is None else [s.tool_mask for s in seqs],
        )
