"""The asynchronous pipeline's messages (`fastgrpo.grpo.pipeline`): one way between two processes of the job, through
the store the job rendezvoused with."""

from __future__ import annotations

import torch
import torch.distributed as dist


class Mailbox:
    """One way's messages between two processes through the job's store (``name``: the way): each a kind, three
    numbers and a text, `post`-ed by one process and `poll`-ed (without waiting) by the other; and a count of
    heartbeats (`beat`, `beats`)."""

    def __init__(self, name: str, session: int):
        self.store = dist.PrefixStore(f"fastgrpo/pipeline/{session}/{name}/", _job_store())
        self.sent = self.read = 0

    @staticmethod
    def session(group: dist.ProcessGroup) -> int:
        """The number of the pipeline every process of the job begins in a `train` call, counted by rank 0 and
        broadcast over ``group`` (every process of the job; a collective), so that the mailboxes of a later call start
        empty and every process reads the same ones, even after a call that one of them left early."""
        counted = _job_store().add("fastgrpo/pipeline/sessions", 1) if dist.get_rank() == 0 else 0
        number = torch.tensor([counted], device="cpu")  # the message group is gloo's
        dist.broadcast(number, 0, group=group)
        return int(number)

    def post(self, kind: int, a: int = 0, b: int = 0, c: int = 0, text: str = "") -> None:
        self.store.set(str(self.sent), f"{kind},{a},{b},{c},{text}")
        self.sent += 1
        self.store.add("count", 1)

    def poll(self) -> list[tuple[int, int, int, int, str]]:
        """The messages posted since the last poll, oldest first."""
        count, messages = self.store.add("count", 0), []
        for i in range(self.read, count):
            kind, a, b, c, text = self.store.get(str(i)).decode().split(",", 4)
            messages.append((int(kind), int(a), int(b), int(c), text))
        self.read = count
        return messages

    def beat(self) -> None:
        self.store.add("beats", 1)

    def beats(self) -> int:
        return self.store.add("beats", 0)


def _job_store() -> dist.Store:
    """The store the job rendezvoused with (torch.distributed has no public accessor of it)."""
    return dist.distributed_c10d._get_default_store()
