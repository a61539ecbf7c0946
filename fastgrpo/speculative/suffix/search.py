"""The suffix drafter's batched search: every row's longest matches and what followed them, for all rows at once in a
fixed number of array operations on the host (`search`), from what a step gathers in Python, row by row (`Queries`:
the most recent places of each row's last two tokens, and its last tokens).

A row's candidates are the `CANDIDATES` places, among the `SCAN` most recently indexed ones of its key, whose
preceding tokens match the row's last tokens longest (up to `MAX_MATCH`; the most recent first on ties), each with the
next ``depth`` tokens that followed it (`fastgrpo.speculative.suffix.trees` merges them into a trie).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from fastgrpo.speculative.suffix.store import TokenStore

KEY = 2  # tokens a match must share at least (the index's key)
MAX_MATCH = 32  # a match is compared backwards this far at most
SCAN = 64  # the most recent places of a key that are compared
CANDIDATES = 16  # the longest matches whose continuations form the trie
SHIFT = 21  # key = first token << SHIFT | second token (vocabularies below 2M tokens)
POS = 1 << 24  # place = slot * POS + position (sequences below 16M tokens)
_BEYOND = -2  # what a row's tail holds past its context's first token: it matches nothing
_PAD = array("i", [_BEYOND]) * (MAX_MATCH + 1)
_BACK = np.arange(MAX_MATCH + 1)  # a tail ends with `_BEYOND`: a comparison always stops


@dataclass
class Queries:
    """One search per row, gathered row by row: ``last`` each row's last token; for the rows whose key has places
    (``found``: their rows), ``places`` their windows one after the other (each the most recent `SCAN` places,
    oldest first) and ``counts`` their lengths, ``tails`` ``[found rows, MAX_MATCH + 1]`` their last tokens, newest
    first (`_BEYOND` past the first), and ``clocks`` the store's clock when each searched (what was written later is
    not read)."""

    last: array = field(default_factory=lambda: array("q"))
    found: array = field(default_factory=lambda: array("q"))
    places: array = field(default_factory=lambda: array("q"))
    counts: array = field(default_factory=lambda: array("q"))
    tails: array = field(default_factory=lambda: array("i"))
    clocks: array = field(default_factory=lambda: array("q"))
    longest: int = 0  # the longest window

    def add(self, index: dict[int, array], prompt: list[int], completion: list[int], clock: int) -> None:
        """A row whose context is ``prompt`` and then ``completion`` (at least one token) searches ``index`` (its
        prompt memory's key -> places)."""
        last = completion[-1]
        self.last.append(last)
        if len(completion) < KEY and not prompt:
            return
        places = index.get((completion[-2] if len(completion) >= KEY else prompt[-1]) << SHIFT | last)
        if places:
            window = places[-SCAN:]
            self.places.extend(window)
            self.counts.append(len(window))
            self.found.append(len(self.last) - 1)
            self.clocks.append(clock)
            self.longest = max(self.longest, len(window))
            tail = completion[: -MAX_MATCH - 1 : -1]
            if len(tail) < MAX_MATCH:
                tail += prompt[: len(tail) - MAX_MATCH - 1 : -1]
            self.tails.extend(tail)
            self.tails.extend(_PAD[len(tail) :])


@dataclass
class Matches:
    """Each row's last token ``last`` ``[B]``; the rows with candidates, ``rows`` ``[F]``, and theirs, longest match
    first: ``length`` ``[F, C]`` their match lengths (0: no candidate), ``tokens`` ``[F, C, D]`` the tokens that
    followed them, of which the first ``ahead`` ``[F, C]`` exist (the others -1). All int64 arrays."""

    last: np.ndarray
    rows: np.ndarray
    length: np.ndarray
    tokens: np.ndarray
    ahead: np.ndarray


def search(store: TokenStore, queries: Queries, depth: int, least: int = 1) -> Matches:
    """The candidates of the rows that have some (at least ``least`` columns, those past a row's candidates empty)
    and the next ``depth`` tokens of each."""
    last, rows = np.frombuffer(queries.last, dtype=np.int64), np.frombuffer(queries.found, dtype=np.int64)
    f, found = len(rows), min(queries.longest, CANDIDATES)
    if not f:
        empty = np.zeros((0, least), dtype=np.int64)
        return Matches(last, rows, empty, np.zeros((0, least, depth), dtype=np.int64), empty)
    tokens, base, size, before, written = store.arrays()
    place = np.frombuffer(queries.places, dtype=np.int64)
    counts = np.frombuffer(queries.counts, dtype=np.int64)
    # Each place's column in a [F, SCAN] grid of its row's window, the newest place last.
    column = np.arange(len(place)) + np.repeat(np.arange(SCAN, SCAN * (f + 1), SCAN) - counts.cumsum(), counts)
    tails = np.frombuffer(queries.tails, dtype=np.int32).reshape(f, MAX_MATCH + 1)
    cell = base[place // POS] + place % POS  # the cell of each place's last token
    # The key's tokens match by construction; a gap before a sequence, or `_BEYOND` in a tail, ends a match. Most
    # places differ right before the key: only the others are compared further.
    row = column // SCAN
    length = np.full(len(place), KEY)
    longer = np.flatnonzero(tokens.take(cell - KEY) == tails.take(row * (MAX_MATCH + 1) + KEY))
    if len(longer):
        length[longer] = (tokens.take(cell[longer, None] - _BACK) == tails.take(row[longer], axis=0)).argmin(1)
    # Longer first, then more recent (the newest place of a row is in its last column); -1: no place.
    rank = np.full(f * SCAN, -1, dtype=np.int64)
    rank[column] = length * SCAN + column % SCAN
    places = np.zeros(f * SCAN, dtype=np.int64)
    places[column] = place
    top = np.argsort(rank.reshape(f, SCAN), axis=1)[:, : -found - 1 : -1] + np.arange(0, f * SCAN, SCAN)[:, None]
    length, place = np.maximum(rank.take(top) // SCAN, 0), places.take(top)
    if found < least:
        length, place = (np.pad(a, ((0, 0), (0, least - found))) for a in (length, place))
    # What followed each place when its row searched: its sequence's length then, past the place.
    slot, pos = np.divmod(place, POS)
    clocks = np.frombuffer(queries.clocks, dtype=np.int64)[:, None]
    shown = np.where(written.take(slot) <= clocks, size.take(slot), before.take(slot))
    ahead = np.where(length > 0, np.minimum(shown - pos - 1, depth), 0)  # a place is found once a token follows
    cells = np.minimum((base.take(slot) + pos)[:, :, None] + np.arange(1, depth + 1), len(tokens) - 1)
    following = np.where(np.arange(depth) < ahead[:, :, None], tokens.take(cells), -1)
    return Matches(last, rows, length, following.astype(np.int64), ahead)
