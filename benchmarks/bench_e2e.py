"""End to end: plain GRPO against FastGRPO on SmolLM2-135M-Instruct and GSM8K train prompts, in one invocation with the
same seed, data and hyperparameters:

(a) plain GRPO, autoregressive rollouts;
(b) FastGRPO, adaptive speculation with a frozen offline-trained draft;
(c) FastGRPO, adaptive speculation with online draft learning from scratch (a random draft, with a reduced vocabulary
    of the first rollout's most frequent tokens: ``--scratch-vocab``, 0 for the full one);
(d) FastGRPO, adaptive speculation with online draft learning from the offline-trained draft.

Prints total and per-phase wall time, end-to-end and rollout-phase speedups over (a), accepted length (over all
decoding steps, and over tree steps only with the number of steps whose rollout ran a tree in brackets) and the online
draft's held-out accuracy (``draft/accuracy``) over the first and last five steps, the draft-learning share of step
time and the reward of the last steps, and writes overlaid plots (``fastgrpo report``).

    python benchmarks/bench_e2e.py --draft drafts/smollm2-gsm8k-v8192 --steps 20 --output runs/bench_e2e

``--dtype bfloat16`` loads the policy (and so the draft) in bfloat16: the rollouts run where a CPU with bfloat16
units verifies a tree for little more than one token, and the updates write bfloat16 weights directly (no float32
master copy, so an update much smaller than a weight rounds away).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch
from record import Record

from fastgrpo.config import DraftTrainConfig, GRPOConfig, SpeculationConfig
from fastgrpo.data import DataConfig
from fastgrpo.grpo.trainer import GRPOTrainer
from fastgrpo.models import native_bf16
from fastgrpo.report import phase_seconds, plot_runs, read_metrics

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
BF16 = native_bf16(torch.device("cpu"))  # autocast pays only where the CPU has bf16 units
NUM_GENERATIONS = 8
LABELS = {"a": "(a) plain", "b": "(b) frozen draft", "c": "(c) online, scratch", "d": "(d) online, offline draft"}


def config_for(args, run: str) -> GRPOConfig:
    """The shared hyperparameters; only speculation and draft learning differ between runs."""
    spec = {
        "a": SpeculationConfig(mode="off"),
        "b": SpeculationConfig(mode="adaptive", draft=args.draft),
        "c": SpeculationConfig(mode="adaptive", draft_vocab_size=args.scratch_vocab or None),
        "d": SpeculationConfig(mode="adaptive", draft=args.draft),
    }[run]
    draft_training = (
        DraftTrainConfig(  # run a drafts nothing: the defaults (set options are refused there)
            online=run in ("c", "d"),
            learning_rate=args.draft_lr,
            token_loss_weight=1.0,
            token_budget=args.draft_token_budget,
            epochs=1,
            bf16=BF16,
        )
        if run != "a"
        else DraftTrainConfig()
    )
    return GRPOConfig(
        model="smollm2",
        dtype=args.dtype,
        dataset=DataConfig(name="gsm8k", path=str(GSM8K / "train.jsonl")),
        reward_funcs=["accuracy"],
        num_generations=NUM_GENERATIONS,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=args.prompts_per_step,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=0.95,
        learning_rate=1e-5,
        bf16=BF16,
        max_steps=args.steps,
        save_steps=args.steps,
        logging_steps=1,
        gradient_checkpointing=False,
        output_dir=str(Path(args.output) / run),
        speculation=spec,
        draft_training=draft_training,
        log_completions=False,
        seed=0,
    )


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def tree_accept_length(rows: list[dict[str, float]]) -> list[str]:
    """Accepted length on tree steps (``spec/tree_accept_length``) over the first and last five steps: the mean of the
    steps that ran a tree, a dash where none did. Unlike ``spec/accept_length`` it does not count plain steps as 1.00,
    so it follows the draft rather than how often the controller chose a tree."""

    def window(part: list[dict[str, float]]) -> str:
        values = [
            r["spec/tree_accept_length"] for r in part if not math.isnan(r.get("spec/tree_accept_length", math.nan))
        ]
        return f"{mean(values):.2f} ({len(values)})" if values else "–"

    return [window(rows[:5]), window(rows[-5:])]


def draft_accuracy(rows: list[dict[str, float]]) -> list[str]:
    """Held-out draft accuracy over the first and last five steps, or a dash for a run without draft learning."""
    if "draft/accuracy" not in rows[0]:
        return ["–", "–"]
    return [f"{mean([r['draft/accuracy'] for r in part]):.3f}" for part in (rows[:5], rows[-5:])]


def summarise(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace, record: Record) -> None:
    """Record the comparison table, the reward comparison with (a) and the rollout share of a plain step."""
    base = runs.get(LABELS["a"])
    table = []
    for name, rows in runs.items():
        total = sum(r["time/step"] for r in rows)
        rollout = sum(r["time/rollout"] for r in rows)
        phases = phase_seconds(rows)
        e2e = sum(r["time/step"] for r in base) / total if base else float("nan")
        roll = sum(r["time/rollout"] for r in base) / rollout if base else float("nan")
        share = sum(r.get("draft/time", 0.0) for r in rows) / total
        tokens = sum(r["completions/mean_length"] for r in rows) * args.prompts_per_step * NUM_GENERATIONS
        table.append(
            [
                name,
                f"{total:.0f}",
                f"{rollout:.0f}",
                f"{tokens / rollout:.1f}",
                f"{phases['draft update'] * len(rows):.0f}",
            ]
            + [f"{phases['policy update'] * len(rows):.0f}", f"{e2e:.2f}x", f"{roll:.2f}x"]
            + [f"{mean([r['spec/accept_length'] for r in rows[:5]]):.2f}"]
            + [f"{mean([r['spec/accept_length'] for r in rows[-5:]]):.2f}", *tree_accept_length(rows)]
            + [*draft_accuracy(rows), f"{100 * share:.1f} %", f"{mean([r['reward'] for r in rows[-5:]]):.3f}"]
        )
    record.table(
        f"SmolLM2-135M-Instruct, GSM8K train, {args.prompts_per_step} prompt(s) x {NUM_GENERATIONS} generations per "
        f"step, T=1, top-p 0.95, max {args.max_new_tokens} new tokens, {args.steps} steps, {args.dtype} weights, "
        f"{torch.get_num_threads()} threads",
        ["run", "total s", "rollout s", "rollout tok/s", "draft s", "update s", "end-to-end speedup"]
        + ["rollout speedup", "accepted first 5", "accepted last 5", "tree steps' accepted first 5"]
        + ["tree steps' accepted last 5", "draft accuracy first 5", "draft accuracy last 5", "draft share of step"]
        + ["reward last 5"],
        table,
    )
    if base:
        record.notes["reward per step (a)"] = [round(r["reward"], 3) for r in base]
        for name, rows in runs.items():
            if rows is not base:
                same = sum(a["reward"] == b["reward"] for a, b in zip(rows, base, strict=False))
                diffs = [a["reward"] - b["reward"] for a, b in zip(rows, base, strict=False)]
                record.notes[f"{name}: same reward as (a)"] = (
                    f"{same}/{len(rows)} steps, mean difference {mean(diffs):+.4f}"
                )
        share = statistics.mean(r["time/rollout"] / r["time/step"] for r in base)
        record.notes["rollout share of step time in (a)"] = f"{100 * share:.0f} %"
    for key, value in record.notes.items():
        print(f"{key}: {value}")


def _train(args: argparse.Namespace, run: str) -> None:
    torch.set_num_threads(os.cpu_count())
    GRPOTrainer(config_for(args, run)).train()


def train_in_fresh_process(args: argparse.Namespace, run: str) -> list[dict[str, float]]:
    """Train one run in a new process and read back its metrics: in one process the later runs were measurably
    slower than the same run alone."""
    proc = mp.get_context("spawn").Process(target=_train, args=(args, run))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise SystemExit(f"run {LABELS[run]} failed (exit code {proc.exitcode})")
    return read_metrics(Path(args.output) / run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="drafts/smollm2-gsm8k-v8192")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts-per-step", type=int, default=1)
    parser.add_argument("--draft-lr", type=float, default=3e-4)
    parser.add_argument(
        "--draft-token-budget", type=int, default=512, help="tokens per draft update (draft_training.token_budget)"
    )
    parser.add_argument("--scratch-vocab", type=int, default=8192, help="draft vocabulary of run (c); 0: full")
    parser.add_argument("--runs", default="a,b,c,d")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--output", default="runs/bench_e2e")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the policy's weights (bfloat16: rollouts and updates in bfloat16, no float32 master copy)",
    )
    parser.add_argument(
        "--summarise-only", action="store_true", help="print the tables and plots of the runs already in --output"
    )
    args = parser.parse_args()
    if not args.summarise_only and not Path(args.draft).is_dir():
        raise SystemExit(f"no draft in {args.draft}: train one first with python benchmarks/train_drafts.py")
    torch.set_num_threads(os.cpu_count())
    start = time.perf_counter()
    runs: dict[str, list[dict[str, float]]] = {}
    for run in args.runs.split(","):
        if args.summarise_only:
            runs[LABELS[run]] = read_metrics(Path(args.output) / run)
            continue
        print(f"\n== {LABELS[run]} ==", flush=True)
        runs[LABELS[run]] = train_in_fresh_process(args, run)

    record = Record("bench_e2e")
    summarise(runs, args, record)
    paths = plot_runs(runs, Path(args.output) / "report")
    record.notes["plots"] = [str(p) for p in paths]
    print("\nplots: " + ", ".join(map(str, paths)))
    record.save()
    if not args.summarise_only:
        print(f"total wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
