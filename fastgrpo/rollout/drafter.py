"""The propose stage of an engine step: a drafter proposes a tree of candidate tokens per active row, which the
engine's target forward verifies. This is the interface; `fastgrpo.speculative.eagle` implements it with the learned
EAGLE head, and another drafter is one new class with these methods.

A drafter keeps its per-row state (what it has read of each row) in an object with a ``select(order, index)`` method,
which the engine holds in `ActiveRows.draft` and narrows whenever rows finish, so that row ``i`` of the drafter's
state is always row ``i`` of the batch. A drafter reads nothing back from the device: what the host must know (how
many tokens each row emitted) the engine hands it, read once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from fastgrpo.rollout.tree import DraftTree, TreeShape

if TYPE_CHECKING:
    from fastgrpo.rollout.sequence import ActiveRows


@dataclass
class Proposal:
    """One step's draft: ``tree`` with one tree per row; ``forwards`` draft forwards it took; ``backlog_seconds`` the
    part of its time spent reading tokens of earlier plain steps (their cost, not this tree's: the controller is
    told the step's time without it)."""

    tree: DraftTree
    forwards: int
    backlog_seconds: float = 0.0


class Drafter(Protocol):
    """Proposes draft trees for the engine to verify."""

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The drafter's networks: the engine runs them with its rollout attention and linear routes during a call."""
        ...

    @property
    def compile_seconds(self) -> float:
        """Wall time its proposals spent compiling graphs so far (0 when it runs eagerly)."""
        ...

    def begin(self, rows: int, length: int, bound: TreeShape) -> bool:
        """A generation call of up to ``rows`` rows of ``length`` tokens starts (trees no larger than ``bound``);
        returns whether the drafter's weights changed since the previous call (what was measured of its acceptance
        is then out of date)."""
        ...

    def start(
        self,
        prompt_ids: torch.Tensor,
        prompt_len: torch.Tensor,
        prompt_hidden: torch.Tensor,
        rows: torch.Tensor,
        first: torch.Tensor,
        first_hidden: torch.Tensor,
        row_prompt_len: list[int],
    ) -> Any:
        """The per-row state after the prefill: ``prompt_ids`` ``[P, T]`` right-padded prompts of ``prompt_len`` ``[P]``
        tokens, ``prompt_hidden`` ``[P, T, H]`` the target's hidden states there, ``rows`` ``[R]`` the prompt of each
        row, ``first`` ``[R]`` each row's first sampled token and ``first_hidden`` ``[R, H]`` the hidden state it was
        sampled from; ``row_prompt_len`` each row's prompt length on the host."""
        ...

    def backlog(self, rows: ActiveRows) -> int:
        """The most tokens a row has emitted that the drafter has not read yet (a tree would read them first)."""
        ...

    def propose(self, rows: ActiveRows, shape: TreeShape) -> Proposal:
        """A tree of ``shape`` for every active row, rooted at the row's pending token."""
        ...

    def accepted(
        self, rows: ActiveRows, tokens: torch.Tensor, hidden: torch.Tensor, count: torch.Tensor, counts: list[int]
    ) -> None:
        """A step emitted the first ``count[b]`` of ``[B, E]`` ``tokens`` of each row (``counts``: the same on the
        host); ``hidden`` ``[B, E, H]`` holds the target's hidden state each of them was sampled from."""
        ...

    def keep(self, rows: ActiveRows, order: list[int]) -> None:
        """Rows finished: row ``i`` of the drafter's caches becomes its row ``order[i]`` (called before ``rows`` is
        narrowed)."""
        ...

    def release(self) -> None:
        """Free the caches kept between calls (the next `begin` allocates them again)."""
        ...
