"""What compiled rollouts compile, call by call: a tiny random Llama decoding 64 rows (2 prompts of 90 to 400 tokens x
32) that end on frequent EOS tokens at every step, compiled with ``aot_eager`` (the graphs inductor would compile,
without generating code), plain and with EAGLE and suffix trees chosen adaptively. Per call: the graphs compiled
(settling before the first step included), the steps that compiled or met a new shape (`compile/cold_steps`), the
steps and tree steps, and the shape menu the engine settles (`fastgrpo.rollout.shape_menu`). Counts, not times.

Usage::

    python benchmarks/bench_shapes.py [--calls 5] [--n-max 8]
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
ROWS, LONGEST = 64, 400
PARAMS = SamplingParams(max_new_tokens=128, temperature=1.0)


def engine(speculation: str, n_max: int) -> RolloutEngine:
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
    built.reserve(ROWS, LONGEST + PARAMS.max_new_tokens + 1)
    return built


def calls(speculation: str, count: int, n_max: int) -> tuple[list[list[object]], str]:
    """One table row per call, and the engine's shape menu."""
    built, rng, rows = engine(speculation, n_max), random.Random(0), []
    for i in range(count):
        prompts = [[rng.randrange(2, 128) for _ in range(rng.randrange(90, LONGEST))] for _ in range(2)]
        stats = built.generate(prompts, PARAMS, ROWS // 2, generator=torch.Generator().manual_seed(i)).stats
        cells = [speculation, i + 1, stats.compile_graphs, stats.cold_steps, len(stats.concurrency)]
        rows.append([*cells, len(stats.tree_nodes), min(stats.concurrency)])
        print(" | ".join(map(str, rows[-1])), flush=True)
    return rows, menu_of(built).describe()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--n-max", type=int, default=8, help="the adaptive controller's largest tree")
    args = parser.parse_args()
    record, table = Record("bench_shapes"), []
    for speculation in ("plain", "adaptive"):
        rows, menu = calls(speculation, args.calls, args.n_max)
        table += rows
        record.notes.setdefault("menus", {})[speculation] = menu
        print(menu, flush=True)
    columns = ["decoding", "call", "graphs compiled", "cold steps", "steps", "tree steps", "fewest rows"]
    record.table("Compiled rollouts (aot_eager) of 64 rows ending on EOS, call by call", columns, table)
    record.save()


if __name__ == "__main__":
    main()
