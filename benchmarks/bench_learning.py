"""Speculation does not change learning: a task trained with speculation off and with the default adaptive
speculation, over several seeds each; per step the reward's mean and spread over the seeds, a two-sample permutation
test on each run's mean reward over the last five steps, and a plot.

Speculation is lossless, but a tree's forward rounds unlike a one-token one, so in float32 a speculative run and a
plain one part at the first sampled near-tie and then go their own ways: what must not change is how well the runs
learn, which the seeds' spread measures. ``--task default`` is `configs/default.yaml` (SmolLM2 on one-digit sums);
``--task gsm8k`` trains it on GSM8K's training rows from ``../shared/data/gsm8k`` (`gsm8k_strict` and
`format` rewards, 256 tokens).

    python benchmarks/bench_learning.py --seeds 0,1,2 [--task gsm8k] [-- --max_steps=12 ...]
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from record import REPO, Record  # noqa: E402

from fastgrpo.config.files import load_config  # noqa: E402
from fastgrpo.grpo.trainer import GRPOTrainer  # noqa: E402

MODES = ("off", "adaptive")
LAST = 5  # steps whose rewards are compared
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
TASKS = {
    "default": [],
    "gsm8k": [
        "--dataset.name=gsm8k",
        f"--dataset.path={GSM8K}",
        "--reward_funcs=[gsm8k_strict, format]",
        "--reward_weights=[1.0, 0.2]",
        "--max_completion_length=256",
    ],
}


def rewards(config: Path, task: str, mode: str, seed: int, options: list[str], out: Path) -> list[float]:
    """The reward of every step of one training run."""
    overrides = [*TASKS[task], f"--seed={seed}", f"--speculation.mode={mode}", f"--output_dir={out}"]
    overrides += ["--progress_bar=false", "--log_completions=false", "--save_total_limit=1", *options]
    history = GRPOTrainer(load_config(config, overrides)).train()
    return [m["reward"] for m in history]


def permutation_p(a: list[float], b: list[float], draws: int = 20000) -> float:
    """Two-sided p-value of the difference of means of ``a`` and ``b``: the share of splits of the pooled values into
    groups of their sizes whose means differ at least as much; every split where there are at most ``draws`` of
    them, else ``draws`` random ones (seeded)."""
    pooled, observed = a + b, abs(statistics.mean(a) - statistics.mean(b))
    n = len(pooled)
    if math.comb(n, len(a)) <= draws:
        splits = [set(c) for c in itertools.combinations(range(n), len(a))]
    else:
        rng = random.Random(0)
        splits = [set(rng.sample(range(n), len(a))) for _ in range(draws)]
    extreme = 0
    for chosen in splits:
        x = [pooled[i] for i in chosen]
        y = [pooled[i] for i in range(n) if i not in chosen]
        extreme += abs(statistics.mean(x) - statistics.mean(y)) >= observed - 1e-12
    return extreme / len(splits)


def plot(curves: dict[str, list[list[float]]], title: str, path: Path) -> None:
    """Each mode's mean reward per step, its seeds' range shaded."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, runs in curves.items():
        steps = range(1, len(runs[0]) + 1)
        ax.plot(steps, [statistics.mean(s) for s in zip(*runs, strict=True)], label=f"speculation {mode}")
        low = [min(s) for s in zip(*runs, strict=True)]
        high = [max(s) for s in zip(*runs, strict=True)]
        ax.fill_between(steps, low, high, alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "default.yaml")
    parser.add_argument("--task", choices=list(TASKS), default="default")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--plot", type=Path, help="where the plot goes (default: docs/learning_TASK.png)")
    parser.add_argument("options", nargs="*", help="GRPOConfig options for every run, as --key=value")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.task == "gsm8k" and not GSM8K.is_file():
        parser.error(f"--task gsm8k reads {GSM8K}, which is not there")
    record = Record(f"bench_learning_{args.task}")
    curves: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for mode in MODES:
                curves[mode].append(
                    rewards(args.config, args.task, mode, seed, args.options, Path(tmp) / f"{mode}{seed}")
                )
                print(f"seed {seed}, speculation {mode}: rewards {curves[mode][-1]}", flush=True)
    tails = {mode: [statistics.mean(run[-LAST:]) for run in runs] for mode, runs in curves.items()}
    rows = []
    for mode in MODES:
        first = [run[0] for run in curves[mode]]
        spread = statistics.stdev(tails[mode]) if len(seeds) > 1 else 0.0
        rows.append(
            [
                mode,
                f"{statistics.mean(first):.3f}",
                f"{statistics.mean(tails[mode]):.3f} (sd {spread:.3f})",
                ", ".join(f"{t:.3f}" for t in tails[mode]),
            ]
        )
    # Per run (exact, but 3 seeds a side cannot go below p = 0.1) and per step of the last five (more values, though
    # a run's steps are not independent).
    p = permutation_p(tails["off"], tails["adaptive"])
    last = {mode: [r for run in runs for r in run[-LAST:]] for mode, runs in curves.items()}
    p_steps = permutation_p(last["off"], last["adaptive"])
    difference = statistics.mean(tails["adaptive"]) - statistics.mean(tails["off"])
    tests = f"permutation test p = {p:.2f} over runs, {p_steps:.2f} over the last {LAST} steps' rewards"
    rows.append(["adaptive - off", "", f"{difference:+.3f}", tests])
    steps = len(curves["off"][0])
    record.table(
        f"Learning on the {args.task} task with speculation off and adaptive, seeds {args.seeds}, {steps} steps: the "
        f"reward at step 1 and the mean reward over the last {LAST} steps (mean over seeds)",
        ["speculation", "step 1", f"last {LAST} steps", f"each seed's last {LAST}"],
        rows,
    )
    record.notes.update(rewards=curves, last_five=tails, permutation_p=p, permutation_p_steps=p_steps)
    path = args.plot or REPO / "docs" / f"learning_{args.task}.png"
    plot(curves, f"{args.task} task: reward per step, mean and range over seeds {args.seeds}", path)
    print(f"plot: {path}")
    record.save()


if __name__ == "__main__":
    main()
