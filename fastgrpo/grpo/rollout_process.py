"""The loop of a rollout process (`RolloutProcess`, see `fastgrpo.grpo.pipeline`): it makes generations on the
newest weights it holds, taking rank 0's weights between decoding steps, and sends each as soon as its
completions all ended. Where it can (no tools, every drafter built), one engine call spans generations: the next is
taken in once every completion in flight has begun and it is due, its completions taking finished rows' places, so
that no generation waits for the longest completion of the one before."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fastgrpo import distributed
from fastgrpo.device_memory import reset_peak_memory
from fastgrpo.grpo.batch import select_rows
from fastgrpo.grpo.generation import Generating, Produced, produce, scored
from fastgrpo.grpo.mailbox import Mailbox
from fastgrpo.grpo.pipeline import (
    BYE,
    DRAFTS_SAVED,
    FAILED,
    GENERATION,
    PAYLOAD_TAG,
    SAVE_DRAFTS,
    STOP,
    TRAINER,
    WEIGHT_TAG,
    WEIGHTS,
    Stopped,
    error_text,
    payload,
    resume_point,
    share_box,
    stop_error,
    version_runs,
)
from fastgrpo.grpo.weight_sync import check_same_parameters, synced_parameters
from fastgrpo.rollout.sequence import Generation as Call
from fastgrpo.rollout.sequence import Sequence
from fastgrpo.training_rollouts import drafts_folder

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A generation a rollout process's engine call decodes: its ``seqs`` (the call's sequences of its completions),
    the weight version ``start`` held when it was taken in and the ``marks`` of the weights taken since
    (`version_runs`: a completion that had not begun by a mark begins with the mark's weights); in a call that spans
    generations, also its dataset ``rows`` and ``prompt_ids``."""

    generation: int
    start: int
    seqs: list[Sequence] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    marks: list[tuple[int, list[int]]] = field(default_factory=list)


def share(produced: Produced, trainer: int, shares: int) -> Produced:
    """The rows of ``produced`` that training process ``trainer`` of ``shares`` trains: the ones it would have sampled
    itself (a generation's prompts and uniforms are cut into consecutive shares, `fastgrpo.grpo.prompts`), and their
    samples. The generation's metrics go with the first share alone (a job's metrics are reduced over its training
    processes, `distributed.reduce_metrics`: a figure only one holds is that one's)."""
    rows = produced.batch.completion_mask.shape[0] // shares
    index = torch.arange(trainer * rows, (trainer + 1) * rows, device="cpu")
    first = trainer == 0
    part = slice(trainer * rows, (trainer + 1) * rows)
    return Produced(
        produced.generation,
        select_rows(produced.batch, index),
        produced.metrics if first else {},
        produced.samples[part],
        produced.lengths[part],
        produced.versions[part],
        produced.oldest,
    )


class RolloutProcess:
    """The loop of a rollout process (`run`): ``trainer`` is the run's `GRPOTrainer` built on it."""

    def __init__(self, trainer: Generating):
        cfg = self.cfg = trainer.config
        self.trainer, self.group = trainer, distributed.message_group()
        rank, self.shares = dist.get_rank(), trainer.dist.shares  # (the ranks before the rollout processes train)
        self.index, self.count = rank - self.shares, cfg.rollout_processes
        session = Mailbox.session(self.group)
        check_same_parameters(trainer.model, self.group)  # again: user code may freeze between the trainer and here
        self.boxes = [Mailbox(share_box(rank, to), session) for to in range(self.shares)]
        self.up, self.down = self.boxes[0], Mailbox(f"down/{rank}", session)
        self.version = trainer.start_step  # the optimizer steps of the weights held
        self.next, self.dropped = resume_point(trainer)  # the next generation the training processes take, the drops
        self.limit = cfg.queue_maxsize // cfg.generation_batch_size  # generations ahead at most
        self.params = synced_parameters(trainer.model)
        self.step_began: float | None = None  # when the decoding step under way began
        self.flight: list[InFlight] = []  # the generations the engine's call decodes, oldest first
        self.waited = self.received = 0.0
        self.steps = self.overlapped = 0  # decoding steps since the last generation sent; those that emitted tokens of
        # several generations' completions
        self.done = threading.Event()

    def run(self) -> None:
        """Generate, send and take weights until rank 0 stops the run: generations one call each
        while tools run or a drafter waits to be built, otherwise in calls that span generations (`_span`)."""
        self.trainer.rollouts.between_steps = self._between_steps
        beating = threading.Thread(target=self._beat, name="fastgrpo-heartbeat", daemon=True)
        beating.start()
        g = self.next + (self.index - self.next) % self.count  # the first generation of this process
        try:
            while True:
                self._wait_until_due(g)
                if self.trainer.tools is None and not self.trainer.rollouts.waiting:
                    g = self._span(g)
                else:
                    self._send(self._produce(g))
                    g += self.count
        except Stopped:
            for box in self.boxes:
                box.post(BYE)
        except BaseException as e:
            lost = self._report(e)
            if lost is not None and isinstance(e, Exception):  # (a signal ends the process as it would have)
                gone = f"rollout process rank {dist.get_rank()}: the training processes are gone ({error_text(lost)})"
                raise stop_error(self.cfg, gone) from e
            raise
        finally:
            self.done.set()

    def _send(self, produced: Produced) -> None:
        """``produced`` to the training process, or a share of its rows to each (`share`)."""
        produced.oldest = min(runs[0][1] for runs in produced.versions)
        for trainer, box in enumerate(self.boxes):
            data = payload(produced if self.shares == 1 else share(produced, trainer, self.shares))
            box.post(GENERATION, data.numel(), produced.generation)
            dist.send(data, trainer, group=self.group, tag=PAYLOAD_TAG)

    def _produce(self, generation: int) -> Produced:
        """Generation ``generation`` in an engine call of its own (`produce`)."""
        self.flight = [InFlight(generation, self.version)]  # its sequences once the call began (`_between_steps`)
        produced = produce(self.trainer, generation, self.cfg.made_at(generation))
        return self._finished(produced, self.flight.pop())

    def _span(self, g: int) -> int:
        """Generations ``g``, ``g + K``, ... in one engine call (`fastgrpo.rollout.decoding.Decoding.extend`), so that
        none waits for the longest completion of the one before: the next is taken in once every completion in flight
        has begun and it is due (`_due`), its completions taking finished rows' places, and each is handed over, scored
        and sent as soon as its completions all ended. Returns the first generation not taken in once the call has no
        completion left (the next was not due while it had room for it)."""
        trainer, cfg = self.trainer, self.cfg
        rollouts, dist_info, n = trainer.rollouts, trainer.dist, cfg.num_generations
        where = (dist_info.rank, dist_info.world_size)
        reset_peak_memory(trainer.device)
        began, first = time.perf_counter(), self._part(g)
        args = (first.prompt_ids, trainer.sampling, n, g, *where, None, cfg.rows_at_once)
        with distributed.gathered(trainer.model), rollouts.decoding(*args) as run:
            first.seqs, self.flight = list(run.call.seqs), [first]
            g += self.count
            while True:
                while self.flight and run.ended(self.flight[0].seqs):  # (all may end in the prefill)
                    part = self.flight.pop(0)
                    out = rollouts.hand_over(run, part.seqs, part.prompt_ids, n)
                    seconds = time.perf_counter() - began  # since the generation handed over before
                    with run.paused():  # (scoring and the drafters' learning in the modules' own modes)
                        made = cfg.made_at(part.generation)
                        produced = scored(
                            trainer, part.generation, made, part.rows, part.prompt_ids, out, None, seconds
                        )
                        self._send(self._finished(produced, part))
                    began = time.perf_counter()
                if run.done:
                    return g
                self._between_steps(run.call)
                if not run.waiting.pending and self._due(g):
                    part = self._part(g)
                    part.seqs = rollouts.extend(run, part.prompt_ids, n, g, *where)
                    self.flight.append(part)
                    g += self.count
                before = [sum(len(s.completion_ids) for s in part.seqs) for part in self.flight]
                run.step()
                self.step_began = None
                grew = [
                    sum(len(s.completion_ids) for s in p.seqs) != b for p, b in zip(self.flight, before, strict=True)
                ]
                self.steps, self.overlapped = self.steps + 1, self.overlapped + (sum(grew) > 1)

    def _part(self, generation: int) -> InFlight:
        rows = self.trainer.prompts.rows(generation)
        return InFlight(generation, self.version, rows=rows, prompt_ids=self.trainer.prompts.encode(rows))

    def _finished(self, produced: Produced, part: InFlight) -> Produced:
        """``produced`` with its rows' token counts and weight versions (those of ``part``), and since the generation
        sent before, the waits and the share of decoding steps that decoded completions of several generations."""
        rows = produced.batch.completion_mask.shape[0]
        produced.lengths = [len(s.completion_ids) for s in part.seqs] if part.seqs else [1] * rows
        produced.versions = version_runs(part.start, part.marks, produced.lengths)
        produced.metrics |= {
            "async/rollout_wait_seconds": self.waited,
            "async/weight_receive_seconds": self.received,
            "async/overlapped_step_share": self.overlapped / max(self.steps, 1),
        }
        self.waited = self.received = 0.0
        self.steps = self.overlapped = 0
        return produced

    def _between_steps(self, call: Call | None) -> None:
        """Before a decoding step of ``call`` (None: once it ended): take the weights that came, with which the rows
        go on."""
        self.step_began = None
        if call is not None:
            if self.flight and not self.flight[0].seqs:  # a generation's call of its own (`_produce`) began
                self.flight[0].seqs = call.seqs
            self._poll()
            self.step_began = time.monotonic()

    def _due(self, g: int) -> bool:
        """Whether generation ``g`` would train at most ``max_staleness`` steps after the weights held, and the
        completions generated ahead fit the queue."""
        due = self.cfg.made_at(g - self.dropped) - self.cfg.max_staleness
        return self.version >= due and g - self.next < self.limit

    def _wait_until_due(self, g: int) -> None:
        """Wait (taking weights) until generation ``g`` is due (`_due`)."""
        t0 = time.monotonic()
        while not self._due(g):
            if not self._poll():
                time.sleep(0.005)
        self.waited += time.monotonic() - t0

    def _poll(self) -> bool:
        """Handle rank 0's messages that came; whether any did."""
        messages = self.down.poll()
        for kind, version, self.next, self.dropped, text in messages:
            if kind == STOP:
                raise Stopped
            if kind == SAVE_DRAFTS:  # into the checkpoint rank 0 writes (``text``: learners or not, its directory)
                if Path(text[1:]).is_dir():  # not when rank 0 gave up the checkpoint already
                    folder = drafts_folder(dist.get_rank(), self.shares)
                    self.trainer.rollouts.save(Path(text[1:]), learners=text[0] == "1", folder=folder)
                self.up.post(DRAFTS_SAVED)
            if kind == WEIGHTS:
                t0 = time.monotonic()
                with self.trainer.rollouts.engine.merged.unmerged():  # (LoRA adapters merged into a call's: timed too)
                    for param in self.params:
                        dist.recv(param, TRAINER, tag=WEIGHT_TAG)
                self.received += time.monotonic() - t0
                self.version = version
                for part in self.flight:
                    part.marks.append((version, [len(s.completion_ids) for s in part.seqs]))
        return bool(messages)

    def _report(self, error: BaseException) -> Exception | None:
        """Post ``error`` to the training processes and, unless it is a signal (the launcher ending the job, or one
        sent to this process alone), wait until rank 0 stops the run (it names this process before the launcher ends
        the job for its exit), for ``heartbeat_stale_after_s`` at most. The job's store failing as ``error`` is posted
        is returned: the store is rank 0's, or the first machine's torchrun agent's, so the training processes are
        gone. (Once posted, the store may go with rank 0 ending on it: the wait ends then.)"""
        try:
            for box in self.boxes:
                box.post(FAILED, text=f"{type(error).__name__}: {error_text(error)}")
        except Exception as lost:
            return lost
        deadline = time.monotonic() + (self.cfg.heartbeat_stale_after_s if isinstance(error, Exception) else 0)
        while time.monotonic() < deadline:
            try:
                if any(kind == STOP for kind, *_ in self.down.poll()):
                    break
            except Exception:
                break
            time.sleep(0.05)
        return None

    def _beat(self) -> None:
        """The heartbeat thread: a beat every quarter of ``heartbeat_stale_after_s``, but while a decoding step has
        run longer than half of it."""
        period = self.cfg.heartbeat_stale_after_s / 4
        while not self.done.wait(period):
            began = self.step_began
            if began is None or time.monotonic() - began < 2 * period:
                try:
                    self.up.beat()
                except Exception as e:  # the job's store is gone with the training processes, or failing
                    logger.warning("rollout process rank %d: its heartbeat stops (%s)", dist.get_rank(), error_text(e))
                    return
