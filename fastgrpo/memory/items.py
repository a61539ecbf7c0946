"""What a memory plan is made of: items of device memory, each with its bytes at the four moments of a GRPO step."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
MOMENTS = ("decode", "draft update", "backward", "optimizer step")
PHASE_OF = ("rollout", "rollout", "update", "update")


@dataclass(frozen=True)
class MemoryItem:
    """One thing a run keeps on its device: ``bytes`` at each of the four moments of `MOMENTS`."""

    name: str
    bytes: tuple[int, int, int, int]

    @property
    def peak(self) -> int:
        return max(self.bytes)


class MemoryItems:
    """Collects `MemoryItem`s, dropping those that are 0 at every moment."""

    def __init__(self) -> None:
        self.items: list[MemoryItem] = []

    def add(self, name: str, decode: float = 0, draft: float = 0, backward: float = 0, step: float = 0) -> None:
        values = tuple(int(v) for v in (decode, draft, backward, step))
        if any(values):
            self.items.append(MemoryItem(name, values))  # type: ignore[arg-type]

    def resident(self, name: str, size: float) -> None:
        """An item of the same size at every moment."""
        self.add(name, size, size, size, size)
