"""What compiled rollouts compile and record, call by call: a tiny random Llama decoding ``--rows`` rows (2 prompts of
up to ``--prompt-tokens`` tokens, ``--new-tokens`` new ones at T=1) that end on frequent EOS tokens at every step,
compiled with ``aot_eager`` (the graphs inductor would compile, without generating code), plain and with EAGLE and
suffix trees chosen adaptively (the default ``n_max`` 64), then one greedy evaluation call. Per call: the graphs
compiled and the shapes met (on a GPU, each a CUDA graph recorded), settling before the first step included, and
the steps that compiled or met a new shape after it (`compile/cold_steps`). Then the start-up a GPU run would pay
before its first step: the counted graphs and shapes at assumed seconds each (``--compile-seconds``,
``--record-seconds``: assumptions, not measurements). Counts, not times.

Usage::

    python benchmarks/bench_shapes.py [--calls 5] [--rows 64] [--prompt-tokens 512] [--new-tokens 1024]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
from record import Record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_tiny_model  # noqa: E402
from test_controller import flat_profile  # noqa: E402

from fastgrpo.config import ControllerLimits  # noqa: E402
from fastgrpo.rollout.engine import RolloutEngine  # noqa: E402
from fastgrpo.rollout.shape_menu import menu_of  # noqa: E402
from fastgrpo.sampling_params import SamplingParams  # noqa: E402
from fastgrpo.speculative.controller import AdaptiveController  # noqa: E402
from fastgrpo.speculative.eagle.drafter import EagleDrafter  # noqa: E402
from fastgrpo.speculative.eagle.head import DraftHead  # noqa: E402
from fastgrpo.speculative.merged import priced  # noqa: E402
from fastgrpo.speculative.suffix.drafter import SuffixDrafter  # noqa: E402

EOS = [19, 60, 52]  # tokens the tiny Llama samples often


def engine(speculation: str, n_max: int, rows: int, length: int) -> RolloutEngine:
    """A compiled (aot_eager) engine over a fresh tiny Llama, plain or with EAGLE and suffix trees."""
    torch._dynamo.reset()
    model = make_tiny_model("llama")
    drafters, controller = None, None
    if speculation == "adaptive":
        torch.manual_seed(0)
        drafters = [EagleDrafter(DraftHead(model.config).double(), model, "aot_eager"), SuffixDrafter()]
        limits = ControllerLimits(n_max=n_max)
        controller = AdaptiveController(flat_profile(), limits, drafters=priced(drafters), probe_interval=2)
    built = RolloutEngine(model, EOS, drafter=drafters, controller=controller, backend="aot_eager")
    built.reserve(rows, length)
    return built


def calls(speculation: str, args: argparse.Namespace) -> tuple[list[list[object]], str]:
    """One table row per call (the sampled calls, then a greedy one), and the engine's shape menu."""
    built = engine(speculation, args.n_max, args.rows, args.prompt_tokens + args.new_tokens + 1)
    rng, table = random.Random(0), []
    for i in range(args.calls + 1):
        greedy = i == args.calls
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0 if greedy else 1.0)
        longest = args.prompt_tokens
        prompts = [[rng.randrange(2, 128) for _ in range(rng.randrange(longest // 4, longest))] for _ in range(2)]
        stats = built.generate(prompts, params, args.rows // 2, generator=torch.Generator().manual_seed(i)).stats
        call = "greedy" if greedy else i + 1
        cells = [speculation, call, stats.compile_graphs, stats.compile_shapes, stats.cold_steps]
        table.append([*cells, len(stats.concurrency), len(stats.tree_nodes), min(stats.concurrency)])
        print(" | ".join(map(str, table[-1])), flush=True)
    return table, menu_of(built).describe()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5, help="sampled calls, before the greedy one")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=512, help="the longest prompt")
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--n-max", type=int, default=64, help="the adaptive controller's largest tree")
    parser.add_argument("--compile-seconds", type=float, default=40.0, help="assumed seconds per inductor graph")
    parser.add_argument("--record-seconds", type=float, default=0.5, help="assumed seconds per CUDA graph")
    args = parser.parse_args()
    record, table, startup = Record("bench_shapes"), [], []
    for speculation in ("plain", "adaptive"):
        rows, menu = calls(speculation, args)
        table += rows
        record.notes.setdefault("menus", {})[speculation] = menu
        print(menu, flush=True)
        first = rows[0]
        seconds = first[2] * args.compile_seconds + first[3] * args.record_seconds
        startup.append([speculation, first[2], first[3], f"{seconds:.0f}"])
    columns = ["decoding", "call", "graphs compiled", "shapes met", "cold steps", "steps", "tree steps", "fewest rows"]
    title = f"Compiled rollouts (aot_eager) of {args.rows} rows, prompts up to {args.prompt_tokens} + {args.new_tokens}"
    record.table(title, columns, table)
    assumed = f"{args.compile_seconds:g} s a graph, {args.record_seconds:g} s a shape (assumed)"
    columns = ["decoding", "graphs", "shapes", f"start-up estimate, s ({assumed})"]
    record.table("Before the first step", columns, startup)
    record.save()


if __name__ == "__main__":
    main()
