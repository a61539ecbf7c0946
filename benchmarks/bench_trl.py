"""TRL's GRPOTrainer with its own generation against TRL with fastgrpo's rollout_func (speculative rollouts and online
draft learning through `DraftCallback`), on SmolLM2-135M-Instruct and GSM8K train prompts, same config and seed.

Prints the time of every optimizer step of both runs and the ratio of their mean step times (the first step, which
warms caches and calibrates the controller, is reported apart).

    python benchmarks/bench_trl.py --steps 5 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import datasets  # noqa: E402
import trl  # noqa: E402
from record import Record
from transformers import TrainerCallback  # noqa: E402

from fastgrpo.config import (
    DraftTrainConfig,  # noqa: E402
    SpeculationConfig,  # noqa: E402
)
from fastgrpo.data import DataConfig, load_dataset  # noqa: E402
from fastgrpo.integrations.trl import DraftCallback, SpeculativeRollout  # noqa: E402
from fastgrpo.models import load_model, load_tokenizer, native_bf16  # noqa: E402
from fastgrpo.rewards import gsm8k_flexible  # noqa: E402

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step (rollout, rewards, update and callbacks)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.seconds.append(time.perf_counter() - self.start)


def run(args: argparse.Namespace, fast: bool) -> tuple[list[float], list[dict]]:
    torch.manual_seed(args.seed)
    rows = load_dataset(DataConfig(name="gsm8k", path=str(GSM8K), limit=args.steps * args.prompts_per_step))
    config = trl.GRPOConfig(
        output_dir=str(Path(args.output) / ("fastgrpo" if fast else "trl")),
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        num_generations=8,
        per_device_train_batch_size=8 * args.prompts_per_step,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=0.95,
        learning_rate=1e-6,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
        disable_tqdm=False,
    )
    timer = StepTimer()
    callbacks: list[TrainerCallback] = [timer]
    rollout = None
    if fast:
        spec = SpeculationConfig(mode=args.speculation, draft=args.draft)
        learning = DraftTrainConfig(token_loss_weight=1.0, bf16=native_bf16(torch.device("cpu")))
        rollout = SpeculativeRollout(speculation=spec, draft_training=learning)
        callbacks.append(DraftCallback(rollout))
    trainer = trl.GRPOTrainer(
        model=load_model("smollm2", dtype=args.dtype),
        reward_funcs=gsm8k_flexible,
        args=config,
        train_dataset=datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]),
        processing_class=load_tokenizer("smollm2"),
        rollout_func=rollout,
        callbacks=callbacks,
    )
    trainer.train()
    return timer.seconds, [e for e in trainer.state.log_history if "reward" in e]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts-per-step", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--speculation", default="adaptive", choices=["static", "paper", "adaptive"])
    parser.add_argument("--draft", default=None, help="a saved draft to start from (default: a fresh one)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="runs/bench_trl")
    args = parser.parse_args()
    if not GSM8K.is_file():
        raise SystemExit(f"{GSM8K} not found: the benchmark reads GSM8K train prompts from ../shared")
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is reported apart)")

    record = Record("bench_trl")
    results = {}
    for name, fast in (("TRL generation", False), ("TRL + fastgrpo rollout_func", True)):
        seconds, logs = run(args, fast)
        results[name] = seconds
        print(f"\n{name}: step times (s) " + ", ".join(f"{s:.1f}" for s in seconds))
        for e in logs:
            extra = f", accept length {e['spec/accept_length']:.2f}" if "spec/accept_length" in e else ""
            length = e["completions/mean_length"]
            print(f"  step {e['step']}: reward {e['reward']:.3f}, mean completion length {length:.0f}{extra}")

    base, fast = results.values()
    record.table(
        f"TRL GRPOTrainer step times, {args.prompts_per_step} prompt(s) x 8 generations, {args.max_new_tokens} new "
        f"tokens, {args.dtype}",
        ["run", "step 1 (s)", f"mean of steps 2..{args.steps} (s)", "step time ratio"],
        [
            [name, f"{seconds[0]:.1f}", f"{statistics.mean(seconds[1:]):.1f}"]
            + [f"{statistics.mean(base[1:]) / statistics.mean(seconds[1:]):.2f}x"]
            for name, seconds in results.items()
        ],
    )
    record.save()


if __name__ == "__main__":
    main()
