"""``python interrupted_run.py CONFIG MOMENT STEP [SIGNAL] [ARG ...]``: ``fastgrpo train --config CONFIG ARG ...`` in
this process, stopped by SIGNAL (``KILL``, the default, or ``TERM``) at ``MOMENT`` of step ``STEP`` (1-based):
``rollout`` (inside the rollout's decoding), ``save`` (the trainer state half written to its temporary directory) or
``prune`` (one file of the checkpoint being pruned deleted); ``never`` runs to the end.

With ``FAKE_CLOCK=1`` in the environment, ``time.perf_counter`` advances by 2**-10 s at every call (a binary
fraction, so that the difference of two readings is exact wherever the clock stands): what the
adaptive controller measures (and the latency profile it calibrates) is then the same in every run, so that its
choices, and the draft's online learning that follows them, are too."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from fastgrpo import cli
from fastgrpo.grpo import checkpoint
from fastgrpo.rollout.engine import RolloutEngine

SIGNAL = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}
chosen = [signal.SIGKILL]


def die() -> None:
    os.kill(os.getpid(), chosen[0])


def fake_clock() -> None:
    """``time.perf_counter`` as a counter of its calls, 2**-10 s each."""
    calls = [0]

    def perf_counter() -> float:
        calls[0] += 1
        return calls[0] * 2.0**-10

    time.perf_counter = perf_counter


def main(config: str, moment: str, step: int, signal_name: str = "KILL", *args: str) -> None:
    chosen[0] = SIGNAL[signal_name]
    if os.environ.get("FAKE_CLOCK") == "1":
        fake_clock()
    calls = {"rollout": 0}
    if moment == "rollout":
        real_decoding = RolloutEngine.decoding  # what every generation call runs in

        def decoding(self, *args, **kwargs):
            calls["rollout"] += 1
            if calls["rollout"] == step:
                self.step = lambda *a: die()  # after the prefill, at the first decoding step
            return real_decoding(self, *args, **kwargs)

        RolloutEngine.decoding = decoding
    elif moment == "save":
        real_save = torch.save

        def save(obj, path, *args, **kwargs):
            real_save(obj, path, *args, **kwargs)
            if str(path).endswith(checkpoint.STATE_FILE) and int(obj["step"]) == step:
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)
                die()

        checkpoint.torch.save = save
    elif moment == "prune":

        def rmtree(path, *args, **kwargs):
            files = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))
            os.remove(os.path.join(path, files[0]))
            die()

        checkpoint.shutil.rmtree = rmtree
    elif moment != "never":
        raise SystemExit(f"unknown moment {moment!r}")
    cli.main(["train", "--config", config, "--progress_bar", "false", *args])
    if moment == "never":
        return
    raise SystemExit(f"the run ended without being killed at {moment} of step {step}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
