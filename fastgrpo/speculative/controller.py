"""The controllers that size each decoding step's draft tree from the live number of active rows (the interface,
`Controller`, and the fixed `StaticController` are the engine's, in `fastgrpo.rollout.scheduling`).

- `PaperController` (`fastgrpo.speculative.paper`): FastGRPO's rule from the verification capacity ``C_peak``.
- `AdaptiveController`: the shape (and drafter) of the highest predicted goodput, from live acceptance statistics per
  drafter, the drafters' own costs and a latency profile it corrects online; plain steps where no tree wins.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastgrpo.config import ControllerLimits
from fastgrpo.rollout.drafter import Drafter
from fastgrpo.rollout.scheduling import AUTOREGRESSIVE
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.speculative import acceptance
from fastgrpo.speculative.guard import SavingsGuard
from fastgrpo.speculative.paper import largest_shape, shape_for
from fastgrpo.speculative.profiler import LatencyProfile
from fastgrpo.speculative.state_json import from_json, to_json

TREES = "trees"  # the time corrections every drafter's trees share (a tree kind's own are "spec:<drafter>")


@dataclass
class AdaptiveController:
    """Maximises predicted goodput at every step.

    Candidate shapes are the paper's trees for ``N`` in ``1, 2, 4, 8, 16, ...`` and ``n_max``, for each of
    ``drafters`` (by name; merged drafters, such as ``eagle+suffix``, are one more name:
    `fastgrpo.speculative.merged.priced`): sizes a factor two apart, so that a compiled run settles few shapes
    (`fastgrpo.rollout.shape_menu`), at a goodput near enough the best of finer sizes. Every drafter has acceptance
    statistics of its own. For each:

    - expected tokens per row = 1 + sum over depths of the fraction of rows that accept a draft token at that depth, an
      exponential moving average per shape. Every verification updates the shape that ran and every smaller candidate
      with what its tree (the best ``n - 1`` of the same candidates) would have accepted, from the score ranks of the
      accepted path; a bigger tree accepts at least what a smaller one does, so each depth's estimate is at least that
      of every smaller measured shape; a shape never measured takes the biggest smaller measured one's (a lower bound)
      and, deeper, the depth averages pooled over the shapes that ran (from ``prior_accept ** d``, weighing as much as
      ``prior_rows`` observed rows: the first step, often of one or two rows, does not replace it);
    - predicted seconds = profiled target forward over ``B`` rows of ``N`` tokens plus the drafter's cost (its own
      `Drafter.cost`), times a correction factor: observed over profiled step time, averaged separately for
      autoregressive steps and each drafter's and for each power-of-two band of tokens in the target forward
      (``B * N``). A band a tree kind has not run yet takes the factor of any drafter's trees there (their target
      forward is the same: a profile that prices trees wrong prices every drafter's wrong), else the plain steps'
      factor of that band (a forward over as many tokens), else the kind's average, else any trees' average, else
      the plain steps' average (how fast the machine runs against its profile is the machine's). An average moves
      towards a step faster than it predicts at a weight of at least ``fast_time_rate`` (a step slowed by the machine
      is common, one sped up is not), and a plain probe (below) faster than its estimate replaces it. Whatever a step
      took, one observation moves an average by at most a factor ``max_price_step``, and a step that compiled or
      warmed up a graph is not timed at all (its acceptance counts, its time is the compiler's).

    The highest ratio wins, autoregressive included, except that a plain step runs first at each power-of-two band
    of rows where none has run yet: no tree is chosen against a plain step's time that nothing has measured (a
    latency profile calibrated while the machine was busy would otherwise have trees win at every step). Every
    ``probe_interval`` steps another candidate runs instead (the smaller ones learn from every step): the drafters
    take turns, the winning drafter probing its next bigger tree, another one its tree of the winner's size, unless
    it would lose even with every draft token accepted (counting the draft's catch-up on the plain steps before
    it). While a tree wins, every other probe is a plain step instead: plain steps' time is learnt only from plain
    steps, so one slow plain step would otherwise keep trees chosen for good at a concurrency where they lose. The
    interval doubles while probes lose (up to ``max_probe_interval``) and resets when the winner changes and at the
    start of every generation call. After the draft has changed (online learning), each drafter's first probe runs
    whatever its catch-up costs: otherwise a draft that was once bad would never be measured again, however much it
    learns.

    Tree probes are paid from a budget: every observed step earns ``explore_share`` of its seconds, and a due tree
    probe waits until the credit covers its predicted loss (its predicted seconds, the draft's catch-up included,
    less the time the winner would take for the tokens the probe is expected to emit). Tree probes thus cost at most
    that share of the time the controller has observed, however bad the draft and whatever the concurrency: where no
    tree can win, speculation costs little more than the controller's own arithmetic. (Plain probes are not charged:
    they only run while a tree wins, and are the one measure of a plain step that was once slow.)

    A kind of step last timed ``reprobe_steps`` steps ago or more is probed at its drafter's next turn whatever its
    price predicts (a price a rare slow step set too high is measured again, at most one step in ``reprobe_steps``).
    """

    profile: LatencyProfile
    limits: ControllerLimits = field(default_factory=ControllerLimits)
    accept_rate: float = 0.1
    time_rate: float = 0.2
    fast_time_rate: float = 0.5
    prior_accept: float = 0.7
    prior_rows: int = 2
    probe_interval: int = 16
    max_probe_interval: int = 256
    explore_share: float = 0.01
    max_price_step: float = 2.0
    reprobe_steps: int = 1024
    drafters: dict[str, Drafter] = field(default_factory=dict)
    guard: SavingsGuard = field(default_factory=SavingsGuard)

    def __post_init__(self) -> None:
        self.limits.validate()
        if not self.drafters:
            raise ValueError("the adaptive controller needs the drafters whose trees it prices")
        self._levels: dict[TreeShape, int] = {}  # `levels`, per shape
        n_max = self.limits.n_max
        ns = sorted({1 << i for i in range(1, n_max.bit_length())} | ({n_max} - {1}))
        self.names = list(self.drafters)
        self.groups = {name: [shape_for(self.limits, n, name) for n in ns] for name in self.names}
        self.shapes = [AUTOREGRESSIVE] + [s for group in self.groups.values() for s in group]
        self.depth_cap = max(self.levels(s) for s in self.shapes)
        # per drafter, the pooled P(accepted >= d + 1) over its shapes
        self.pooled = {name: [self.prior_accept ** (d + 1) for d in range(self.depth_cap)] for name in self.names}
        self.shape_accept: dict[TreeShape, list[float]] = {}  # per shape, P(accepted >= d + 1)
        # per drafter, `acceptance.estimates` and `expected_tokens` of its shapes, until it is next observed (`_forget`)
        self._estimates: dict[str, dict[TreeShape, list[float]]] = {}
        self._expected: dict[str, dict[TreeShape, float]] = {}
        self._forwards: dict[tuple[int, int], float] = {}  # the profile's forward times by (rows, nodes)
        self.correction: dict[tuple[str, int | None], float] = {(self._kind(s), None): 1.0 for s in self.shapes}
        self._counts: dict[object, int] = {}  # observations behind each average (its first ones weigh more)
        self._interval = self.probe_interval
        self._since_probe = 0
        self._turn = 0  # whose turn the next probe is (see `choose`)
        self._last_best: TreeShape | None = None
        self._probed_up = False  # the last probe ran a bigger tree (while a tree wins, the next probe is a plain step)
        self._credit = 0.0  # seconds of step time the next probes may lose (see the class)
        self._stale: set[str] = set()  # drafters not measured since a draft changed (see `begin`)
        self._steps = 0  # steps observed
        self._timed: dict[str, int] = {}  # per kind of step, `_steps` when its time was last observed

    def drafters_settled(self) -> None:
        """Forget each shape's depth and what rests on it (a compiled drafter may now expand deeper trees)."""
        self._levels, self._estimates, self._expected = {}, {}, {}

    def levels(self, shape: TreeShape) -> int:
        """How deep the tree of ``shape`` may go (its drafter's `Drafter.deepest`, looked up once per shape)."""
        levels = self._levels.get(shape)
        if levels is None:
            levels = self._levels[shape] = self.drafters[shape.drafter].deepest(shape) if shape.speculative else 0
        return levels

    def draft_seconds(self, rows: int, shape: TreeShape, backlog: int = 1) -> float:
        """Predicted seconds to draft ``shape`` for ``rows`` rows (its drafter's `Drafter.cost`)."""
        return self.drafters[shape.drafter].cost(rows, shape, backlog) if shape.speculative else 0.0

    @property
    def max_shape(self) -> TreeShape:
        return largest_shape(self.limits)

    def _fractions(self, shape: TreeShape) -> list[float]:
        """Estimated fraction of rows that accept a draft token at each depth with this shape (see the class)."""
        name = shape.drafter
        estimates = self._estimates.get(name)
        if estimates is None or shape not in estimates:
            group = {*self.groups[name], shape}  # the shapes measured (`shape_accept`) are candidates of the groups
            estimates = self._estimates[name] = acceptance.estimates(
                group, self.shape_accept, self.pooled[name], self.levels
            )
        return estimates[shape]

    def expected_tokens(self, shape: TreeShape) -> float:
        """Expected tokens emitted per row by a step of this shape: each depth's fraction capped by the one above (a
        deep level not run yet keeps its prior, which must not outweigh a measured zero at depth 1)."""
        if not shape.speculative:
            return 1.0
        expected = self._expected.setdefault(shape.drafter, {})
        total = expected.get(shape)
        if total is None:
            total, reached = 1.0, 1.0
            for fraction in self._fractions(shape)[: self.levels(shape)]:
                reached = min(reached, fraction)
                total += reached
            expected[shape] = total
        return total

    @staticmethod
    @functools.cache
    def _kind(shape: TreeShape) -> str:
        """Whose step times a correction averages: plain steps', or those of a drafter's trees."""
        return "ar" if shape.nodes == 1 else f"spec:{shape.drafter}" if shape.drafter else "spec"

    def _forward_seconds(self, rows: int, nodes: int) -> float:
        """The profile's target forward over ``rows`` rows of ``nodes`` tokens (looked up once per shape)."""
        if (rows, nodes) not in self._forwards:
            self._forwards[rows, nodes] = self.profile.tree_time(rows, nodes)
        return self._forwards[rows, nodes]

    def _profiled_seconds(self, rows: int, shape: TreeShape) -> float:  # the target forward and the drafter's cost
        return self._forward_seconds(rows, shape.nodes) + self.draft_seconds(rows, shape)

    def predicted_seconds(self, rows: int, shape: TreeShape) -> float:
        """Predicted wall time of a step of this shape at ``rows`` rows: the profile times the correction (a tree
        step, which does a plain step's work and drafts, never cheaper than a plain one)."""
        plain = self._plain_seconds(rows)
        return self._tree_seconds(rows, shape, plain) if shape.speculative else plain

    def _plain_seconds(self, rows: int) -> float:
        return self._correction("ar", rows) * self._forward_seconds(rows, 1)

    def _tree_seconds(self, rows: int, shape: TreeShape, plain: float) -> float:
        """`predicted_seconds` of a tree ``shape``, given a plain step's (``plain``)."""
        draft = self.drafters[shape.drafter].cost(rows, shape)
        forward = self._forwards.get((rows, shape.nodes)) or self._forward_seconds(rows, shape.nodes)
        return max(self._correction(self._kind(shape), rows * shape.nodes) * (forward + draft), plain + draft)

    def _correction(self, kind: str, tokens: int) -> float:
        """Observed over profiled step time for this kind of step with about ``tokens`` tokens in its forward: its own
        at that band, else any trees', the plain steps' there, else its own, the trees', the plain steps' average."""
        band, get = tokens.bit_length(), self.correction.get
        own = get((kind, band))
        if own is None and kind != "ar":
            own = get((TREES, band))
        if own is None:
            own = get(("ar", band))
        if own is not None:
            return own
        for key in (kind, TREES) if kind != "ar" else ():
            if (key, None) in self._counts:
                return self.correction[key, None]
        return self.correction["ar", None]

    def goodput(self, rows: int, shape: TreeShape) -> float:
        """Predicted tokens per second per row."""
        return self.expected_tokens(shape) / self.predicted_seconds(rows, shape)

    def best(self, rows: int) -> TreeShape:
        """The shape of the highest `goodput` (the first of equals, in `shapes`' order)."""
        plain = self._plain_seconds(rows)
        best, most = AUTOREGRESSIVE, 1.0 / plain
        for shape in self.shapes[1:]:
            rate = self.expected_tokens(shape) / self._tree_seconds(rows, shape, plain)
            if rate > most:
                best, most = shape, rate
        return best

    def begin(self, draft_changed: bool = False) -> None:
        """A call starts: probe often again (the concurrency starts high again, and the draft may have been trained
        since the last call, `draft_changed`: then each drafter's next probe runs whatever its catch-up costs)."""
        self._interval, self._since_probe = self.probe_interval, 0
        if draft_changed:
            self._stale = set(self.names)
            self.guard.saved.clear()  # a changed draft may save what the last one did not: probes may run again

    def choose(self, rows: int, backlog: int = 0) -> TreeShape:
        best = self.best(rows)
        if best.speculative and ("ar", rows.bit_length()) not in self._counts:
            return AUTOREGRESSIVE  # a plain step first at every band of rows: what a tree must beat is measured
        if best != self._last_best:
            self._last_best, self._interval, self._since_probe = best, self.probe_interval, 0
        self._since_probe += 1
        if self._since_probe < self._interval:
            return best
        probe = self._probe(best)
        if probe is None or (self.guard.losing and not self._overdue(probe)):  # while trees lose, overdue probes only
            self._probed(plain=False)
            return best
        seconds, catch_up = self.predicted_seconds(rows, probe), 0.0
        if probe.speculative and backlog > 1:
            # the draft first catches up with the plain steps since its last tree (at many rows, a draft prefill)
            catch_up = self.draft_seconds(rows, probe, backlog) - self.draft_seconds(rows, probe)
        # A shape that would lose even if every draft token were accepted (after its catch-up, unless its draft has
        # changed since it was last measured) is not worth a probe, unless its price is overdue for a measure.
        counted = seconds if probe.drafter in self._stale else seconds + catch_up
        overdue = self._overdue(probe)
        if probe.speculative and not overdue and (1 + self.levels(probe)) / counted <= self.goodput(rows, best):
            self._probed(plain=False)
            return best
        if probe.speculative:
            loss = max(0.0, seconds + catch_up - self.expected_tokens(probe) / self.goodput(rows, best))
            if loss > self._credit and not overdue:
                return best  # still due: it runs once the steps have earned its loss
            self._credit = max(0.0, self._credit - loss)
            if overdue:  # measured or not (a cold step is not timed), the next one is due reprobe_steps later
                self._timed[self._kind(probe)] = self._steps
        self._probed(plain=not probe.speculative)
        return probe

    def _overdue(self, shape: TreeShape) -> bool:
        """Whether the time of ``shape``'s kind of step was measured, but not in the last ``reprobe_steps`` steps."""
        timed = self._timed.get(self._kind(shape))
        return timed is not None and self._steps - timed >= self.reprobe_steps

    def _probe(self, best: TreeShape) -> TreeShape | None:
        """The candidate the due probe tries (None: none bigger): while a tree wins, every other probe is a plain
        step; otherwise the drafters take turns, the winner's drafter trying its next bigger tree, another drafter
        its smallest tree at least as big as the winner."""
        if best.speculative and self._probed_up:
            return AUTOREGRESSIVE
        name = self.names[self._turn % len(self.names)]
        group = self.groups[name]
        if not group:  # n_max 1: plain steps only
            return None
        if best.speculative and best.drafter == name:
            i = group.index(best)
            return group[i + 1] if i + 1 < len(group) else None
        return next((s for s in group if s.nodes >= best.nodes), group[-1])

    # What the controller learns as it runs (`state_dict`); the rest is its configuration or caches of it.
    LEARNT = (
        "pooled", "shape_accept", "correction", "_counts", "_interval", "_since_probe", "_turn", "_last_best",
        "_probed_up", "_credit", "_stale", "_steps", "_timed",
    )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Its acceptance statistics, time corrections and probe schedule as JSON-able data, with the candidate shapes
        they are of (`load_state_dict` takes them up only for the same candidates; the `guard` starts afresh)."""
        return {"shapes": to_json(self.shapes), **{name: to_json(getattr(self, name)) for name in self.LEARNT}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take up what `state_dict` saved; ``ValueError`` when saved for other candidate shapes (options, drafters)."""
        if from_json(state["shapes"]) != self.shapes:
            raise ValueError("the saved controller state is of other candidate tree shapes")
        learnt = {name: from_json(state[name]) for name in self.LEARNT}  # all decoded before any is taken up
        for name, value in learnt.items():
            setattr(self, name, value)
        self._estimates, self._expected = {}, {}

    def _probed(self, plain: bool) -> None:
        """The due probe ran (or was passed over): the next one is due after twice the interval, another drafter's
        turn (after a plain probe, the same drafter's)."""
        self._since_probe = 0
        self._interval = min(2 * self._interval, self.max_probe_interval)
        self._probed_up = not plain
        if not plain:
            self._turn += 1

    def _rate(self, key: object, rate: float) -> float:
        """Averaging weight of the next observation: ``1 / n`` for the first ones, then ``rate`` (an unbiased start)."""
        n = self._counts[key] = self._counts.get(key, 0) + 1
        return max(rate, 1.0 / n)

    def _accept_weight(self, key: object, rows: int) -> float:
        """Averaging weight of an acceptance observation over ``rows`` rows: its rows over all rows seen so far plus
        ``prior_rows`` (an average of the rows, prior included), then at least ``accept_rate``."""
        seen = self._counts[key] = self._counts.get(key, 0) + rows
        return max(self.accept_rate, rows / (seen + self.prior_rows))

    def observe(
        self,
        rows: int,
        shape: TreeShape,
        seconds: float | None,
        accepted: list[int] | None,
        path_rank: np.ndarray | None = None,
    ) -> float:
        """`fastgrpo.rollout.scheduling.Controller.observe`; returns the seconds a timed tree step saved (`guard`)."""
        self._steps, saved = self._steps + 1, 0.0
        if seconds is not None and accepted is not None and shape.speculative:
            saved = self.guard.observe(rows, rows + sum(accepted), seconds, self._plain_seconds(rows))
        if seconds is not None:
            self._observe_time(rows, shape, seconds)
        if accepted is None or shape.nodes == 1:
            return saved
        self._stale.discard(shape.drafter)
        levels = self.levels(shape)
        if path_rank is None:  # the accepted nodes taken as the best-scored chain
            chain = np.arange(1, levels + 1)
            path_rank = np.where(chain <= np.array(accepted)[:, None], chain, shape.nodes)
        # what each candidate no bigger than ``shape``, smallest first, would have accepted on this step (the last,
        # ``shape`` itself where it is one: the fraction of rows that accepted a draft token at each depth)
        candidates = [c for c in self.groups[shape.drafter] if c.fits_in(shape)]
        reached = acceptance.nested_acceptance(candidates, self.levels, path_rank, self.depth_cap)
        mine = candidates[-1:] == [shape]
        fractions = reached[-1] if mine else acceptance.depth_fractions(accepted, self.depth_cap)
        pooled = self.pooled[shape.drafter]
        for d in range(levels):
            pooled[d] += self._accept_weight(("depth", shape.drafter, d), rows) * (fractions[d] - pooled[d])
        self._forget(shape.drafter)
        first = {c: list(self._fractions(c)) for c in candidates if c not in self.shape_accept}  # their priors
        for candidate, fractions in zip(candidates, reached, strict=True):
            own = self.shape_accept.setdefault(candidate, first.get(candidate))
            rate = self._accept_weight(candidate, rows)
            for d in range(self.levels(candidate)):
                own[d] += rate * (fractions[d] - own[d])
        self._forget(shape.drafter)
        return saved

    def _forget(self, name: str) -> None:
        """Drop what `_fractions` and `expected_tokens` keep of drafter ``name``'s shapes (its statistics moved)."""
        self._estimates.pop(name, None)
        self._expected.pop(name, None)

    def _observe_time(self, rows: int, shape: TreeShape, seconds: float) -> None:
        """Move the time corrections of ``shape``'s kind towards what a step of ``rows`` rows took (by at most a
        factor ``max_price_step``) and earn probe credit."""
        kind = self._kind(shape)
        self._timed[kind] = self._steps
        self._credit += self.explore_share * seconds
        ratio = seconds / max(self._profiled_seconds(rows, shape), 1e-12)
        # A plain step while a tree wins is a probe, and nothing else measures plain steps: one that ran faster than
        # estimated replaces the estimate. Too low an estimate is safe: plain steps then win and every step
        # measures them.
        plain_probe = not shape.speculative and self._last_best is not None and self._last_best.speculative
        band = (rows * shape.nodes).bit_length()
        kinds = (kind, TREES) if shape.speculative else (kind,)
        for key in [(k, b) for k in kinds for b in (None, band)]:
            # a price never measured starts from what it was predicted with (the plain steps' where it has no own)
            current = self.correction[key] if key in self._counts else self._correction(kind, rows * shape.nodes)
            rate = self._rate(key, self.time_rate)
            if ratio < current:
                rate = 1.0 if plain_probe else max(rate, self.fast_time_rate)
            moved = current + rate * (ratio - current)
            self.correction[key] = min(max(moved, current / self.max_price_step), current * self.max_price_step)
