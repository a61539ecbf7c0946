"""Speculation never costs where it cannot pay: the default run's rollout (`configs/default.yaml`:
SmolLM2-135M-Instruct, 2 prompts x 8 generations, up to 128 tokens at T=1) with its default speculation (adaptive
over ``eagle+suffix``, a fresh draft learnt online) against speculation off, in one process.

Two `GRPOTrainer` instances of the same configuration, one with ``speculation.mode: off``, each roll out the same
training steps' prompts with the same uniforms (`fastgrpo.training_rollouts.step_uniforms`), so that they sample the
same completions but where a tree's forward rounds unlike a one-token one. The speculative trainer first rolls out
``--warmup`` steps and learns from them (its fresh draft is built after the first, as in training; its suffix memory
fills); the policy is never updated. Then in each of ``--rounds`` rounds both roll out the next step's prompts at
once, their decoding steps alternating (`TrainingRollouts.decoding`; each first in every other step) and each step
timed alone, so that the machine's drifts, which last seconds and move a rollout's time by several percent, fall on
both alike. Each rollout's time per completion token (prefill and steps) is compared within its round (the median of
the rounds' ratios) and over all rounds (their total time per token). The draft's learning after each round is not
timed. Both engines run the same linear routes (the speculative one's), so that only speculation differs.

    python benchmarks/bench_default_rollout.py --rounds 10 [-- --max_completion_length=64 ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from record import REPO, Record

from fastgrpo.config.files import load_config
from fastgrpo.grpo.trainer import GRPOTrainer
from fastgrpo.rollout.sequence import GenerationOutput


def trainer(config_path: Path, output_dir: Path, overrides: list[str]) -> GRPOTrainer:
    config = load_config(config_path, [f"--output_dir={output_dir}", "--progress_bar=false", *overrides])
    return GRPOTrainer(config)


def side_by_side(runs: list[GRPOTrainer], step: int) -> list[tuple[float, GenerationOutput]]:
    """Each trainer's rollout of ``step``'s prompts, decoded together, a step of each in turn (the first to step
    alternating): per trainer, the seconds of its prefill and steps, and its output."""
    seconds = [0.0] * len(runs)
    with ExitStack() as stack:
        calls = []
        for i, run in enumerate(runs):
            prompt_ids = run.prompts.encode(run.prompts.rows(step))
            t0 = time.perf_counter()
            calls.append(
                stack.enter_context(run.rollouts.decoding(prompt_ids, run.sampling, run.config.num_generations, step))
            )
            seconds[i] += time.perf_counter() - t0
        turn = 0
        while not all(call.done for call in calls):
            for i in range(len(runs)) if turn % 2 == 0 else reversed(range(len(runs))):
                if not calls[i].done:
                    t0 = time.perf_counter()
                    calls[i].step()
                    seconds[i] += time.perf_counter() - t0
            turn += 1
    return [(s, call.output()) for s, call in zip(seconds, calls, strict=True)]


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
        off.rollouts.engine.routes = spec.rollouts.engine.routes
        for step in range(args.warmup):
            spec.rollout(step, spec.prompts.rows(step))
            spec.rollouts.learn()
        off.rollout(0, off.prompts.rows(0))
        rows, ratios, totals = [], [], [0.0, 0, 0.0, 0]
        for r in range(args.rounds):
            step = args.warmup + r
            (plain_s, plain), (spec_s, speculative) = side_by_side([off, spec], step)
            spec.rollouts.learn()
            tokens = [sum(map(len, out.completion_ids)) for out in (plain, speculative)]
            totals = [sum(x) for x in zip(totals, (plain_s, tokens[0], spec_s, tokens[1]), strict=True)]
            ratios.append((spec_s / max(tokens[1], 1)) / (plain_s / max(tokens[0], 1)))
            accept = speculative.stats.accept_length
            rows.append(
                [step, f"{plain_s:.2f}", tokens[0], f"{spec_s:.2f}", tokens[1], f"{accept:.2f}", f"{ratios[-1]:.3f}"]
            )
            print(f"step {step}: off {plain_s:.2f} s, speculative {spec_s:.2f} s", flush=True)
    spread = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    summary = f"{statistics.median(ratios):.3f} (mean {statistics.mean(ratios):.3f}, sd {spread:.3f})"
    rows.append(["median", "", "", "", "", "", summary])
    overall = (totals[2] / max(totals[3], 1)) / (totals[0] / max(totals[1], 1))
    rows.append(["all rounds", f"{totals[0]:.2f}", totals[1], f"{totals[2]:.2f}", totals[3], "", f"{overall:.3f}"])
    record.table(
        f"The default run's rollout, {args.rounds} rounds decoded side by side after {args.warmup} speculative "
        "warm-up steps: speculative time per completion token over speculation off's",
        ["step", "off s", "off tokens", "spec s", "spec tokens", "verified per forward", "per-token ratio"],
        rows,
    )
    record.notes["per_token_ratios"] = ratios
    record.notes["all_rounds_ratio"] = overall
    record.save()


if __name__ == "__main__":
    main()
