"""Run by tests/test_trl_integration.py under torchrun: TRL's GRPOTrainer in 2 processes with the fastgrpo
rollout_func and DraftCallback; each rank writes its draft to OUT/rank{RANK} for the test to compare."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import datasets
import trl
from transformers import AutoModelForCausalLM

from fastgrpo.config import SpeculationConfig
from fastgrpo.integrations.trl import DraftCallback, SpeculativeRollout
from fastgrpo.models import load_tokenizer


def length_reward(completions: list, **kwargs) -> list[float]:
    return [float(len(c[0]["content"]) % 7) for c in completions]


def main(model_dir: str, out: str) -> None:
    rollout = SpeculativeRollout(speculation=SpeculationConfig(mode="static", nodes=4, top_k=2, depth=3))
    args = trl.GRPOConfig(
        output_dir=out,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-3,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(8)]
    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=length_reward,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=load_tokenizer(model_dir),
        rollout_func=rollout,
        callbacks=[DraftCallback(rollout)],
    )
    trainer.train()
    assert rollout.calls == 2 and "draft/loss" in {k for e in trainer.state.log_history for k in e}
    rollout.draft.save(Path(out) / f"rank{os.environ['RANK']}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
