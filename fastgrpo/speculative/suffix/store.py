"""The suffix drafter's token storage: every sequence of every prompt memory in one flat buffer, so that a step's
searches over all rows read it with a few array gathers instead of a Python loop per place.

A sequence lives in a slot: a run of cells of the buffer between two cells that hold ``-1`` (`GAP`, never a token),
so that a comparison running backwards past a sequence's first token stops there by itself. A sequence that outgrows
its run moves to one twice as long at the end of the buffer; the runs it leaves, and those of released slots, are
reclaimed when the buffer is full (the live sequences are copied into a buffer twice their size).

Each `append` advances the store's `clock` and records it as the slot's ``written``, and the slot's length before it
as its ``before``, so that a search made at a given clock can read each slot as it was then: the rows of a batch read
their new tokens one after the other, each searching right after its own read, and a slot is appended to at most
once in between (by its own row).
"""

from __future__ import annotations

from array import array

import numpy as np

GAP = -1  # the token of the cells around every sequence, and of every cell not written yet
LEAD = 64  # cells of `GAP` at the start (a comparison backwards from a sequence's first token stays in the buffer)
SLACK = 64  # cells never written at the end


class TokenStore:
    """Token sequences in slots of one int32 buffer ``tokens``, read on the host by slot (`read`) and by the batched
    search as arrays (`arrays`)."""

    def __init__(self, cells: int = 1 << 16):
        self.tokens = array("i", [GAP]) * cells
        self.used = LEAD  # cells [0, used) are taken (the gap before the next run is cell ``used``)
        self.base = array("q")  # per slot: the cell of its first token
        self.size = array("q")  # per slot: its tokens
        self.before = array("q")  # per slot: its tokens before its last append
        self.written = array("q")  # per slot: the clock of its last append
        self.capacity: list[int] = []  # per slot: the cells of its run
        self.free: list[int] = []  # released slots
        self.clock = 0  # appends so far

    def new(self, tokens: list[int], capacity: int = 0) -> int:
        """A slot holding ``tokens`` with room for ``capacity`` tokens at least; returns it."""
        if self.free:
            slot = self.free.pop()
        else:
            slot = len(self.base)
            for column in (self.base, self.size, self.before, self.written):
                column.append(0)
            self.capacity.append(0)
        self.size[slot] = 0
        self._place(slot, max(capacity, len(tokens), 1))
        self.append(slot, tokens)
        return slot

    def release(self, slot: int) -> None:
        """Give a slot back (its run is reclaimed when the buffer is next copied)."""
        self.size[slot] = 0
        self.free.append(slot)

    def append(self, slot: int, tokens: list[int]) -> None:
        """Append ``tokens`` to a slot's sequence, the clock advanced by one."""
        self.clock += 1
        size = self.size[slot]
        end = size + len(tokens)
        if end > self.capacity[slot]:
            self._place(slot, max(2 * self.capacity[slot], end))
        start = self.base[slot] + size
        self.tokens[start : start + len(tokens)] = array("i", tokens)
        self.before[slot], self.size[slot], self.written[slot] = size, end, self.clock

    def read(self, slot: int, start: int = 0) -> list[int]:
        """A slot's tokens from position ``start`` on."""
        base = self.base[slot]
        return self.tokens[base + start : base + self.size[slot]].tolist()

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The store as arrays sharing its memory (to be dropped before it is written to again): ``[cells]`` int32
        tokens, and per slot int64 its first token's cell, its length, its length before its last append and that
        append's clock."""
        return (
            np.frombuffer(self.tokens, dtype=np.int32),
            *(np.frombuffer(column, dtype=np.int64) for column in (self.base, self.size, self.before, self.written)),
        )

    def _place(self, slot: int, capacity: int) -> None:
        """Give ``slot`` a run of ``capacity`` cells at the end of the buffer, its tokens copied there."""
        tokens, old, size = self.tokens, self.base[slot], self.size[slot]
        if self.used + capacity + 1 + SLACK > len(self.tokens):
            self._grow(capacity + 1, slot)
        base = self.used + 1
        self.tokens[base : base + size] = tokens[old : old + size]
        self.base[slot], self.capacity[slot] = base, capacity
        self.used = base + capacity

    def _grow(self, cells: int, moving: int) -> None:
        """Copy the live sequences but that of slot ``moving``, in slot order and each in a run of its size, into a
        buffer twice their size (and ``cells`` more)."""
        free = set(self.free)
        live = [s for s in range(len(self.base)) if s not in free and s != moving]
        need = LEAD + sum(self.size[s] + 1 for s in live) + cells + SLACK
        tokens, used = array("i", [GAP]) * (2 * need), LEAD
        for s in live:
            old, size, base = self.base[s], self.size[s], used + 1
            tokens[base : base + size] = self.tokens[old : old + size]
            self.base[s], self.capacity[s] = base, max(size, 1)
            used = base + self.capacity[s]
        self.tokens, self.used = tokens, used
