"""Speculation never costs where it cannot pay: the default run's rollout (`configs/default.yaml`:
SmolLM2-135M-Instruct, 2 prompts x 8 generations, up to 128 tokens at T=1) with its default speculation (adaptive
over ``eagle+suffix``, a fresh draft learnt online) against speculation off, in one process.

Two `GRPOTrainer` instances of the same configuration, one with ``speculation.mode: off``, each roll out the same
training steps' prompts with the same uniforms (`fastgrpo.training_rollouts.step_uniforms`), so that they sample the
same completions but where a tree's forward rounds unlike a one-token one. The speculative trainer first rolls out
``--warmup`` steps and learns from them (its fresh draft is built after the first, as in training; its suffix memory
fills); the policy is never updated. Then ``--rounds`` rounds alternate the two, each round on the next step's
prompts, and each rollout's time per completion token is compared within its round. Only the rollouts are timed (the
draft's learning after each speculative one is not).

    python benchmarks/bench_default_rollout.py --rounds 10 [-- --max_completion_length=64 ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from record import REPO, Record

from fastgrpo.config.files import load_config
from fastgrpo.grpo.trainer import GRPOTrainer


def trainer(config_path: Path, output_dir: Path, overrides: list[str]) -> GRPOTrainer:
    config = load_config(config_path, [f"--output_dir={output_dir}", "--progress_bar=false", *overrides])
    return GRPOTrainer(config)


def rollout(run: GRPOTrainer, step: int) -> tuple[float, int, float]:
    """Seconds of one rollout of ``step``'s prompts, the completion tokens it sampled and its mean verified tokens per
    row per forward."""
    rows = run.prompts.rows(step)
    t0 = time.perf_counter()
    _, out = run.rollout(step, rows)
    seconds = time.perf_counter() - t0
    return seconds, sum(map(len, out.completion_ids)), out.stats.accept_length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "default.yaml")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="speculative rollouts learnt from before timing")
    parser.add_argument("options", nargs="*", help="GRPOConfig options for both trainers, as --key=value")
    args = parser.parse_args()
    record = Record("bench_default_rollout")
    with tempfile.TemporaryDirectory() as tmp:
        off = trainer(args.config, Path(tmp) / "off", [*args.options, "--speculation.mode=off"])
        spec = trainer(args.config, Path(tmp) / "spec", args.options)
        for step in range(args.warmup):
            rollout(spec, step)
            spec.rollouts.learn()
        rollout(off, 0)  # its first call measures the linear routes
        rows, ratios = [], []
        for r in range(args.rounds):
            step = args.warmup + r
            plain = rollout(off, step)
            speculative = rollout(spec, step)
            spec.rollouts.learn()
            per_token = [seconds / max(tokens, 1) for seconds, tokens, _ in (plain, speculative)]
            ratios.append(per_token[1] / per_token[0])
            rows.append(
                [step, f"{plain[0]:.2f}", plain[1], f"{speculative[0]:.2f}", speculative[1], f"{speculative[2]:.2f}"]
                + [f"{ratios[-1]:.3f}"]
            )
            print(f"step {step}: off {plain[0]:.2f} s, speculative {speculative[0]:.2f} s", flush=True)
    spread = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    summary = f"{statistics.median(ratios):.3f} (mean {statistics.mean(ratios):.3f}, sd {spread:.3f})"
    rows.append(["median", "", "", "", "", "", summary])
    record.table(
        f"The default run's rollout, {args.rounds} rounds alternated after {args.warmup} speculative warm-up steps: "
        "speculative time per completion token over speculation off's",
        ["step", "off s", "off tokens", "spec s", "spec tokens", "verified per forward", "per-token ratio"],
        rows,
    )
    record.notes["per_token_ratios"] = ratios
    record.save()


if __name__ == "__main__":
    main()
