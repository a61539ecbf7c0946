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

from transformers import PreTrainedModel

from fastgrpo.rollout.cache import RowCache
from fastgrpo.rollout.drafter import Drafter, Emitted
from fastgrpo.rollout.forward import decoder_and_head, forward_chain
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
        for index, tokens in ready:
            parked = self.rows.pop(index)
            room = None if tokens is None else call.params.max_new_tokens - len(parked.seq.completion_ids) - len(tokens)
            if room is None or room < 0:  # the results would not fit: the completion ends as it is
                continue
            if room == 0:  # they fill the completion: it ends with them, as in TRL's loop
                parked.seq.append_tool_result(tokens)
                continue
            rows = self._rejoin(model, cache, drafters, rows, parked, tokens)
            call.stats.tool_prefill_tokens += len(tokens)
        return rows

    def _rejoin(
        self,
        model: PreTrainedModel,
        cache: RowCache,
        drafters: list[Drafter],
        rows: ActiveRows,
        parked: ParkedRow,
        tokens: list[int],
    ) -> ActiveRows:
        """Move the row to cache row ``B`` (the first past the live ones), feed it its pending EOS and all but the
        last of ``tokens`` at its own length, and append it to the live rows with the last one pending."""
        live = rows.size
        if parked.slot != live:
            moves = list(range(max(live, parked.slot) + 1))
            moves[live] = parked.slot
            upto = parked.length
            for other in self.rows.values():
                if other.slot == live:  # swapped into the row this one leaves
                    moves[parked.slot], other.slot, upto = live, parked.slot, max(upto, other.length)
            cache.select_rows(moves, upto=upto)
        seq, dev = parked.seq, rows.ids.device
        fed = host_to_device([seq.completion_ids[-1], *tokens[:-1]], dev)
        n = len(tokens)
        base = host_to_device([parked.length], dev)
        decoder, _ = decoder_and_head(model)
        hidden = forward_chain(decoder, cache, base, input_ids=fed[None], extent=parked.length + n, first=live)
        seq.append_tool_result(tokens)
        if seq.hidden is not None:
            seq.hidden.append(hidden[0])
        length = parked.length + n
        joined = ActiveRows(
            [seq],
            host_to_device([seq.index], dev),
            host_to_device([length], dev),
            [length],
            host_to_device([tokens[-1]], dev),
            host_to_device([len(seq.completion_ids)], dev),
        )
        emitted = Emitted(host_to_device(tokens, dev)[None], hidden, host_to_device([n], dev), [n])
        for drafter, state in zip(drafters, parked.drafted, strict=True):
            drafter.rejoin(state, emitted)
        return rows.extend(joined)
