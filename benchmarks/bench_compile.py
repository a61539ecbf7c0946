"""What ``torch.compile`` (inductor, static shapes, a static KV cache) does to SmolLM2's one-token decode step on the
machine at hand, against the eager step of the same static-cache forward; by default and with inductor's
``freezing``, which folds the weights into the compiled graph as constants (prepacked for oneDNN on CPU).

Each mode runs in a fresh process (freezing is a process-wide inductor setting). Per row count: the median decode
step after a warm-up, the time of the first compiled calls (compilation), and whether the greedy tokens equal the
eager ones.

Usage::

    python benchmarks/bench_compile.py --rows 1,8 [--steps 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from record import Record
from transformers import StaticCache

from fastgrpo.models import load_model

CONTEXT = 100  # prompt tokens before the timed steps
CACHE_LEN = 384


def timed_steps(model, step, rows: int, steps: int) -> tuple[float, list[list[int]]]:
    """Median seconds of a decode step (after 4 warm-up steps) and the greedy tokens."""
    cache = StaticCache(config=model.config, max_cache_len=CACHE_LEN)
    ids = torch.randint(0, 1000, (rows, CONTEXT), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(CONTEXT), use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        times, tokens = [], []
        for i in range(steps):
            t0 = time.perf_counter()
            logits = step(tok, torch.tensor([CONTEXT + i]), cache)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
            tokens.append(tok)
    return statistics.median(times[4:] or times), torch.cat(tokens, 1).tolist()


def measure(mode: str, rows: int, steps: int) -> dict[str, float | bool]:
    """One mode at one row count, in this process."""
    import torch._inductor.config as inductor

    torch.set_num_threads(2)
    model = load_model("smollm2", "float32").eval()
    model.requires_grad_(False)

    def eager(tok, pos, cache):
        return model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

    inductor.freezing = mode == "freezing"
    compiled = torch.compile(eager, dynamic=False)
    eager_s, eager_tokens = timed_steps(model, eager, rows, steps)
    t0 = time.perf_counter()
    timed_steps(model, compiled, rows, 3)
    compile_s = time.perf_counter() - t0
    compiled_s, compiled_tokens = timed_steps(model, compiled, rows, steps)
    return {"eager": eager_s, "compiled": compiled_s, "compile": compile_s, "same": eager_tokens == compiled_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per measurement")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "ROWS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.steps)))
        return
    record = Record("bench_compile")
    table = []
    for mode in ("default", "freezing"):
        for rows in (int(r) for r in args.rows.split(",")):
            child = [sys.executable, __file__, "--child", mode, str(rows), "--steps", str(args.steps)]
            done = subprocess.run(child, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.splitlines()[-1])
            cells = [
                mode,
                rows,
                f"{1e3 * result['eager']:.1f}",
                f"{1e3 * result['compiled']:.1f}",
                f"{result['eager'] / result['compiled']:.2f}x",
                f"{result['compile']:.0f}",
                "yes" if result["same"] else "no",
            ]
            table.append(cells)
            print(" | ".join(map(str, cells)), flush=True)
    record.table(
        "SmolLM2-135M-Instruct decode step, float32, static KV cache, eager against torch.compile (inductor)",
        ["inductor mode", "rows", "eager ms", "compiled ms", "eager / compiled", "compile s", "same greedy tokens"],
        table,
    )
    record.save()


if __name__ == "__main__":
    main()
