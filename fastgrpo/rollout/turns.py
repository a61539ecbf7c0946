"""Rows that pause while their tools run, and resume in their own KV cache.

In a call with tools, a row whose turn ends (EOS) having called tools leaves the decoding batch: it is *parked* in a
cache row past the live ones, its cache intact, while its tools run (`Turns`, see `fastgrpo.tools.turns`) and the
other rows decode on. When the results come, the tool turn's tokens (the template's tool messages and the next
assistant header) are fed to the row's own cache as a small prefill from where it stopped: nothing before them is
computed again. The row then rejoins the batch with the last of those tokens pending, so that the next step samples
its next token as it would any other (the same uniform of its completion position: speculation stays lossless
across turns). The drafters keep each parked row's state aside (`Drafter.park`) and read the tool turn when it
rejoins (`Drafter.rejoin`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.drafter import Drafter, Emitted
from fastgrpo.rollout.forward import decoder_and_head, forward_block
from fastgrpo.rollout.host import host_to_device
from fastgrpo.rollout.sequence import ActiveRows, Generation, Sequence


class Turns(Protocol):
    """The tools of one generation call, as the engine sees them."""

    def ended(self, row: int, completion: list[int]) -> bool:
        """Completion ``row`` ended a turn (``completion`` ends with an EOS): True when the turn called tools, which
        now run while the row waits (`ready`); False when the completion is done."""
        ...

    def ready(self, block: bool) -> list[tuple[int, list[int] | None]]:
        """The waiting rows whose tools have all returned, each with the tokens that continue it (its tool turn and
        the next assistant header), or None where the row ends as it is (the results would not fit in the
        completion); ``block``: wait until there is at least one."""
        ...


@dataclass
class ParkedRow:
    """A row waiting on its tools: ``slot`` its cache row, past the live ones; ``length`` its filled cache slots
    (the prompt and the completion but its last token, the EOS, which is fed when it resumes); ``drafted`` each
    drafter's state of the row (`Drafter.park`)."""

    seq: Sequence
    slot: int
    length: int
    drafted: list[Any]


class Parking:
    """The rows of a call that wait on tools; live rows are cache rows ``[0, B)``, parked rows lie past them."""

    def __init__(self, turns: Turns):
        self.turns = turns
        self.rows: dict[int, ParkedRow] = {}  # by completion index

    def pauses(self, seq: Sequence) -> bool:
        """Whether a row that just ended (`Sequence.append`) waits on tools instead."""
        return seq.finish_reason == "stop" and self.turns.ended(seq.index, seq.completion_ids)

    def park(self, rows: ActiveRows, order: list[int], paused: list[int], drafted: list[list[Any]], max_rows: int):
        """After a step, ``order`` are the rows that stay live (`fill_holes`) and those at ``paused`` wait on tools
        (``drafted``: per drafter, its state of each). Returns the cache's row moves (`RowCache.select_rows`): the
        live rows into ``[0, len(order))`` and each paused row into a free row past them, where it stays."""
        live = len(order)
        taken = {p.slot for p in self.rows.values()} | {p for p in paused if p >= live}
        free = (r for r in range(live, max_rows) if r not in taken)
        moves = list(order)
        for k, pos in enumerate(paused):
            slot = pos if pos >= live else next(free)
            if slot >= len(moves):
                moves += range(len(moves), slot + 1)
            moves[slot] = pos
            seq = rows.seqs[pos]
            length = seq.prompt_len + len(seq.completion_ids) - 1
            self.rows[seq.index] = ParkedRow(seq, slot, length, [states[k] for states in drafted])
        return moves

    def vacate(self, cache: RowCache, first: int, count: int) -> None:
        """Move the rows parked in cache rows ``first`` to ``first + count - 1`` (where rows are about to be taken in,
        `fastgrpo.rollout.decoding.Refill`) to free rows past them."""
        end, taken = first + count, {p.slot for p in self.rows.values()}
        free = (r for r in range(end, cache.max_rows) if r not in taken)
        for row in self.rows.values():
            if first <= row.slot < end:
                _move(cache, row, next(free), [])

    def resume(
        self, model: PreTrainedModel, cache: RowCache, drafters: list[Drafter], rows: ActiveRows, call: Generation
    ) -> ActiveRows:
        """Rejoin the rows whose tools have returned (waiting for one when no row is live) to the live ``rows`` of
        ``model``'s ``cache`` (and ``drafters``'); the others wait on."""
        if not self.rows:
            return rows
        t0 = time.perf_counter()
        ready = self.turns.ready(block=not rows.size)
        if not rows.size:
            call.stats.tool_wait_time += time.perf_counter() - t0
        joining: list[tuple[ParkedRow, list[int]]] = []
        for index, tokens in ready:
            parked = self.rows.pop(index)
            room = None if tokens is None else call.params.max_new_tokens - len(parked.seq.completion_ids) - len(tokens)
            if room is None or room < 0:  # the results would not fit: the completion ends as it is
                continue
            if room == 0:  # they fill the completion: it ends with them, as in TRL's loop
                parked.seq.append_tool_result(tokens)
                continue
            joining.append((parked, tokens))
            call.stats.tool_prefill_tokens += len(tokens)
        return self._rejoin(model, cache, drafters, rows, joining) if joining else rows

    def _rejoin(
        self,
        model: PreTrainedModel,
        cache: RowCache,
        drafters: list[Drafter],
        rows: ActiveRows,
        joining: list[tuple[ParkedRow, list[int]]],
    ) -> ActiveRows:
        """Move the ``k`` rows of ``joining`` to cache rows ``B`` to ``B + k - 1`` (the first past the live ones),
        feed each its pending EOS and all but the last of its tool turn's tokens at its own length, all in one
        forward, and append them to the live rows with their last tokens pending. Shorter turns are padded; their
        pads are written past their rows' lengths (no query of the row reads them, and decoding writes over them)."""
        live, dev = rows.size, rows.ids.device
        parked = [p for p, _ in joining]
        for j, row in enumerate(parked):
            _move(cache, row, live + j, [*self.rows.values(), *parked[j + 1 :]])
        counts = [len(tokens) for _, tokens in joining]
        width, ends = max(counts), [p.length + n for p, n in zip(parked, counts, strict=True)]
        extent = max(ends) + (min(counts) < width)  # a slot past every row's end for the pads
        padded = [t + [t[-1]] * (width - len(t)) for _, t in joining]  # each turn to ``width`` with its last token
        fed = [[p.seq.completion_ids[-1], *t[:-1]] for p, t in zip(parked, padded, strict=True)]
        offsets = [[min(t, extent - 1 - p.length) for t in range(width)] for p in parked]
        positions = [[p.length + min(t, n - 1) for t in range(width)] for p, n in zip(parked, counts, strict=True)]
        base = host_to_device([p.length for p in parked], dev)
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
        decoder, _ = decoder_and_head(model)
        hidden = forward_block(
            decoder,
            cache,
            base,
            host_to_device(offsets, dev),
            host_to_device(positions, dev),  # a pad at its row's last position: none past what decoding reaches
            causal,
            input_ids=host_to_device(fed, dev),
            extent=extent,
            first=live,
        )
        for k, (row, tokens) in enumerate(joining):
            row.seq.append_tool_result(tokens)
            if row.seq.hidden is not None:
                row.seq.hidden.append(hidden[k, : len(tokens)])
        joined = ActiveRows(
            [p.seq for p in parked],
            host_to_device([p.seq.index for p in parked], dev),
            host_to_device(ends, dev),
            ends,
            host_to_device([t[-1] for _, t in joining], dev),
            host_to_device([len(p.seq.completion_ids) for p in parked], dev),
        )
        ids, counted = host_to_device(padded, dev), host_to_device(counts, dev)
        for k, (row, n) in enumerate(zip(parked, counts, strict=True)):
            emitted = Emitted(ids[k : k + 1, :n], hidden[k : k + 1, :n], counted[k : k + 1], [n])
            for drafter, state in zip(drafters, row.drafted, strict=True):
                drafter.rejoin(state, emitted)
        return rows.extend(joined)


def _move(cache: RowCache, row: ParkedRow, target: int, others: list[ParkedRow]) -> None:
    """Move parked ``row`` to cache row ``target``; the one of ``others`` there (if any) takes ``row``'s place."""
    if row.slot == target:
        return
    moves = list(range(max(target, row.slot) + 1))
    moves[target], upto = row.slot, row.length
    for other in others:
        if other.slot == target:  # swapped into the row this one leaves
            moves[row.slot], other.slot, upto = target, row.slot, max(upto, other.length)
    cache.select_rows(moves, upto=upto)
    row.slot = target
