"""Rollouts of a LoRA policy with its adapters merged against unmerged, on SmolLM2-135M-Instruct, side by side.

For each concurrency (rows decoded together, one GSM8K test prompt each), prints the tokens/s of the policy with its
adapters disabled, with rank-``--rank`` adapters on every linear layer run as peft runs them, and with the same
adapters merged into the base weights for the rollout (the engine's default), with the ratios; the engines take turns
on the same prompts, ``--repeats`` times, and the median is shown. The adapters' B matrices are random (peft starts
them at zero), so the adapters change what is generated; a note is printed where the merged and unmerged rollouts
differ (they may, by the rounding of ``W + s B A``).

    python benchmarks/bench_lora.py --concurrency 1,8,32
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from record import Record

from fastgrpo.data import load_gsm8k
from fastgrpo.models import encode_prompts, eos_token_ids, load_model, load_tokenizer
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.sampling_params import SamplingParams

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="float32 (merged) or bfloat16 (adapters stay unmerged)")
    args = parser.parse_args()
    record = Record("bench_lora")
    torch.set_num_threads(os.cpu_count())
    start = time.perf_counter()
    model, tokenizer = load_model("smollm2", dtype=args.dtype), load_tokenizer("smollm2")
    eos = eos_token_ids(model, tokenizer)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    rows = load_gsm8k(GSM8K)[: max(concurrency)]
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in rows], 512)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    policy = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02, generator=generator)
    engines = {
        "disabled": RolloutEngine(policy, eos),  # run with the adapters disabled
        "unmerged": RolloutEngine(policy, eos, merge_lora=False),
        "merged": RolloutEngine(policy, eos),
    }
    for engine in engines.values():  # one-off costs
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=0.0))
    table = []
    for c in concurrency:
        speed: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            completions = {}
            for name, engine in engines.items():
                with policy.disable_adapter() if name == "disabled" else nullcontext():
                    out = engine.generate(prompts[:c], params)
                speed[name].append(out.stats.tokens_per_second)
                completions[name] = out.completion_ids
            if completions["merged"] != completions["unmerged"]:
                print(f"note: at {c} rows the merged and unmerged rollouts differ (rounding of W + s B A)")
        s = {name: statistics.median(v) for name, v in speed.items()}
        table.append(
            [c, f"{s['disabled']:.1f}", f"{s['unmerged']:.1f}", f"{s['merged']:.1f}"]
            + [f"{s['merged'] / s['unmerged']:.2f}x", f"{s['merged'] / s['disabled']:.2f}x"]
        )
        print(f"{c} rows: merged {s['merged']:.1f} tok/s", flush=True)
    record.table(
        f"SmolLM2-135M-Instruct, {args.dtype}, {torch.get_num_threads()} threads, LoRA rank {args.rank} on all linear "
        f"layers, greedy, {args.max_new_tokens} new tokens, median of {args.repeats} rounds",
        ["rows", "adapters disabled tok/s", "unmerged tok/s", "merged tok/s", "merged / unmerged", "merged / disabled"],
        table,
    )
    record.save()
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
