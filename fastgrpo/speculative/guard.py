"""What speculation saved, as the adaptive controller's prices tell it, and the guard that stops its probes while it
saved less than it cost (`SavingsGuard`)."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class SavingsGuard:
    """The seconds each of the last ``window`` timed tree steps saved: the estimated time of plain steps emitting the
    same tokens (its tokens per row, each a plain step at as many rows) less the tree step's own time, its drafting
    included but not the draft's catch-up on the plain steps before it (``spec/time_saved`` adds them up per call).
    While the window is full and its sum is negative, trees have cost more than they saved: `losing` says so, the
    run's log says so once, and the adaptive controller runs no probes but those overdue (a kind of step not timed for
    ``reprobe_steps``), only the steps it predicts to win (whose trees refill the window), until the window sums to a
    gain again or the draft changes (online learning empties the window: a changed draft may save what the last one
    did not)."""

    window: int = 64
    saved: deque[float] = field(default_factory=deque)
    warned: bool = False

    def observe(self, rows: int, tokens: int, seconds: float, plain_seconds: float) -> float:
        """A tree step of ``rows`` rows emitted ``tokens`` tokens in ``seconds``, where a plain step at those rows is
        estimated at ``plain_seconds``: returns the seconds it saved (negative: it cost)."""
        saved = tokens / rows * plain_seconds - seconds
        self.saved.append(saved)
        while len(self.saved) > self.window:
            self.saved.popleft()
        if not self.warned and self.losing:
            self.warned = True
            logger.warning(
                "speculation cost %.3f s more than plain steps would have over its last %d tree steps: trees run "
                "only where predicted to win, without probes, until they save time again",
                -sum(self.saved),
                self.window,
            )
        return saved

    @property
    def losing(self) -> bool:
        """Whether the last ``window`` tree steps cost more than plain steps would have."""
        return len(self.saved) >= self.window and sum(self.saved) < 0
