"""TRL 1.16's trainer and fastgrpo's (in TRL's form) side by side on the same tiny model, rows and options, each
counted the same way: the completions of every reward call (one call per generation), the completions each optimizer
step trains on, and the log history."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import trl
from transformers import AutoModelForCausalLM

from fastgrpo import GRPOConfig, GRPOTrainer

ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(8)]
COMMON = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=6, learning_rate=1e-3)
COMMON |= dict(logging_steps=1, seed=0, top_k=1, report_to="none", use_cpu=True, disable_tqdm=True)


class Counted:
    """A reward function that counts the completions of each call (one call per generation) and scores each by its
    place in its group: the top token's completions of a prompt are all the same, and the advantages must vary."""

    __name__ = "counted"

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, completions: list, **kwargs: Any) -> list[float]:
        self.calls.append(len(completions))
        return [float(i % 4) for i in range(len(completions))]


def run_trl(
    model_dir: Path, out: Path, options: dict[str, Any], rows: list[dict] = ROWS, extra: tuple = ()
) -> tuple[Counted, Counter, list[dict]]:
    """TRL's trainer on ``rows`` (reward functions: a `Counted` and ``extra``; ``options`` over `COMMON`): its reward
    calls, the completions each optimizer step computed the loss on (by ``global_step`` while the step accumulates),
    and its log history."""
    from fastgrpo.models import load_tokenizer

    reward = Counted()
    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=[reward, *extra],
        args=trl.GRPOConfig(output_dir=str(out), bf16=False, save_strategy="no", **{**COMMON, **options}),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=load_tokenizer(str(model_dir)),
    )
    trained: Counter = Counter()
    compute_loss = trainer.compute_loss

    def counted_loss(model, inputs, *args, **kwargs):
        trained[trainer.state.global_step + 1] += inputs["completion_ids"].shape[0]
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = counted_loss
    trainer.train()
    return reward, trained, trainer.state.log_history


def run_fastgrpo(
    model_dir: Path, out: Path, options: dict[str, Any], rows: list[dict] = ROWS, extra: tuple = ()
) -> tuple[Counted, Counter, list[dict]]:
    """fastgrpo's trainer in TRL's form, counted as `run_trl` counts TRL's."""
    reward = Counted()
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[reward, *extra],
        args=GRPOConfig(output_dir=str(out), log_completions=False, **{**COMMON, **options}),
        train_dataset=datasets.Dataset.from_list(rows),
    )
    trained: Counter = Counter()
    optimize = trainer.update.optimize

    def counted_optimize(batch, *args):
        trained[len(trained) + 1] += batch.completion_mask.shape[0]
        return optimize(batch, *args)

    trainer.update.optimize = counted_optimize
    trainer.train()
    return reward, trained, trainer.state.log_history
