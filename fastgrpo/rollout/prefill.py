"""The prefill stage: each distinct prompt read into the target's cache once, its rows replicated for its samples,
each row's first token sampled and the drafters told. At a call's start the rows take cache rows ``0`` on; rows
taken in later (refilled as others finish, `fastgrpo.rollout.decoding.Refill`) take the cache rows just past the
live ones, the live rows emitting nothing in that forward.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch
from transformers import PreTrainedModel

from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.drafter import Drafter, Prefill
from fastgrpo.rollout.forward import decoder_and_head, forward_chain
from fastgrpo.rollout.host import HostStep, Verified, host_to_device
from fastgrpo.rollout.sampling import policy_logprobs, process_logits, sample
from fastgrpo.rollout.sequence import ActiveRows, Generation, Sequence


class Engine(Protocol):
    """What the prefill reads of the engine (`fastgrpo.rollout.engine.RolloutEngine`)."""

    model: PreTrainedModel
    cache: RowCache
    drafters: dict[str, Drafter]

    @property
    def device(self) -> torch.device: ...

    def append(self, rows: ActiveRows, verified: Verified, host: HostStep, call: Generation) -> ActiveRows: ...


def prefill(
    engine: Engine,
    prompt_ids: list[list[int]],
    row_prompt: list[int],
    seqs: list[Sequence],
    call: Generation,
    live: ActiveRows | None = None,
    waiting: list[list[int]] | None = None,
) -> ActiveRows:
    """Prefill ``prompt_ids`` (right-padded) into the cache rows past the ``live`` ones (None: from row 0, the call's
    start, which takes in the prompts ``waiting`` later), replicate them for the completions ``seqs`` (row ``i`` of
    prompt ``row_prompt[i]``), sample and append each one's first token; returns the live rows followed by the new
    ones, those that ended at their first token dropped."""
    t0 = time.perf_counter()
    dev, cache = engine.device, engine.cache
    first = 0 if live is None else live.size
    prompt_len = [len(p) for p in prompt_ids]
    lens = host_to_device(prompt_len, dev)
    width = max(prompt_len)
    ids = host_to_device([t for p in prompt_ids for t in p + [0] * (width - len(p))], dev).view(-1, width)
    decoder, head = decoder_and_head(engine.model)
    hidden = forward_chain(
        decoder, cache, torch.zeros_like(lens), input_ids=ids, extent=width, first=first
    )  # [P, T, H]
    last = hidden[torch.arange(len(prompt_ids), device=dev), lens - 1]
    rows = host_to_device(row_prompt, dev)
    if row_prompt != list(range(len(prompt_ids))):
        cache.select_rows(list(range(first)) + [first + p for p in row_prompt], upto=width)
    for seq, prompt in zip(seqs, row_prompt, strict=True):
        seq.prompt_len = prompt_len[prompt]
        if seq.hidden is not None:
            seq.hidden.append(hidden[prompt, : seq.prompt_len])
    index = host_to_device([seq.index for seq in seqs], dev)
    zeros = torch.zeros_like(rows)
    lengths = [prompt_len[p] for p in row_prompt]
    new = ActiveRows(seqs, index, lens[rows], lengths, zeros, zeros)
    logits = head(last)[rows]
    logprobs = process_logits(logits, call.params)
    tokens = sample(logprobs, call.params, None if call.noise is None else call.noise[index, 0])
    if engine.drafters:
        told = Prefill(ids, lens, hidden, rows, tokens, last[rows], prompt_ids, row_prompt, seqs, waiting or [])
        for drafter in engine.drafters.values():
            drafter.start(told) if live is None else drafter.admit(told)
    sampled = policy_logprobs(logits, logprobs, tokens, call.params)
    count = torch.ones_like(tokens)
    if live is not None:  # the live rows emit nothing: their pending tokens stay
        new, tokens = live.extend(new), torch.cat([live.pending, tokens])
        sampled = torch.cat([sampled.new_zeros(live.size), sampled])
        count = torch.cat([torch.zeros_like(live.pending), count])
    verified = Verified(tokens[:, None], sampled[:, None], count, last)
    active = engine.append(new, verified, HostStep.read(verified, call.eos), call)
    call.stats.prefill_time += time.perf_counter() - t0
    return active
