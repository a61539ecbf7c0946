"""Asynchronous GRPO against synchronous GRPO on the same processes: two processes under torchrun (gloo on a CPU,
one thread each), the default run's model, data and options (`configs/default.yaml`: SmolLM2-135M-Instruct, 16
completions of up to 128 tokens per optimizer step), ``--steps`` steps each, one after the other in one run:

- ``synchronous``: DDP, each process generating and training 8 of the step's 16 completions in turn;
- ``asynchronous``: ``rollout_processes: 1``, rank 1 generating all 16 on the newest weights it holds while rank 0
  trains on them, at each ``--max-staleness``.

Per run: completion tokens trained per second (the steps' completion tokens over the sum of their ``time/step``,
which the training process spends generating or waiting for a generation as well as training), the mean reward of
the last half of the steps, and for the asynchronous runs the samples' mean staleness, the training process's
seconds waiting for generations and the rollout process's waiting for weights, per step, and the share of the rollout
process's decoding steps that decoded completions of several generations (the next one taking the last one's rows).

    python benchmarks/bench_async.py [--steps 20] [--max-staleness 1 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from record import REPO, Record

ROWS = 16  # completions per optimizer step in every run (configs/default.yaml)
# the synchronous runs: each of the two processes generates and trains 8 of a step's 16 completions
SYNCHRONOUS = ["--per_device_train_batch_size=8", "--gradient_accumulation_steps=1"]


def run(name: str, options: list[str], steps: int | None, tmp: Path) -> list[dict]:
    """A two-process ``fastgrpo train`` of the default config (or the ``--config=`` first in ``options``) with
    ``options``, of ``steps`` optimizer steps (None: the config's); its logged steps."""
    out = tmp / name
    config = str(REPO / "configs" / "default.yaml")
    if options and options[0].startswith("--config="):
        config, options = options[0].split("=", 1)[1], options[1:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "fastgrpo", "train", "--config", config, f"--output_dir={out}", "--progress_bar=false"]
    if steps is not None:
        cmd += [f"--max_steps={steps}", f"--save_steps={steps}"]
    cmd += ["--log_completions=false", *options]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"{name}: {' '.join(options)}", flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def row(name: str, logged: list[dict]) -> list[object]:
    tokens = sum(m["completions/mean_length"] * ROWS for m in logged)
    seconds = sum(m["time/step"] for m in logged)
    late = logged[len(logged) // 2 :]
    reward = statistics.mean(m["reward"] for m in late)

    def mean(key: str) -> str:
        values = [m[key] for m in logged if key in m]
        return f"{statistics.mean(values):.2f}" if values else "-"

    per_second = tokens / seconds
    print(f"{name}: {per_second:.1f} completion tokens trained per second, reward {reward:.3f}", flush=True)
    waits = [mean("async/staleness"), mean("async/trainer_wait_seconds"), mean("async/rollout_wait_seconds")]
    waits.append(mean("async/overlapped_step_share"))
    return [name, len(logged), f"{tokens:.0f}", f"{seconds:.1f}", f"{per_second:.1f}", f"{reward:.3f}", *waits]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of each run")
    parser.add_argument("--max-staleness", type=int, nargs="+", default=[1, 4], help="the asynchronous runs' bounds")
    args = parser.parse_args()
    record = Record("bench_async")
    runs = {"synchronous": SYNCHRONOUS}
    for bound in args.max_staleness:
        runs[f"asynchronous, max_staleness {bound}"] = ["--rollout_processes=1", f"--max_staleness={bound}"]
    with tempfile.TemporaryDirectory() as tmp:
        table = [
            row(name, run(f"run{i}", options, args.steps, Path(tmp))) for i, (name, options) in enumerate(runs.items())
        ]
    baseline = float(table[0][4])
    for line in table:
        line.insert(5, f"{float(line[4]) / baseline:.2f}")
    record.table(
        f"Two processes, {args.steps} steps of the default run each: completion tokens trained per second",
        ["run", "steps", "completion tokens", "step seconds", "tokens/s", "ratio", "late reward", "staleness",
         "trainer wait s", "rollout wait s", "overlapped steps"],
        table,
    )  # fmt: skip
    record.save()


if __name__ == "__main__":
    main()
