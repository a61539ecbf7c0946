"""Host time per decoding step: what the CPU does between a step's one read of the device and the next step's first
launch, where a GPU would idle. The default run's rollouts (`configs/default.yaml`: SmolLM2-135M-Instruct, 8
generations per prompt, up to 128 tokens at T=1) at 16 and 64 rows (2 and 8 prompts), with speculation off and with
static trees of the suffix drafter (the drafter that runs on the host), each rollout after ``--warmup`` rollouts that
fill the suffix memory. Per step, in milliseconds: the schedule (the controller's choice), the suffix drafter's
proposal (its search and tree, and the tree's copy to the device), and the postprocess (the step's read, the
sequences' appends, the drafters' bookkeeping, finished rows dropped, the controller told). On a CPU the device work
is synchronous, so these are the host's own costs; the whole step's time is shown beside them for scale only (it is
a CPU's compute, not a GPU's).

    python benchmarks/bench_host_time.py [--rollouts 3] [--warmup 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from record import REPO, Record

from fastgrpo.config.files import load_config
from fastgrpo.grpo.trainer import GRPOTrainer
from fastgrpo.speculative.suffix.drafter import SuffixDrafter

ROWS = (16, 64)
SPECULATION = {
    "off": ["--speculation.mode=off"],
    "suffix trees": ["--speculation.mode=static", "--speculation.drafter=suffix", "--speculation.nodes=8"],
}


class Timed:
    """Wraps ``owner.name`` so that each call's seconds are appended to ``seconds``."""

    def __init__(self, owner: object, name: str):
        self.seconds: list[float] = []
        inner: Callable = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - t0)

        setattr(owner, name, timed)


def measure(rows: int, speculation: str, rollouts: int, warmup: int, tmp: Path) -> list[str]:
    """One table row: the median milliseconds per step of each host part, over ``rollouts`` rollouts."""
    options = [
        f"--output_dir={tmp / f'{rows}-{speculation}'}",
        "--progress_bar=false",
        f"--gradient_accumulation_steps={rows // 8}",
        *SPECULATION[speculation],
    ]
    run = GRPOTrainer(load_config(REPO / "configs" / "default.yaml", options))
    engine = run.rollouts.engine
    for step in range(warmup):
        run.rollout(step, run.prompts.rows(step))
    parts = {"schedule": Timed(engine, "schedule"), "postprocess": Timed(engine, "postprocess")}
    parts["step"] = Timed(engine, "step")
    suffix = engine.drafters.get("suffix")
    if isinstance(suffix, SuffixDrafter):
        parts["suffix propose"] = Timed(suffix, "propose")
    for step in range(warmup, warmup + rollouts):
        run.rollout(step, run.prompts.rows(step))
    steps = len(parts["step"].seconds)

    def ms(name: str) -> str:
        part = parts.get(name)
        return f"{1e3 * statistics.median(part.seconds):.3f}" if part is not None and part.seconds else "-"

    host = sum(1e3 * statistics.median(p.seconds) for n, p in parts.items() if n != "step" and p.seconds)
    print(f"{rows} rows, {speculation}: {steps} steps, host {host:.2f} ms per step", flush=True)
    parts_ms = [ms(name) for name in ("schedule", "suffix propose", "postprocess")]
    return [rows, speculation, steps, *parts_ms, f"{host:.3f}", ms("step")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=3, help="rollouts timed per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="rollouts before timing (the suffix memory fills)")
    args = parser.parse_args()
    record = Record("bench_host_time")
    with tempfile.TemporaryDirectory() as tmp:
        table = [
            measure(rows, speculation, args.rollouts, args.warmup, Path(tmp))
            for rows in ROWS
            for speculation in SPECULATION
        ]
    record.table(
        "Host milliseconds per decoding step (medians over the steps of "
        f"{args.rollouts} rollouts): the parts a GPU would wait on, and the whole CPU step for scale",
        ["rows", "speculation", "steps", "schedule", "suffix propose", "postprocess", "host total", "CPU step"],
        table,
    )
    record.save()


if __name__ == "__main__":
    main()
