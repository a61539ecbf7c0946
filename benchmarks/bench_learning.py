"""Speculation does not change learning: a task trained with speculation off and with the default adaptive
speculation, over several seeds each; per step the reward's mean and spread over the seeds, a two-sample permutation
test on each run's mean reward over the last five steps, and a plot. ``--compare entropy`` trains the same task with
the default options against two of TRL's entropy options: ``top_entropy_quantile: 0.2`` (only the highest-entropy
fifth of the tokens in the loss) and an entropy bonus (``entropy_coef``), each against the default. ``--compare
async`` trains it with two processes under torchrun (gloo) each time, as `bench_async.py` does: synchronous DDP
against one rollout process and one training process (``rollout_processes: 1``) at ``max_staleness`` 1 and 4.

Speculation is lossless, but a tree's forward rounds unlike a one-token one, so in float32 a speculative run and a
plain one part at the first sampled near-tie and then go their own ways: what must not change is how well the runs
learn, which the seeds' spread measures. ``--task default`` is `configs/default.yaml` (SmolLM2 on one-digit sums);
``--task gsm8k`` trains it on GSM8K's training rows from ``../shared/data/gsm8k`` (`gsm8k_strict` and
`format` rewards, 256 tokens).

    python benchmarks/bench_learning.py --seeds 0,1,2 [--task gsm8k] [--compare entropy|async] [-- --max_steps=12 ...]
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
from bench_async import SYNCHRONOUS, run  # noqa: E402
from record import REPO, Record  # noqa: E402

from fastgrpo.config.files import load_config  # noqa: E402
from fastgrpo.grpo.trainer import GRPOTrainer  # noqa: E402

# The runs compared, by what they compare: each arm's name and its options; the first arm is the baseline.
ARMS = {
    "speculation": {"off": ["--speculation.mode=off"], "adaptive": ["--speculation.mode=adaptive"]},
    "entropy": {
        "default": [],
        "top_entropy_quantile 0.2": ["--top_entropy_quantile=0.2"],
        "entropy_coef 0.01": ["--entropy_coef=0.01"],
    },
    "async": {
        "synchronous": SYNCHRONOUS,
        "max_staleness 1": ["--rollout_processes=1", "--max_staleness=1"],
        "max_staleness 4": ["--rollout_processes=1", "--max_staleness=4"],
    },
}
TWO_PROCESSES = {"async"}  # the comparisons whose runs are two-process torchrun jobs
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


def rewards(config: Path, task: str, seed: int, options: list[str], out: Path, processes: int = 1) -> list[float]:
    """The reward of every step of one training run (of two processes under torchrun with ``processes`` 2)."""
    if processes == 2:
        logged = run(out.name, [f"--config={config}", *TASKS[task], f"--seed={seed}", *options], None, out.parent)
        return [m["reward"] for m in logged]
    overrides = [*TASKS[task], f"--seed={seed}", f"--output_dir={out}"]
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


def plot(curves: dict[str, list[list[float]]], title: str, path: Path, label: str) -> None:
    """Each arm's mean reward per step, its seeds' range shaded; ``label`` names an arm in the legend."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, runs in curves.items():
        steps = range(1, len(runs[0]) + 1)
        ax.plot(steps, [statistics.mean(s) for s in zip(*runs, strict=True)], label=label.format(arm))
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
    parser.add_argument("--compare", choices=list(ARMS), default="speculation")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--plot", type=Path, help="where the plot goes (default: docs/learning_TASK[_COMPARE].png)")
    parser.add_argument("options", nargs="*", help="GRPOConfig options for every run, as --key=value")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.task == "gsm8k" and not GSM8K.is_file():
        parser.error(f"--task gsm8k reads {GSM8K}, which is not there")
    arms = ARMS[args.compare]
    suffix = "" if args.compare == "speculation" else f"_{args.compare}"
    record = Record(f"bench_learning_{args.task}{suffix}")
    curves: dict[str, list[list[float]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for index, (arm, options) in enumerate(arms.items()):
                out = Path(tmp) / f"arm{index}-seed{seed}"
                processes = 2 if args.compare in TWO_PROCESSES else 1
                run_options = [*options, *args.options]
                curves[arm].append(rewards(args.config, args.task, seed, run_options, out, processes))
                print(f"seed {seed}, {arm}: rewards {curves[arm][-1]}", flush=True)
    tails = {arm: [statistics.mean(run[-LAST:]) for run in runs] for arm, runs in curves.items()}
    rows = []
    for arm in arms:
        first = [run[0] for run in curves[arm]]
        spread = statistics.stdev(tails[arm]) if len(seeds) > 1 else 0.0
        rows.append(
            [
                arm,
                f"{statistics.mean(first):.3f}",
                f"{statistics.mean(tails[arm]):.3f} (sd {spread:.3f})",
                ", ".join(f"{t:.3f}" for t in tails[arm]),
            ]
        )
    # Per run (exact, but 3 seeds a side cannot go below p = 0.1) and per step of the last five (more values, though
    # a run's steps are not independent).
    base, *others = arms
    last = {arm: [r for run in runs for r in run[-LAST:]] for arm, runs in curves.items()}
    tests = {}
    for arm in others:
        p, p_steps = permutation_p(tails[base], tails[arm]), permutation_p(last[base], last[arm])
        tests[arm] = {"runs": p, "steps": p_steps}
        difference = statistics.mean(tails[arm]) - statistics.mean(tails[base])
        line = f"permutation test p = {p:.2f} over runs, {p_steps:.2f} over the last {LAST} steps' rewards"
        rows.append([f"{arm} - {base}", "", f"{difference:+.3f}", line])
    steps = len(curves[base][0])
    what = "speculation off and adaptive" if args.compare == "speculation" else ", ".join(arms)
    record.table(
        f"Learning on the {args.task} task with {what}, seeds {args.seeds}, {steps} steps: the reward at step 1 and "
        f"the mean reward over the last {LAST} steps (mean over seeds)",
        [args.compare, "step 1", f"last {LAST} steps", f"each seed's last {LAST}"],
        rows,
    )
    record.notes.update(compare=args.compare, arms=arms, rewards=curves, last_five=tails, permutation_p=tests)
    path = args.plot or REPO / "docs" / f"learning_{args.task}{suffix}.png"
    label = "speculation {}" if args.compare == "speculation" else "{}"
    plot(curves, f"{args.task} task: reward per step, mean and range over seeds {args.seeds}", path, label)
    print(f"plot: {path}")
    record.save()


if __name__ == "__main__":
    main()
