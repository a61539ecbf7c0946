"""TRL's GRPOTrainer with its own generation, TRL with fastgrpo's rollout_func (speculative rollouts and online
draft learning through `DraftCallback`), and fastgrpo's own `GRPOTrainer`, on SmolLM2-135M-Instruct and the same
GSM8K train prompts, with the same options (TRL's defaults where fastgrpo's differ: linear learning-rate decay) and
seed.

Prints the time of every optimizer step of each run, the ratio of their mean step times and their time per completion
token (the first step, which warms caches and calibrates the controller, is reported apart). The runs sample
different completions (each draws its own noise, and the prompts come in a different order), so their completion
lengths differ: the time per completion token is the fairer comparison.

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

from fastgrpo.config import (  # noqa: E402
    DraftTrainConfig,
    GRPOConfig,
    SpeculationConfig,
)
from fastgrpo.data import DataConfig, load_dataset  # noqa: E402
from fastgrpo.grpo.trainer import GRPOTrainer  # noqa: E402
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


def data(args: argparse.Namespace) -> DataConfig:
    """The GSM8K train rows every run trains on."""
    return DataConfig(name="gsm8k", path=str(GSM8K), limit=args.steps * args.prompts_per_step)


def speculation(args: argparse.Namespace) -> tuple[SpeculationConfig, DraftTrainConfig]:
    """The speculation and online draft learning of both fastgrpo runs."""
    spec = SpeculationConfig(mode=args.speculation, draft=args.draft)
    return spec, DraftTrainConfig(token_loss_weight=1.0, bf16=native_bf16(torch.device("cpu")))


def run(args: argparse.Namespace, fast: bool) -> tuple[list[float], list[dict]]:
    """TRL's GRPOTrainer, with its own generation or (``fast``) fastgrpo's rollout_func: step times and the logs."""
    torch.manual_seed(args.seed)
    rows = load_dataset(data(args))
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
        spec, learning = speculation(args)
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


def run_own(args: argparse.Namespace) -> tuple[list[float], list[dict]]:
    """fastgrpo's GRPOTrainer on the same rows with TRL's options: step times and the metrics."""
    spec, learning = speculation(args)
    config = GRPOConfig(
        model="smollm2",
        dtype=args.dtype,
        dataset=data(args),
        reward_funcs=["fastgrpo.rewards:gsm8k_flexible"],
        num_generations=8,
        per_device_train_batch_size=8 * args.prompts_per_step,
        gradient_accumulation_steps=1,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=0.95,
        learning_rate=1e-6,
        lr_scheduler_type="linear",
        max_steps=args.steps,
        save_steps=args.steps,
        logging_steps=1,
        gradient_checkpointing=False,
        save_only_model=True,
        seed=args.seed,
        speculation=spec,
        draft_training=learning,
        output_dir=str(Path(args.output) / "fastgrpo-trainer"),
        overwrite_output_dir=True,
        log_completions=False,
    )
    history = GRPOTrainer(config).train()
    return [m["time/step"] for m in history], history


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
    runs = {
        "TRL generation": lambda: run(args, fast=False),
        "TRL + fastgrpo rollout_func": lambda: run(args, fast=True),
        "fastgrpo GRPOTrainer": lambda: run_own(args),
    }
    results = {}
    completions = 8 * args.prompts_per_step
    for name, start in runs.items():
        seconds, logs = start()
        # Completion tokens per step, from each step's mean completion length.
        tokens = [completions * e["completions/mean_length"] for e in logs]
        results[name] = (seconds, tokens, logs)
        print(f"\n{name}: step times (s) " + ", ".join(f"{s:.1f}" for s in seconds))
        for e in logs:
            extra = f", accept length {e['spec/accept_length']:.2f}" if "spec/accept_length" in e else ""
            length = e["completions/mean_length"]
            print(f"  step {e['step']}: reward {e['reward']:.3f}, mean completion length {length:.0f}{extra}")

    def per_token(seconds: list[float], tokens: list[float]) -> float:
        return sum(seconds[1:]) / sum(tokens[1:])

    base_seconds, base_tokens, _ = results["TRL generation"]
    later = f"steps 2..{args.steps}"
    rows = []
    for name, (seconds, tokens, logs) in results.items():
        accepted = [e["spec/accept_length"] for e in logs[1:] if "spec/accept_length" in e]
        rows.append(
            [
                name,
                f"{seconds[0]:.1f}",
                f"{statistics.mean(seconds[1:]):.1f}",
                f"{statistics.mean(base_seconds[1:]) / statistics.mean(seconds[1:]):.2f}x",
                f"{statistics.mean(tokens[1:]) / completions:.0f}",
                f"{1e3 * per_token(seconds, tokens):.0f}",
                f"{per_token(base_seconds, base_tokens) / per_token(seconds, tokens):.2f}x",
                f"{min(accepted):.2f} to {max(accepted):.2f}" if accepted else "-",
            ]
        )
    record.table(
        f"GRPO step times, {args.prompts_per_step} prompt(s) x 8 generations, {args.max_new_tokens} new tokens, "
        f"{args.dtype}",
        [
            "run",
            "step 1 (s)",
            f"mean of {later} (s)",
            "step time ratio",
            f"mean completion length, {later}",
            "ms per completion token",
            "per-token ratio",
            f"accepted length, {later}",
        ],
        rows,
    )
    record.save()


if __name__ == "__main__":
    main()
