"""How the rollout engine's plain decoding step slows down when another busy process shares the cores, with torch's
threads fixed at the core count, fixed at one, or following the free cores (`fastgrpo.threads.ThreadGovernor`,
what ``cpu_threads: 0`` runs in training).

Competitors, each a separate process started before the timed steps and stopped after them: none; a single-threaded
Python loop (one core kept busy, like a tokenizer or a test runner); and torch multiplying 1024 x 1024 matrices on as
many threads as there are cores (another training or inference job). Per competitor and policy: the median plain
decoding step (T=1, no row ends early) at each row count, after a short warm-up generation in which an adaptive
governor can settle, and the thread count the step ran with at the end.

Usage::

    python benchmarks/bench_threads.py [--rows 1,8] [--tokens 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
from record import Record

from fastgrpo.models import load_model
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.threads import WINDOW_S, ThreadGovernor

COMPETITORS = {
    "none": None,
    "one busy Python thread": "while True: pass",
    "torch matmuls on every core": ("import torch\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a"),
}
CONTEXT = 128  # prompt tokens per row


def step_ms(engine: RolloutEngine, rows: int, tokens: int) -> float:
    """Median milliseconds of a plain decoding step over ``rows`` rows, after a short warm-up generation."""
    prompts = torch.randint(0, 1000, (rows, CONTEXT), generator=torch.Generator().manual_seed(rows)).tolist()
    engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0))
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0)
    stats = engine.generate(prompts, params, generator=torch.Generator().manual_seed(0)).stats
    return 1e3 * statistics.median(stats.step_times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--tokens", type=int, default=12, help="decoding steps timed per row count")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if min(rows) < 1 or args.tokens < 2:
        raise SystemExit("--rows must be >= 1 and --tokens >= 2")
    cores = torch.get_num_threads()
    record = Record("bench_threads")
    start = time.perf_counter()
    model = load_model("smollm2").eval()
    model.requires_grad_(False)
    engine = RolloutEngine(model, eos_token_ids=[])
    engine.eos = torch.empty(0, dtype=torch.long)  # no token ends a row: the concurrency stays as given
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))  # one-off costs
    policies = {f"{cores} threads": (cores, False), "1 thread": (1, False), "adaptive": (cores, True)}
    table, alone = [], {}
    for competitor, code in COMPETITORS.items():
        env = {**os.environ, "OMP_NUM_THREADS": str(cores)}
        process = subprocess.Popen([sys.executable, "-c", code], env=env) if code else None
        try:
            time.sleep(1.0)  # the competitor is up and busy
            for policy, (threads, adapt) in policies.items():
                governor = ThreadGovernor(threads, adapt=adapt)
                engine.threads = governor if adapt else None
                cells = []
                with governor, torch.inference_mode():
                    # Decode past one window, so that the governor has measured the cores by the first timed step.
                    settled = time.monotonic() + WINDOW_S
                    while adapt and time.monotonic() <= settled:
                        engine.generate([[1, 2]], SamplingParams(max_new_tokens=4))
                    for b in rows:
                        ms = step_ms(engine, b, args.tokens)
                        if code is None:
                            alone[(policy, b)] = ms
                        base = alone[(f"{cores} threads", b)]
                        cells += [f"{ms:.0f}", f"{ms / base:.1f}x"]
                    cells.append(governor.threads)
                table.append([competitor, policy, *cells])
                print(table[-1], flush=True)
        finally:
            engine.threads = None
            if process is not None:
                process.kill()
                process.wait()
    header = ["competitor", "threads"]
    for b in rows:
        header += [f"{b} rows: ms per step", f"{b} rows: against alone, {cores} threads"]
    record.table(
        f"The engine's plain decoding step ({CONTEXT}-token prompts, T=1) beside another busy process, {cores} cores",
        [*header, "threads at the end"],
        table,
    )
    record.notes.update(tokens=args.tokens, window_s=WINDOW_S)
    record.save()
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
