"""Host time per decoding step: what the CPU does between a step's one read of the device and the next step's first
launch, where a GPU would idle. The default run's rollouts (`configs/default.yaml`: SmolLM2-135M-Instruct, 8
generations per prompt, up to 128 tokens at T=1) at 16 and 64 rows (2 and 8 prompts), with speculation off and with
static trees of the suffix drafter (the drafter that runs on the host), each rollout after ``--warmup`` rollouts that
fill the suffix memory. Per step, in milliseconds: the schedule (the controller's choice), the suffix drafter's
proposal (its search and tree, and the tree's copy to the device; the search and the trees, array operations over
all rows, as many a step at any row count, also apart), and the postprocess (the step's read, the
sequences' appends, the drafters' bookkeeping, finished rows dropped, the controller told). On a CPU the device work
is synchronous, so these are the host's own costs; the whole step's time is shown beside them for scale only (it is
a CPU's compute, not a GPU's).

A second table times the adaptive controller alone (`AdaptiveController.choose` and `observe`, CPU time per step)
at the same row counts over the default run's candidates of the ``eagle``, ``suffix`` and merged drafters, in the
regime a CPU never reaches: prices of a GPU-like synthetic profile (a forward costs the same up to 1,024 tokens) under
which trees win, with acceptance drawn from a fixed distribution; and beside it, one whose forwards cost their tokens,
under which plain steps win. Its figures are the controller's arithmetic, whatever the machine's speed.

    python benchmarks/bench_host_time.py [--rollouts 3] [--warmup 2] [--controller-steps 2000]
    python benchmarks/bench_host_time.py --rollouts 0  # the controller's table alone
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from record import REPO, Record

from fastgrpo.config import ControllerLimits
from fastgrpo.config.files import load_config
from fastgrpo.grpo.trainer import GRPOTrainer
from fastgrpo.rollout.drafter import Drafter
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.speculative.controller import AdaptiveController
from fastgrpo.speculative.eagle.drafter import EagleCost
from fastgrpo.speculative.merged import priced
from fastgrpo.speculative.profiler import LatencyProfile
from fastgrpo.speculative.suffix import drafter as suffix_drafter
from fastgrpo.speculative.suffix.drafter import SuffixDrafter

ROWS = (16, 64)
COLUMNS = ["rows", "speculation", "steps", "schedule", "suffix propose", "search", "trees", "postprocess"]
COLUMNS += ["host total", "CPU step"]
HOST = ("schedule", "suffix propose", "postprocess")  # the host's parts of a step (search and trees are in propose)
SPECULATION = {
    "off": ["--speculation.mode=off"],
    "suffix trees": ["--speculation.mode=static", "--speculation.drafter=suffix", "--speculation.nodes=8"],
}


class Timed:
    """Wraps ``owner.name`` so that each call's seconds are appended to ``seconds`` (`restore` unwraps it)."""

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
        self.restore = lambda: setattr(owner, name, inner)


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
    if isinstance(suffix, SuffixDrafter):  # the proposal, and the two array parts of it that every step pays in full
        parts["suffix propose"] = Timed(suffix, "propose")
        parts["search"], parts["trees"] = Timed(suffix_drafter, "search"), Timed(suffix_drafter, "draft_tree")
    try:
        for step in range(warmup, warmup + rollouts):
            run.rollout(step, run.prompts.rows(step))
    finally:
        for part in parts.values():
            part.restore()
    steps = len(parts["step"].seconds)

    def ms(name: str) -> str:
        part = parts.get(name)
        return f"{1e3 * statistics.median(part.seconds):.3f}" if part is not None and part.seconds else "-"

    host = sum(1e3 * statistics.median(parts[n].seconds) for n in HOST if n in parts and parts[n].seconds)
    print(f"{rows} rows, {speculation}: {steps} steps, host {host:.2f} ms per step", flush=True)
    parts_ms = [ms(name) for name in ("schedule", "suffix propose", "search", "trees", "postprocess")]
    return [rows, speculation, steps, *parts_ms, f"{host:.3f}", ms("step")]


class Priced(Drafter):
    """A drafter that only prices trees: EAGLE's levels from the profile's ``eagle`` curve, or a host drafter's
    microseconds per row (``per_row``)."""

    def __init__(self, name: str, profile: LatencyProfile, per_row: float | None = None):
        self.name, self.price, self.per_row = name, EagleCost(profile), per_row

    def cost(self, rows: int, shape: TreeShape, backlog: int = 1) -> float:
        return self.per_row * rows if self.per_row is not None else self.price(rows, shape, backlog)


def synthetic_profile(knee: int) -> LatencyProfile:
    """A 5 ms forward up to ``knee`` tokens and proportional past it; a draft level 0.3 ms up to 2,048 tokens."""
    tokens = [1 << i for i in range(13)]
    return LatencyProfile(
        "synthetic", "none", "bfloat16", 1024, tokens, [0.005 * max(1.0, t / knee) for t in tokens], knee,
        drafter_seconds={"eagle": [0.0003 * max(1.0, t / 2048) for t in tokens]},
    )  # fmt: skip


def controller_times(rows: int, trees_win: bool, steps: int) -> list[object]:
    """One row of the controller table: mean CPU microseconds of `choose` and of `observe` per step over ``steps``
    steps (after as many unmeasured), and the share of steps that ran a tree."""
    profile = synthetic_profile(1024 if trees_win else 1)
    drafters = [Priced("eagle", profile), Priced("suffix", profile, per_row=2e-6)]
    controller = AdaptiveController(profile, ControllerLimits(), drafters=priced(drafters))
    rng = random.Random(0)

    def rank(nodes: int) -> int:
        """A path node's score rank among the tree's nodes: mostly the best of its level's, sometimes any."""
        return rng.randrange(nodes) if rng.random() < 0.3 else 1

    draws: dict[TreeShape, list[tuple[list[int], list[list[int]]]]] = {}
    spent, trees = [0.0, 0.0], 0
    for step in range(2 * steps):
        t0 = time.process_time()
        shape = controller.choose(rows)
        t1 = time.process_time()
        accepted = path_rank = None
        seconds = 0.005
        if shape.speculative:
            levels = controller.levels(shape)
            if shape not in draws:  # drawn once per shape: the draws are not the controller's time
                draws[shape] = []
                for _ in range(16):
                    accepted = [min(levels, int(rng.expovariate(0.5))) for _ in range(rows)]
                    # as the engine reports them: the tree's size past each row's accepted nodes
                    ranks = [[rank(shape.nodes) if d < a else shape.nodes for d in range(levels)] for a in accepted]
                    draws[shape].append((accepted, np.array(ranks, dtype=np.int64)))
            accepted, path_rank = draws[shape][step % 16]
            seconds = 0.006
        t2 = time.process_time()
        controller.observe(rows, shape, seconds, accepted, path_rank)
        t3 = time.process_time()
        if step >= steps:
            spent[0] += t1 - t0
            spent[1] += t3 - t2
            trees += shape.speculative
    choose, observe = (1e6 * s / steps for s in spent)
    label = "trees win" if trees_win else "plain steps win"
    print(f"controller, {rows} rows, {label}: choose {choose:.0f} us, observe {observe:.0f} us", flush=True)
    return [rows, label, f"{trees / steps:.2f}", f"{choose:.0f}", f"{observe:.0f}", f"{choose + observe:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=3, help="rollouts timed per configuration (0: none)")
    parser.add_argument("--warmup", type=int, default=2, help="rollouts before timing (the suffix memory fills)")
    parser.add_argument("--controller-steps", type=int, default=2000, help="steps timed per controller row")
    args = parser.parse_args()
    record = Record("bench_host_time")
    record.table(
        f"The adaptive controller's CPU microseconds per step (means over {args.controller_steps} steps), synthetic "
        "prices and acceptance",
        ["rows", "prices", "tree share", "choose", "observe", "controller"],
        [controller_times(rows, win, args.controller_steps) for rows in ROWS for win in (True, False)],
    )
    if not args.rollouts:  # the controller's table alone
        record.save()
        return
    with tempfile.TemporaryDirectory() as tmp:
        table = [
            measure(rows, speculation, args.rollouts, args.warmup, Path(tmp))
            for rows in ROWS
            for speculation in SPECULATION
        ]
    record.table(
        "Host milliseconds per decoding step (medians over the steps of "
        f"{args.rollouts} rollouts): the parts a GPU would wait on, and the whole CPU step for scale",
        COLUMNS,
        table,
    )
    record.save()


if __name__ == "__main__":
    main()
