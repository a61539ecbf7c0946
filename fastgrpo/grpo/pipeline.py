"""Asynchronous GRPO (``rollout_processes``): rollout processes sample while the training processes train.

Under torchrun with ``rollout_processes: K``, the job's last K ranks are rollout processes and the others train (DDP,
or FSDP2 with ``fsdp``). A rollout process (`fastgrpo.grpo.rollout_process`) makes generations (generation ``g`` by
the ``g mod K``-th, counted from 0) on the newest weights it holds, the next one's completions taking the rows of the
last one's as they end, and sends each (`Produced`), as soon as its completions all ended, whole to the training
process, or to each training process its share (the rows it would have sampled itself). They train on them in order,
and rank 0 sends its weights to every rollout process every ``weight_sync_steps`` optimizer steps. New weights are
taken between decoding steps: rows in flight go on with them (their cache from the older weights kept), and every
token's weight version is recorded (`Produced.versions`). A sample's staleness is the optimizer steps between its
oldest token's weights and those its update starts from. A rollout process starts no generation whose samples would
train more than ``max_staleness`` steps late, nor one past ``queue_maxsize`` completions per training process
generated and not yet trained; a sample that comes past the bound all the same is dropped and counted. With
``importance_sampling_correction`` the update corrects for the older weights with the sampler's log-probabilities.

Messages go through the job's store (`fastgrpo.grpo.mailbox.Mailbox`: a few numbers, checked without waiting; apart
for each `train` call), payloads point to point over a gloo group of every process (`distributed.message_group`), the
weights over the job's own group, on the device (`SentWeights`: with LoRA the adapters alone, taken apart from the
base weights a call merged them into and merged again; under FSDP2 gathered by every training process first). A
thread of each rollout process beats every quarter of ``heartbeat_stale_after_s`` seconds, but while a decoding step
has run longer than half of it, so that each training process names a rollout process that stays silent longer (it
died, or a step hangs), and one that failed, with its error. A checkpoint holds the generations dropped so far; a
resumed run goes on after them.
"""

from __future__ import annotations

import logging
import pickle
import re
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fastgrpo import distributed
from fastgrpo.errors import RolloutFailed
from fastgrpo.grpo.checkpoint import latest_checkpoint
from fastgrpo.grpo.generation import Generating, Produced
from fastgrpo.grpo.mailbox import Mailbox
from fastgrpo.grpo.weight_sync import SentWeights, check_same_parameters, gathered_dtype

if TYPE_CHECKING:
    from fastgrpo.config import GRPOConfig

logger = logging.getLogger(__name__)

GENERATION, FAILED, BYE, DRAFTS_SAVED = 1, 2, 3, 4  # from a rollout process
WEIGHTS, PROGRESS, STOP, SAVE_DRAFTS = 5, 6, 7, 8  # from rank 0 (with its version, next and drops)
PAYLOAD_TAG, WEIGHT_TAG = 1, 2
TRAINER = 0


class Stopped(Exception):
    """The training process ended the run."""


def payload(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _received(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())


def share_box(rollout: int, trainer: int) -> str:
    """The mailbox through which the rollout process of rank ``rollout`` tells the training process of rank
    ``trainer`` of its shares, its failure and its goodbye; rank 0's also carries its heartbeats and the rest."""
    return f"up/{rollout}" if trainer == TRAINER else f"up/{rollout}/{trainer}"


def resume_point(trainer: Generating) -> tuple[int, int]:
    """The first generation of a run begun or resumed at ``trainer.start_step``, the drops before it (see
    `RolloutFeed.state`)."""
    dropped = trainer.generations_dropped
    return trainer.config.first_generation(trainer.start_step) + dropped, dropped


def version_runs(start: int, marks: list[tuple[int, list[int]]], lengths: list[int]) -> list[list[tuple[int, int]]]:
    """Per row, ``(first position, weight version)`` runs of its ``lengths[row]`` tokens: the rows were taken into the
    call with weights ``start`` held, and each mark ``(version, tokens of each row then)`` took new ones before a
    decoding step (a row with no token by then begins with them)."""
    runs: list[list[tuple[int, int]]] = []
    for row, length in enumerate(lengths):
        mine = [(0, start)]
        for version, at in marks:
            if at[row] >= length:
                break
            if at[row] == mine[-1][0]:
                mine[-1] = (at[row], version)
            else:
                mine.append((at[row], version))
        runs.append(mine)
    return runs


def token_lags(versions: list[list[tuple[int, int]]], lengths: list[int], version: int) -> list[int]:
    """Each token's lag (``version`` less its weights') over the rows of ``lengths`` tokens."""
    lags: list[int] = []
    for runs, length in zip(versions, lengths, strict=True):
        ends = [start for start, _ in runs[1:]] + [length]
        lags += [lag for (start, v), end in zip(runs, ends, strict=True) for lag in [version - v] * (end - start)]
    return lags


class RolloutFeed:
    """A training process's side: a thread receives what the rollout processes send it; `take` hands the next
    generation (or its share) in order, dropping those past ``max_staleness``; on rank 0, `after_step` sends the weights
    every ``weight_sync_steps`` steps and `close` stops the rollout processes."""

    def __init__(self, trainer: Generating):
        cfg = self.cfg = trainer.config
        if cfg.max_staleness and not cfg.importance_sampling_correction:
            logger.warning(
                "rollout_processes: samples up to %d steps stale train as if the weights that sampled them were "
                "the update's; importance_sampling_correction: true corrects for them",
                cfg.max_staleness,
            )
        self.group, world, me = distributed.message_group(), dist.get_world_size(), dist.get_rank()
        self.ranks, self.main = list(range(world - cfg.rollout_processes, world)), me == TRAINER
        session = Mailbox.session(self.group)
        dtype = gathered_dtype(trainer.update)
        self.weights = SentWeights(trainer.update.policy, trainer.model, dtype, self.main)  # (`after_step`)
        check_same_parameters(trainer.model, self.group, dtype)  # again: user code may freeze after the trainer's
        self.up = {rank: Mailbox(share_box(rank, me), session) for rank in self.ranks}  # (rank 0's: every message)
        self.beating = {rank: Mailbox(share_box(rank, TRAINER), session) for rank in self.ranks}  # (its heartbeats)
        self.down = {rank: Mailbox(f"down/{rank}", session) for rank in self.ranks} if self.main else {}
        self.version = trainer.start_step
        self.next, self.dropped = resume_point(trainer)  # the drops so far: those of the checkpoint resumed from
        self.items: dict[int, Produced] = {}
        self.error: str | None = None
        self.ready = threading.Condition()
        self.closing = False
        # The weights' sends in flight, each with the rank it goes to (the weights must not change until they end).
        self.sending: list[tuple[int, Any]] = []
        sends = ("async/weight_send_seconds",) if self.main else ()  # (rank 0 alone sends weights)
        self.figures = dict.fromkeys(("async/trainer_wait_seconds", *sends, "async/dropped_samples"), 0.0)
        self.drafts_saved = 0  # of the rollout processes asked to (`save_drafts`)
        self.thread = threading.Thread(target=self._receive, name="fastgrpo-rollout-feed", daemon=True)
        self.thread.start()

    def take(self) -> Produced:
        """The next generation whose staleness is within ``max_staleness`` (waiting for it), with the
        ``async/*`` figures of the steps since the last one taken."""
        t0 = time.monotonic()
        while True:
            with self.ready:
                while self.next not in self.items and self.error is None:
                    if not self.thread.is_alive():
                        raise stop_error(self.cfg, "the rollout processes ended before the run did")
                    self.ready.wait(0.05)
                if self.error is not None:
                    raise stop_error(self.cfg, self.error)
                produced, queued = self.items.pop(self.next), len(self.items)
            self.next += 1
            oldest = produced.oldest  # (of the whole generation: every training process drops the same)
            if self.version - oldest <= self.cfg.max_staleness:
                break
            self.dropped += 1
            self.figures["async/dropped_samples"] += len(produced.lengths)
            self._tell(PROGRESS)  # at once: the generation after it may wait on weights that wait on it
        self._tell(PROGRESS)  # the rollout processes may run as far ahead again
        self.figures["async/trainer_wait_seconds"] += time.monotonic() - t0
        lags = token_lags(produced.versions, produced.lengths, self.version)
        produced.metrics |= {
            **self.figures,
            "async/staleness": float(self.version - oldest),
            "async/token_lag/mean": sum(lags) / len(lags),
            "async/token_lag/max": float(max(lags)),
            "async/queue_depth": float(queued),
        }
        self.figures = dict.fromkeys(self.figures, 0.0)
        return produced

    def state(self) -> dict[str, int]:
        """What a checkpoint holds of the feed: the generations dropped so far. Drops happen only while a pass takes
        its generations, and a pass takes several only when it is one step long (``generations_per_step`` above 1),
        so a run resumed at any step, inside a pass too, goes on from the step's first generation plus the drops."""
        return {"generations_dropped": self.dropped}

    def before_update(self) -> None:
        """Before the update changes the parameters: wait until the weights sent last have left, unless rank 0 sends
        copies of them (under FSDP2), which only the next sync writes."""
        if not self.weights.copies:
            self._sent()

    def _sent(self) -> None:
        """Wait until the weights sent last have left; a rollout process named dead or failed meanwhile (its sends
        would wait for the process group's timeout), or one whose send failed, stops the run."""
        t0 = time.monotonic()
        sending, self.sending = self.sending, []
        if not sending:  # (no weights sent since: on other training processes than rank 0, always)
            return
        done = threading.Event()
        failed: list[tuple[int, Exception]] = []  # the first send that failed, and its rank

        def wait() -> None:  # (a gloo send tells that it completed only to its `wait`)
            try:
                for rank, work in sending:
                    try:
                        work.wait()
                    except Exception as e:
                        failed.append((rank, e))
                        break
            finally:
                done.set()

        threading.Thread(target=wait, name="fastgrpo-weight-sends", daemon=True).start()
        while not done.wait(0.05):
            if self.error is not None:
                raise stop_error(self.cfg, self.error)
        if failed:
            raise self._send_failed(*failed[0])
        self.figures["async/weight_send_seconds"] += time.monotonic() - t0

    def _send_failed(self, rank: int, error: Exception) -> RolloutFailed:
        """The run's error for weights that could not be sent to rollout process ``rank`` (gloo: its connection
        closed, as when the process died), which then counts as named."""
        self._name(rank, f"weights could not be sent to it ({error_text(error)})")
        return stop_error(self.cfg, self.error)

    def _name(self, rank: int, what: str) -> None:
        """Name rollout process ``rank`` as failed, dead or silent (``what``), for every wait to raise; the first
        process named stays the run's error."""
        with self.ready:
            if self.error is None:
                self.error = f"rollout process rank {rank}: {what}"
            self.ready.notify()

    def after_step(self, version: int) -> None:
        """The weights of ``version`` optimizer steps are the module's: send them every ``weight_sync_steps``."""
        self.version = version
        if version % self.cfg.weight_sync_steps:
            return
        self._sent()  # (copies are written again below)
        t0 = time.monotonic()
        self.weights.gather()  # under FSDP2, by every training process
        if self.main:
            self._tell(WEIGHTS)
            for rank in self.ranks:
                try:
                    self.sending += [(rank, dist.isend(p, rank, tag=WEIGHT_TAG)) for p in self.weights.tensors]
                except RuntimeError as e:  # (gloo raises here once it knows the connection closed)
                    raise self._send_failed(rank, e) from e
            self.figures["async/weight_send_seconds"] += time.monotonic() - t0

    def save_drafts(self, checkpoint: Path, learners: bool) -> None:
        """Have every rollout process write its drafters, which learn from its own rollouts, into ``checkpoint``
        (`TrainingRollouts.save`, into its `drafts_folder`), and wait until each has."""
        with self.ready:
            self.drafts_saved = 0
        for box in self.down.values():
            box.post(SAVE_DRAFTS, self.version, self.next, self.dropped, f"{int(learners)}{checkpoint.resolve()}")
        with self.ready:
            while self.drafts_saved < len(self.ranks):
                if self.error is not None:
                    raise stop_error(self.cfg, self.error)
                self.ready.wait(0.05)

    def close(self) -> None:
        """Stop the rollout processes and wait until each has said goodbye (or failed, or stayed silent); on another
        training process than rank 0, wait until each has said goodbye (rank 0 stops them), unless closed as an error
        leaves `train`."""
        if not self.main:  # its shares come until rank 0 stopped the rollout processes and each said goodbye
            if sys.exc_info()[1] is None:  # (closed as an error leaves `train`: rank 0 may never stop them)
                self.thread.join(self.cfg.heartbeat_stale_after_s)
                if self.thread.is_alive():
                    logger.warning("a rollout process has not stopped after %g s", self.cfg.heartbeat_stale_after_s)
            self.closing = True
            return
        self._tell(STOP)
        try:
            if self.error is None:
                self._sent()
                self.thread.join(self.cfg.heartbeat_stale_after_s)
                if self.thread.is_alive():
                    logger.warning("a rollout process has not stopped after %g s", self.cfg.heartbeat_stale_after_s)
        except RolloutFailed as e:  # named while the last weights were leaving: the run ends all the same
            logger.warning("%s", e)
        finally:
            self.closing = True

    def _tell(self, kind: int) -> None:
        for box in self.down.values():
            box.post(kind, self.version, self.next, self.dropped)

    def _receive(self) -> None:
        """The thread: every rollout process's messages and generations, until each says goodbye, one fails or
        stays silent."""
        live, now = set(self.ranks), time.monotonic()
        seen, beats = dict.fromkeys(self.ranks, now), dict.fromkeys(self.ranks, 0)
        rank = self.ranks[0]
        try:
            while live and not self.closing:
                for rank in sorted(live):
                    messages, count = self.up[rank].poll(), self.beating[rank].beats()
                    if messages or count != beats[rank]:
                        seen[rank], beats[rank] = time.monotonic(), count
                    for kind, size, generation, _, text in messages:
                        if kind == FAILED:
                            raise RuntimeError(f"failed: {text}")
                        if kind == BYE:
                            live.discard(rank)
                        elif kind == DRAFTS_SAVED:
                            with self.ready:
                                self.drafts_saved += 1
                                self.ready.notify()
                        elif kind == GENERATION:
                            data = torch.empty(size, dtype=torch.uint8, device="cpu")
                            dist.recv(data, rank, group=self.group, tag=PAYLOAD_TAG)
                            with self.ready:
                                self.items[generation] = _received(data)
                                self.ready.notify()
                            seen[rank] = time.monotonic()
                    silent = time.monotonic() - seen[rank]
                    if rank in live and silent > self.cfg.heartbeat_stale_after_s:
                        raise RuntimeError(
                            f"sent nothing for {silent:.0f} s (heartbeat_stale_after_s "
                            f"{self.cfg.heartbeat_stale_after_s:g}): it died or hangs"
                        )
                time.sleep(0.005)
        except Exception as e:  # named, for `take` to raise
            self._name(rank, error_text(e))


def stop_error(cfg: GRPOConfig, error: str) -> RolloutFailed:
    """The run's one-line error for ``error``, with the checkpoint to continue from."""
    latest = latest_checkpoint(Path(cfg.output_dir))
    if latest:
        where = f"continue from {latest} with --resume"
    elif Path(cfg.output_dir).is_dir():
        where = "no checkpoint was written yet"
    else:  # (a rollout process on a machine that does not share the training processes' files)
        where = f"continue from the latest checkpoint in the training processes' {cfg.output_dir} with --resume"
    return RolloutFailed(f"{error}; the run stops ({where})")


def error_text(error: Exception) -> str:
    """``error``'s text; of one that gloo's transport raised (it begins with its source location), what happened
    alone, without the location and the advice after it."""
    text = str(error)
    located = re.match(r"\[[^\]]*\]\s*", text)
    return text[located.end() :].split(". ")[0].splitlines()[0] if located else text
