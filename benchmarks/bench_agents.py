"""Multi-turn tool calling: TRL 1.16's GRPOTrainer with ``tools`` against fastgrpo's GRPOTrainer, the same task on
SmolLM2-135M-Instruct: arithmetic questions that the calculator tool answers (``configs/tools_arithmetic.jsonl``:
four worked examples of a call, then the question), 2 prompts x 8 completions per step, up to 3 tool-calling turns
in 256 completion tokens, the same options and seed.

Both read the prompts through the Qwen2.5 chat template (ChatML, as SmolLM2's own, with tool support; TRL refuses
a template without it, and parses calls with its response template), set on SmolLM2's tokenizer.

TRL generates a whole batch, runs the calls of the rows that made some, then re-feeds each of those rows' whole
conversation (prompt, completion so far, tool results) to generate its next turn. fastgrpo's rows wait on their
tools aside and resume in their own KV cache, fed the tool results only, while the others decode on.

Prints per run: time per step and per completion token (the model's tokens: a tool's results are not counted, as
TRL's ``completions/mean_length``), steps 2 onwards (the first warms caches and calibrates the controller), the
tokens fed after each completion's first turn (TRL: the re-fed conversations; fastgrpo: the tool results), tool
calls per completion, and fastgrpo's accepted tokens per step, with the suffix drafter alone reading tool results
into its memory or not.

    python benchmarks/bench_agents.py --steps 5
    python benchmarks/bench_agents.py --write-prompts configs/tools_arithmetic.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import datasets  # noqa: E402
import trl  # noqa: E402
from bench_trl import StepTimer  # noqa: E402
from record import REPO, Record  # noqa: E402
from transformers import PreTrainedTokenizerBase, TrainerCallback  # noqa: E402
from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template  # noqa: E402

from fastgrpo.config import GRPOConfig, SpeculationConfig  # noqa: E402
from fastgrpo.grpo.trainer import GRPOTrainer  # noqa: E402
from fastgrpo.models import load_model, load_tokenizer  # noqa: E402
from fastgrpo.rewards import gsm8k_flexible  # noqa: E402
from fastgrpo.tools.functions import calculator  # noqa: E402

PROMPTS = REPO / "configs" / "tools_arithmetic.jsonl"
COMPLETIONS = 16  # 2 prompts x 8


def worked_example(expression: str) -> list[dict[str, Any]]:
    """A question, the assistant's call of the calculator, its result and the answer."""
    result = calculator(expression)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [
        {"role": "user", "content": f"What is {expression}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": f"The answer is {result}."},
    ]


def agent_rows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` rows: four worked examples, then a question of a 3-digit and a 2-digit number, with its answer."""
    shots = [m for e in ("12 * 7", "153 + 68", "96 - 47", "23 * 41") for m in worked_example(e)]
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        expression = f"{rng.randint(100, 999)} {rng.choice('+-*')} {rng.randint(10, 99)}"
        question = {"role": "user", "content": f"What is {expression}?"}
        rows.append({"prompt": [*shots, question], "answer": calculator(expression)})
    return rows


def tool_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer with the Qwen2.5 chat template (tool support) and its response template."""
    tokenizer = load_tokenizer("smollm2")
    tokenizer.chat_template = qwen2_5_chat_template
    return add_response_schema(tokenizer)


def run_trl(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """TRL's GRPOTrainer with the calculator: per step its time, logs and the tokens its tool turns re-fed."""
    torch.manual_seed(args.seed)
    config = trl.GRPOConfig(
        output_dir=str(Path(args.output) / "trl"),
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        num_generations=8,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,  # 16 completions = 2 prompts x 8 per step
        max_completion_length=args.max_new_tokens,
        max_tool_calling_iterations=3,
        temperature=1.0,
        learning_rate=1e-5,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
        disable_tqdm=False,
    )
    timer = StepTimer()
    trainer = trl.GRPOTrainer(
        model=load_model("smollm2", dtype="float32"),
        reward_funcs=gsm8k_flexible,
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tool_tokenizer(),
        tools=[calculator],
        callbacks=[timer],
    )
    refed: list[int] = []  # per step: the tokens fed again after the first turn
    first_turn = trainer._generate_single_turn

    def counted(prompt_ids, *rest, **kwargs):
        if kwargs.get("num_generations") == 1:  # a tool turn: each row's whole conversation, fed again
            refed[-1] += sum(len(ids) for ids in prompt_ids)
        return first_turn(prompt_ids, *rest, **kwargs)

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs) -> None:
            refed.append(0)

    trainer._generate_single_turn = counted
    trainer.add_callback(Steps())
    trainer.train()
    logs = [e for e in trainer.state.log_history if "reward" in e]
    return [
        {
            "seconds": seconds,
            "tokens": COMPLETIONS * e["completions/mean_length"],
            "refed": fed / COMPLETIONS,
            "calls": e.get("tools/call_frequency", 0.0),
            "reward": e["reward"],
        }
        for seconds, e, fed in zip(timer.seconds, logs, refed, strict=True)
    ]


def run_fastgrpo(
    args: argparse.Namespace, rows: list[dict[str, Any]], drafter: str, reads_tool_results: bool = True
) -> list[dict[str, float]]:
    """fastgrpo's GRPOTrainer with the calculator, drafting with ``drafter``: per step its time and metrics."""
    config = GRPOConfig(
        model="smollm2",
        reward_funcs=["accuracy"],
        tools=["calculator"],
        max_tool_calling_iterations=3,
        num_generations=8,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_completion_length=args.max_new_tokens,
        max_prompt_length=1024,
        temperature=1.0,
        learning_rate=1e-5,
        lr_scheduler_type="linear",
        max_steps=args.steps,
        save_steps=args.steps,
        logging_steps=1,
        gradient_checkpointing=False,
        save_only_model=True,
        seed=args.seed,
        speculation=SpeculationConfig(drafter=drafter),
        output_dir=str(Path(args.output) / f"fastgrpo-{drafter}-{reads_tool_results}"),
        overwrite_output_dir=True,
        log_completions=False,
        bf16=False,
    )
    trainer = GRPOTrainer(config, tokenizer=tool_tokenizer(), dataset=rows)
    suffix = trainer.rollouts.drafter("suffix")
    if suffix is not None:
        suffix.reads_tool_results = reads_tool_results
    history = trainer.train()
    return [
        {
            "seconds": m["time/step"],
            "tokens": COMPLETIONS * m["completions/mean_length"],
            "refed": m.get("tools/prefill_tokens", 0.0) / COMPLETIONS,
            "calls": m.get("tools/call_frequency", 0.0),
            "reward": m["reward"],
            "accept": m.get("spec/accept_length", 1.0),
            "suffix_accept": m.get("spec/drafter/suffix/accept_length", float("nan")),
        }
        for m in history
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="runs/bench_agents")
    parser.add_argument("--write-prompts", type=Path, help="write the task's prompts (64 rows) there and stop")
    args = parser.parse_args()
    if args.write_prompts is not None:
        args.write_prompts.write_text("".join(json.dumps(row) + "\n" for row in agent_rows(64)))
        return
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is reported apart)")
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()][: 2 * args.steps]

    record = Record("bench_agents")
    runs = {
        "TRL GRPOTrainer, tools": lambda: run_trl(args, rows),
        "fastgrpo, eagle+suffix": lambda: run_fastgrpo(args, rows, "eagle+suffix"),
        "fastgrpo, suffix reading tool results": lambda: run_fastgrpo(args, rows, "suffix"),
        "fastgrpo, suffix not reading tool results": lambda: run_fastgrpo(args, rows, "suffix", False),
    }
    results = {}
    for name, start in runs.items():
        steps = start()
        results[name] = steps
        print(f"\n{name}:")
        for k, s in enumerate(steps, 1):
            accept = f", accepted length {s['accept']:.2f}" if "accept" in s else ""
            print(
                f"  step {k}: {s['seconds']:.1f} s, {s['tokens']:.0f} completion tokens, {s['calls']:.2f} calls per "
                f"completion, {s['refed']:.0f} tokens fed after the first turn per completion, reward "
                f"{s['reward']:.3f}{accept}"
            )

    def per_token(steps: list[dict[str, float]]) -> float:
        return sum(s["seconds"] for s in steps[1:]) / sum(s["tokens"] for s in steps[1:])

    base = per_token(results["TRL GRPOTrainer, tools"])
    later = f"steps 2..{args.steps}"
    table = []
    for name, steps in results.items():
        rest = steps[1:]
        accepted = [s["accept"] for s in rest if "accept" in s]
        suffix = [s["suffix_accept"] for s in rest if "suffix_accept" in s and s["suffix_accept"] == s["suffix_accept"]]
        table.append(
            [
                name,
                f"{steps[0]['seconds']:.1f}",
                f"{statistics.mean(s['seconds'] for s in rest):.1f}",
                f"{statistics.mean(s['tokens'] for s in rest) / COMPLETIONS:.0f}",
                f"{statistics.mean(s['calls'] for s in rest):.2f}",
                f"{statistics.mean(s['refed'] for s in rest):.0f}",
                f"{1e3 * per_token(steps):.1f}",
                f"{base / per_token(steps):.2f}x",
                f"{statistics.mean(accepted):.2f}" if accepted else "-",
                f"{statistics.mean(suffix):.2f}" if suffix else "-",
            ]
        )
    record.table(
        f"GRPO with a calculator tool, SmolLM2-135M-Instruct, 2 prompts x 8, up to 3 tool turns in "
        f"{args.max_new_tokens} tokens, float32",
        [
            "run",
            "step 1 (s)",
            f"mean step, {later} (s)",
            "model tokens per completion",
            "tool calls per completion",
            "tokens fed after the first turn, per completion",
            "ms per model token",
            "per-token speed-up over TRL",
            "accepted length",
            "suffix drafter's accepted length",
        ],
        table,
    )
    record.save()


if __name__ == "__main__":
    main()
