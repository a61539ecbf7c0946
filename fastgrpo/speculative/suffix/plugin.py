"""The suffix drafter's plugin (`fastgrpo.speculative.plugin.DrafterPlugin`): built at once, with a memory of
earlier completions bounded by ``speculation.suffix_memory_tokens``. It has no files of its own (its memory is its
learner's state), prices itself from its measured proposal times, and takes no device memory worth planning."""

from __future__ import annotations

from pathlib import Path

from fastgrpo.rollout.drafter import Drafter
from fastgrpo.speculative.plugin import DrafterContext, DrafterPlugin
from fastgrpo.speculative.suffix.drafter import SuffixDrafter


class SuffixPlugin(DrafterPlugin):
    name = SuffixDrafter.name
    parks_rows = True

    def build(self, ctx: DrafterContext, saved: Path | None = None) -> Drafter:
        return SuffixDrafter(ctx.speculation.suffix_memory_tokens)
