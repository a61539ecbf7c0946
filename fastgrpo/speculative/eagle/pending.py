"""The EAGLE drafter's per-row state between trees: the (token, target hidden state) pairs its cache has not read
yet (`fastgrpo.speculative.eagle.drafter`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingPairs:
    """The draft's per-row state: ``draft_len`` ``[B]`` filled draft cache slots, and the (token, preceding target
    hidden state) pairs ``tokens``/``hidden`` ``[B, C + 1]``/``[B, C + 1, H]`` that the draft cache has not read yet,
    the first ``count[b]`` of row ``b``; the capacity ``C`` grows by doubling and the last column is a spare one that
    writes of nothing go to. ``host_len`` and ``host_count`` hold ``draft_len`` and ``count`` on the host."""

    draft_len: torch.Tensor
    tokens: torch.Tensor
    hidden: torch.Tensor
    count: torch.Tensor
    host_len: list[int]
    host_count: list[int]

    def select(self, order: list[int], index: torch.Tensor) -> PendingPairs:
        return PendingPairs(
            self.draft_len[index],
            self.tokens[index],
            self.hidden[index],
            self.count[index],
            [self.host_len[p] for p in order],
            [self.host_count[p] for p in order],
        )

    def joined(self, other: PendingPairs) -> PendingPairs:
        """These rows followed by ``other``'s (capacities widened to the larger one)."""
        cap = max(self.tokens.shape[1], other.tokens.shape[1])

        def widen(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(t.shape[0], cap - t.shape[1], *t.shape[2:])], 1)

        return PendingPairs(
            torch.cat([self.draft_len, other.draft_len]),
            torch.cat([widen(self.tokens), widen(other.tokens)]),
            torch.cat([widen(self.hidden), widen(other.hidden)]),
            torch.cat([self.count, other.count]),
            self.host_len + other.host_len,
            self.host_count + other.host_count,
        )

    def window(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, width]`` tokens and ``[B, width, H]`` hidden states of the first ``width`` columns (zeros past the
        capacity), contiguous (a compiled graph guards on its inputs' strides)."""
        missing = width - self.tokens.shape[1]
        if missing <= 0:
            return self.tokens[:, :width].contiguous(), self.hidden[:, :width].contiguous()
        b, h = self.hidden.shape[0], self.hidden.shape[-1]
        tokens = torch.cat([self.tokens, self.tokens.new_zeros(b, missing)], 1)
        return tokens, torch.cat([self.hidden, self.hidden.new_zeros(b, missing, h)], 1)

    def consumed(self, draft_len: torch.Tensor) -> None:
        """The draft cache read every pending pair: it now fills ``draft_len`` ``[B]`` slots."""
        self.draft_len, self.count = draft_len, torch.zeros_like(self.count)
        self.host_len = [n + c for n, c in zip(self.host_len, self.host_count, strict=True)]
        self.host_count = [0] * len(self.host_count)

    def push(self, tokens: torch.Tensor, hidden: torch.Tensor, count: torch.Tensor, host_count: list[int]) -> None:
        """Append ``count[b]`` (token ``[B, E]``, hidden ``[B, E, H]``) pairs to each row's pending pairs
        (``host_count``: ``count`` on the host)."""
        b, e = tokens.shape
        self.host_count = [c + n for c, n in zip(self.host_count, host_count, strict=True)]
        need, cap = max(self.host_count), self.tokens.shape[1] - 1
        if need > cap:
            grown = max(need, 2 * cap)
            new_tok = self.tokens.new_zeros(b, grown + 1)
            new_hid = self.hidden.new_zeros(b, grown + 1, hidden.shape[-1])
            new_tok[:, :cap], new_hid[:, :cap] = self.tokens[:, :cap], self.hidden[:, :cap]
            self.tokens, self.hidden, cap = new_tok, new_hid, grown
        steps = torch.arange(e, device=tokens.device)[None, :]
        index = torch.where(steps < count[:, None], self.count[:, None] + steps, cap)  # the spare column
        rows = torch.arange(b, device=tokens.device)[:, None]
        self.tokens[rows, index] = tokens  # index assignment, not scatter_ (slow on bfloat16, see cache.py)
        self.hidden[rows, index] = hidden.to(self.hidden.dtype)
        self.count = self.count + count
