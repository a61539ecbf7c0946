"""Rows refilled as they finish (``max_inflight_tasks``): the default run's model and prompts
(`configs/default.yaml`: SmolLM2-135M-Instruct, up to 128 tokens at T=1), generations of ``--prompts`` prompts x 8
completions, at most ``--at-once`` completions decoding at once, three ways in each round, side by side on the same
engine and the same uniforms (so the same completions, but where a batch of another size rounds otherwise), each way
drafting from the suffix memory the round began with (not from the completions of the ways before it; the
drafters' measured prices and the controller's corrections do carry over from way to way):

- ``all at once``: one call decoding every completion together (the most memory);
- ``waves``: the prompts in calls of ``--at-once`` completions, one after the other (each waits for its longest);
- ``refilled``: one call with ``max_rows`` ``--at-once``: the next completions take finished rows' places.

Per way: seconds per completion token (the calls' wall time over their tokens, over all rounds), the mean rows per
decoding step, the decoding steps, the share of them that verified a draft tree and the drafters' milliseconds per
such step. ``--speculation`` off (the default), the run's adaptive speculation, or static trees at every step (the
run's ``speculation`` tree), its drafters warmed on ``--warmup`` rollouts first.

    python benchmarks/bench_refill.py [--rounds 4] [--prompts 4] [--at-once 16] [--speculation adaptive|static]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

from record import REPO, Record

from fastgrpo.config.files import load_config
from fastgrpo.grpo.trainer import GRPOTrainer
from fastgrpo.training_rollouts import step_uniforms

WAYS = ("all at once", "waves", "refilled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per generation (8 completions each)")
    parser.add_argument("--at-once", type=int, default=16, help="completions decoding at once (waves, refilled)")
    parser.add_argument("--speculation", choices=("off", "adaptive", "static"), default="off")
    parser.add_argument("--warmup", type=int, default=3, help="rollouts the drafters learn from before timing")
    args = parser.parse_args()
    record = Record("bench_refill")
    with tempfile.TemporaryDirectory() as tmp:
        rows = args.prompts * 8
        options = [f"--output_dir={Path(tmp) / 'run'}", "--progress_bar=false", "--gradient_accumulation_steps=1"]
        options += [f"--per_device_train_batch_size={rows}", f"--speculation.mode={args.speculation}"]
        run = GRPOTrainer(load_config(REPO / "configs" / "default.yaml", options))
        engine, params, g = run.rollouts.engine, run.sampling, run.config.num_generations
        for step in range(args.warmup if args.speculation != "off" else 1):
            run.rollout(1000 + step, run.prompts.rows(1000 + step))
            run.rollouts.learn()
        seconds, tokens, concurrency, steps, trees, drafting = ({w: [] for w in WAYS} for _ in range(6))
        suffix, memory = run.rollouts.drafter("suffix"), None
        for step in range(args.rounds):
            prompt_ids = run.prompts.encode(run.prompts.rows(step))
            if suffix is not None:
                suffix.learner.read_rows()
                memory = copy.deepcopy(suffix.learner)
            uniforms = step_uniforms(run.config.seed, step, rows, params.max_new_tokens)
            per_wave = args.at_once // g
            calls = {
                "all at once": [(prompt_ids, uniforms, None)],
                "waves": [
                    (prompt_ids[i : i + per_wave], uniforms[i * g : (i + per_wave) * g], None)
                    for i in range(0, len(prompt_ids), per_wave)
                ],
                "refilled": [(prompt_ids, uniforms, args.at_once)],
            }
            for way in WAYS[step % 3 :] + WAYS[: step % 3]:  # each way first in turn
                if suffix is not None:
                    suffix.learner = copy.deepcopy(memory)
                t0, outs = time.perf_counter(), []
                for ids, u, at_once in calls[way]:
                    outs.append(engine.generate(ids, params, g, uniforms=u, max_rows=at_once))
                seconds[way].append(time.perf_counter() - t0)
                tokens[way].append(sum(len(c) for out in outs for c in out.completion_ids))
                per_step = [c for out in outs for c in out.stats.concurrency]
                concurrency[way].append(statistics.mean(per_step))
                steps[way].append(len(per_step))
                trees[way].append(sum(len(out.stats.tree_nodes) for out in outs))
                drafting[way].append(sum(out.stats.draft_time for out in outs))
            print(f"round {step + 1}: " + ", ".join(f"{w} {seconds[w][-1]:.2f} s" for w in WAYS), flush=True)
    base = sum(seconds["waves"]) / sum(tokens["waves"])
    table = []
    for way in WAYS:
        per_token = sum(seconds[way]) / sum(tokens[way])
        table.append(
            [
                way,
                rows if way == "all at once" else args.at_once,
                sum(tokens[way]),
                f"{1000 * per_token:.2f}",
                f"{base / per_token:.2f}",
                f"{statistics.mean(concurrency[way]):.1f}",
                f"{statistics.mean(steps[way]):.0f}",
                f"{sum(trees[way]) / sum(steps[way]):.0%}",
                f"{1000 * sum(drafting[way]) / sum(trees[way]):.2f}" if sum(trees[way]) else "-",
            ]
        )
    record.table(
        f"Generations of {args.prompts} prompts x 8 completions, {args.rounds} rounds, speculation {args.speculation}",
        ["way", "rows at once", "completion tokens", "ms per token", "speed vs waves", "mean rows per step", "steps",
         "tree steps", "draft ms per tree step"],
        table,
    )  # fmt: skip
    record.save()


if __name__ == "__main__":
    main()
