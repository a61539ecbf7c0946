"""A tiny TRL GRPO run with the fastgrpo rollout_func: the builder the TRL tests share and, run as a script under
torchrun (``trl_run.py MODEL_DIR OUT``), a 2-process run whose ranks write their drafts to ``OUT/rank{RANK}``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import datasets
import trl
from transformers import AutoModelForCausalLM, TrainerCallback

from fastgrpo.config import SpeculationConfig
from fastgrpo.integrations.trl import DraftCallback, SpeculativeRollout
from fastgrpo.models import load_tokenizer


def length_reward(completions: list, **kwargs) -> list[float]:
    """Varies across random completions, so that advantages are not zero."""
    return [float(len(c[0]["content"]) % 7) for c in completions]


def tiny_grpo_trainer(
    model_dir: Path | str,
    out: Path | str,
    rollout_func: Callable,
    callbacks: list[TrainerCallback],
    reward: Callable = length_reward,
    max_steps: int = 2,
    save_steps: int | None = None,
) -> trl.GRPOTrainer:
    """TRL's GRPOTrainer on CPU: 1 prompt x 4 generations per step and process, 8 new tokens, TRL's defaults
    otherwise (gradient checkpointing included)."""
    args = trl.GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-3,
        max_steps=max_steps,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        seed=0,
        disable_tqdm=True,
    )
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(8)]
    return trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=reward,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=load_tokenizer(str(model_dir)),
        rollout_func=rollout_func,
        callbacks=callbacks,
    )


class CountingRollout(SpeculativeRollout):
    calls = 0

    def __call__(self, prompts, trainer):
        self.calls += 1
        return super().__call__(prompts, trainer)


def main(model_dir: str, out: str) -> None:
    # A reduced vocabulary: the ranks' first rollouts differ, so it must be taken from all of them to stay the same.
    spec = SpeculationConfig(mode="static", nodes=4, top_k=2, depth=3, draft_vocab_size=6)
    rollout = CountingRollout(speculation=spec)
    trainer = tiny_grpo_trainer(model_dir, out, rollout, [DraftCallback(rollout)])
    trainer.train()
    assert rollout.calls == 2 and "draft/loss" in {k for e in trainer.state.log_history for k in e}
    rollout.drafter("eagle").draft.save(Path(out) / f"rank{os.environ['RANK']}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
