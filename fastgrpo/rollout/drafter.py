"""The propose stage of an engine step: a drafter proposes a tree of candidate tokens per active row, which the
engine's target forward verifies. This is the interface (the drafter kit); `fastgrpo.speculative` holds the drafters
(the learned EAGLE head, the suffix drafter over earlier completions), each a package with the plugin that builds it
by name (`fastgrpo.speculative.registry`).

A drafter owns all of its per-row state (what it has read of each row, its caches) and narrows it in `select`
whenever rows finish, so that its row ``i`` is always row ``i`` of the batch. A drafter reads nothing back from the
device: what the host must know (how many tokens each row emitted, the rows' tokens) the engine hands it. Whatever
it proposes, verification keeps the output exactly the target's, as long as a tree does not depend on the step's own
random draws (it may depend on anything before them: the context, the other rows, earlier calls).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from fastgrpo.rollout.tree import DraftTree, TreeShape, merge_trees

if TYPE_CHECKING:
    from fastgrpo.rollout.cache import RowCache
    from fastgrpo.rollout.sequence import ActiveRows, GenerationOutput, Sequence


@dataclass
class Proposal:
    """One step's draft: ``tree`` with one tree per row; ``forwards`` draft forwards it took; ``backlog_seconds`` the
    part of its time spent reading tokens of earlier plain steps (their cost, not this tree's: the controller is
    told the step's time without it)."""

    tree: DraftTree
    forwards: int
    backlog_seconds: float = 0.0


@dataclass
class Prefill:
    """What a call's prefill gives the drafters. On the device: ``prompt_ids`` ``[P, T]`` right-padded prompts of
    ``prompt_len`` ``[P]`` tokens, ``hidden`` ``[P, T, H]`` the target's hidden states there, ``rows`` ``[R]`` the
    prompt of each row, ``first`` ``[R]`` each row's first sampled token and ``first_hidden`` ``[R, H]`` the hidden
    state it was drawn from. On the host: ``prompts`` the prompts' tokens, ``row_prompt`` the prompt of each row and
    ``seqs`` the rows' sequences (their completions grow as the call goes; ``seqs[i]`` is the prefill's row ``i``);
    at a call's start, ``waiting`` the prompts it takes in later (`fastgrpo.rollout.decoding.Refill`; not those of
    completions `fastgrpo.rollout.decoding.Decoding.extend` adds as the call goes)."""

    prompt_ids: torch.Tensor
    prompt_len: torch.Tensor
    hidden: torch.Tensor
    rows: torch.Tensor
    first: torch.Tensor
    first_hidden: torch.Tensor
    prompts: list[list[int]]
    row_prompt: list[int]
    seqs: list[Sequence]
    waiting: list[list[int]] = field(default_factory=list)


@dataclass
class Emitted:
    """What a step emitted: the first ``count[b]`` of ``[B, E]`` ``tokens`` of each row (``host_count``: ``count`` on
    the host), ``hidden`` ``[B, E, H]`` the target's hidden state each of them was drawn from."""

    tokens: torch.Tensor
    hidden: torch.Tensor
    count: torch.Tensor
    host_count: list[int]


@dataclass
class Rollout:
    """A finished generation call, as online learners see it: ``num_generations`` completions per prompt."""

    prompt_ids: list[list[int]]
    output: GenerationOutput
    num_generations: int


class Learner(Protocol):
    """A drafter's online learning: learns from a run's finished rollouts between steps, and has a state a
    checkpoint keeps."""

    @property
    def captures_hidden(self) -> bool:
        """Whether it needs the rollouts' target hidden states (`RolloutEngine.generate`'s ``capture_hidden``)."""
        ...

    def learn(self, rollouts: list[Rollout]) -> dict[str, float]:
        """Learn from the rollouts since the last call; returns metrics to log."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Drafter:
    """Proposes draft trees for the engine to verify. Every drafter implements proposing: `start`, `propose`,
    `accepted` and `select`; the rest is optional, with defaults for a drafter that keeps nothing between calls, has
    no network, does not learn and costs nothing worth pricing.

    Pricing (`cost`, `deepest`, `backlog`) is what the adaptive controller asks of a drafter."""

    name: str = ""
    learner: Learner | None = None  # None: it does not learn online
    modules: tuple[nn.Module, ...] = ()  # its networks: the engine runs them with its attention and linear routes
    compile_seconds: float = 0.0  # wall time its proposals spent compiling graphs so far
    compile_graphs: int = 0  # graphs its proposals compiled so far
    compile_shapes: int = 0  # shapes its compiled proposals met so far (on a GPU, the CUDA graphs recorded)
    cold_calls: int = 0  # proposals so far that compiled or warmed up a graph (`fastgrpo.rollout.compiled.Compiled`)

    @property
    def eager_calls(self) -> dict[str, int]:
        """Per compiled function of its proposals, the calls so far that ran eagerly though compiled."""
        return {}

    # -- proposing ------------------------------------------------------------------------------------------------
    def begin(self, rows: int, length: int, bound: TreeShape) -> bool:
        """A generation call of up to ``rows`` rows of ``length`` tokens starts (trees no larger than ``bound``);
        returns whether what it drafts from changed since the previous call (its measured acceptance is then out of
        date)."""
        return False

    def start(self, prefill: Prefill) -> None:
        """Set up the per-row state of a call's rows after the prefill."""
        raise NotImplementedError

    def admit(self, prefill: Prefill) -> None:
        """Rows join the call after the live ones, prefilled (``prefill``'s rows; `fastgrpo.rollout.decoding.Refill`):
        set up their state as `start` does."""
        raise NotImplementedError(f"the {self.name or type(self).__name__} drafter cannot take rows in mid-call")

    def propose(self, rows: ActiveRows, shape: TreeShape) -> Proposal:
        """A tree of ``shape`` for every active row, rooted at the row's pending token, with node scores."""
        raise NotImplementedError

    def propose_merged(self, rows: ActiveRows, shape: TreeShape, earlier: Proposal) -> Proposal:
        """`propose`, merged with ``earlier`` (the drafters' before it in the team) into one tree of ``shape``'s nodes
        (`merge_trees`, the earlier nodes first). A drafter that compiles its proposal may merge inside it (its own
        nodes then go first, `merges_inside`); the engine asks it last."""
        own = self.propose(rows, shape)
        tree = merge_trees(earlier.tree, own.tree, shape.nodes)
        return Proposal(tree, earlier.forwards + own.forwards, earlier.backlog_seconds + own.backlog_seconds)

    @property
    def merges_inside(self) -> bool:
        """Whether `propose_merged` merges inside its own compiled step (no launches of a merge of its own)."""
        return False

    def accepted(self, rows: ActiveRows, emitted: Emitted) -> None:
        """A step emitted ``emitted`` (called before the rows' sequences are appended to)."""
        raise NotImplementedError

    def select(self, order: list[int], index: torch.Tensor) -> None:
        """Rows finished: row ``i`` of the drafter's state becomes its row ``order[i]`` (``index``: ``order`` on the
        device)."""
        raise NotImplementedError

    def park(self, positions: list[int]) -> list[Any]:
        """The rows at ``positions`` wait on tools (`fastgrpo.rollout.turns`; called before the `select` that drops
        them): returns its state of each, which `rejoin` takes back."""
        raise NotImplementedError(f"the {self.name or type(self).__name__} drafter cannot draft for rows with tools")

    def rejoin(self, state: Any, emitted: Emitted) -> None:
        """A parked row (``state``: what `park` returned) rejoins as the last row, the tool turn's tokens fed to the
        target (``emitted``, one row: the tokens and the hidden states they follow, as a step's)."""
        raise NotImplementedError(f"the {self.name or type(self).__name__} drafter cannot draft for rows with tools")

    def release(self) -> None:
        """Free the caches kept between calls (the next `begin` allocates them again)."""

    def caches(self) -> tuple[RowCache, ...]:
        """The KV caches its compiled functions read (a new one means new shapes to settle)."""
        return ()

    def settle(self, rows: list[int], shapes: list[TreeShape]) -> None:
        """Before a call's first step (after `begin`), run each compiled function once for every row count of
        ``rows`` and every tree of ``shapes`` it may draft, so that the call's proposals compile and record
        nothing (`fastgrpo.rollout.engine.RolloutEngine.settle`); nothing for a drafter that compiles nothing."""

    # -- pricing --------------------------------------------------------------------------------------------------
    def cost(self, rows: int, shape: TreeShape, backlog: int = 1) -> float:
        """Predicted seconds to propose trees of ``shape`` for ``rows`` rows, after reading ``backlog`` pending
        tokens per row."""
        return 0.0

    def deepest(self, shape: TreeShape) -> int:
        """The deepest node its trees of ``shape`` may hold."""
        return shape.levels

    def backlog(self) -> int:
        """The most tokens a row has emitted that the drafter has not read yet (a tree would read them first)."""
        return 0

    def cost_state(self) -> dict[str, Any]:
        """What it measured of its own cost as it ran, as JSON-able data (saved with a checkpoint, so that a resumed
        run prices its trees as the uninterrupted one would); ``{}``: nothing."""
        return {}

    def load_cost_state(self, state: dict[str, Any]) -> None:
        """Take up what `cost_state` saved."""


class DrafterTeams:
    """Who may draft a tree of a shape, by `TreeShape.drafter`: each of ``drafters`` by its name, and all of them
    merged by their names joined with ``+`` (``eagle+suffix``); ``""`` names the only drafter."""

    def __init__(self, drafters: list[Drafter]):
        names = [d.name for d in drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"drafters need distinct names, got {names}")
        self.drafters = {d.name: d for d in drafters}
        self.teams = {name: [d] for name, d in self.drafters.items()} | {"+".join(names): drafters}
        if len(drafters) == 1:
            self.teams[""] = drafters

    def of(self, shape: TreeShape) -> list[Drafter]:
        """The drafters that propose ``shape``'s tree."""
        try:
            return self.teams[shape.drafter]
        except KeyError:
            raise ValueError(f"tree shape {shape} names none of the drafters {list(self.teams)}") from None

    def depth(self, shape: TreeShape) -> int:
        """The deepest node a tree of ``shape`` may hold, by whoever drafts it (`Drafter.deepest`)."""
        return max(d.deepest(shape) for d in self.of(shape))
