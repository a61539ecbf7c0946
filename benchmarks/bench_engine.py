"""Autoregressive throughput of the rollout engine against transformers' ``generate``.

Runs the embedded SmolLM2-135M-Instruct greedily on GSM8K test prompts at several batch sizes and prints a
markdown table. Throughput counts useful completion tokens (up to and including the first EOS) per second of
wall time; each side is warmed up once per batch size, the sides are timed in turn, and the median over
repeats is reported. A third side is the engine with plain ``F.linear`` instead of the CPU linear-layer routes it
measured on this machine (`fastgrpo.rollout.linear`), which are kept only where they are faster. With
``--compile``, a fourth side is the engine with its target step compiled by inductor (`fastgrpo.rollout.target_step`;
``compile: on``), its compilation done in the warm-up and reported apart.

Usage::

    python benchmarks/bench_engine.py --max-new-tokens 128 --batch-sizes 1,8,32,64 --repeats 3 [--dtype bfloat16] \
        [--compile]

On a shared machine, pass ``--threads 1`` when other processes keep cores busy: an oversubscribed OpenMP pool
makes the timings erratic.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from record import Record
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastgrpo.data import load_gsm8k
from fastgrpo.models import encode_prompts, eos_token_ids, load_model, load_tokenizer
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.linear import LinearRoutes
from fastgrpo.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
GSM8K_TEST = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
MAX_PROMPT_LENGTH = 512


def truncate_at_eos(ids: list[int], eos: set[int]) -> list[int]:
    """The tokens up to and including the first EOS (all of them when there is none)."""
    for i, tok in enumerate(ids):
        if tok in eos:
            return ids[: i + 1]
    return ids


def run_engine(engine: RolloutEngine, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy completions from the engine and the wall time they took."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    return out.completion_ids, time.perf_counter() - t0


@torch.no_grad()
def run_generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: list[int],
) -> tuple[list[list[int]], float]:
    """Greedy completions from ``model.generate`` on the left-padded batch (cut at the first EOS), and wall time."""
    t0 = time.perf_counter()
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt", padding_side="left")
    out = model.generate(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    elapsed = time.perf_counter() - t0
    width = batch["input_ids"].shape[1]
    eos_set = set(eos)
    return [truncate_at_eos(row, eos_set) for row in out[:, width:].tolist()], elapsed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=128, help="completion length limit (both sides)")
    parser.add_argument(
        "--batch-sizes", type=str, default="1,8,32,64", help="comma-separated batch sizes (default 1,8,32,64)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side and batch size (median)")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads (default: all cores)"
    )
    parser.add_argument("--data", type=Path, default=GSM8K_TEST, help="GSM8K-format prompt file")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype (both sides)")
    parser.add_argument("--compile", action="store_true", help="also time the engine with its step compiled")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error("--batch-sizes needs positive integers")
    if min(args.repeats, args.max_new_tokens, args.threads) < 1:
        parser.error("--repeats, --max-new-tokens and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    record = Record("bench_engine")
    start = time.perf_counter()
    torch.set_num_threads(args.threads)

    tokenizer = load_tokenizer("smollm2")
    model = load_model("smollm2", dtype=args.dtype).eval()
    eos = eos_token_ids(model, tokenizer)
    engine = RolloutEngine(model, eos, tokenizer=tokenizer)
    compiled = RolloutEngine(model, eos, tokenizer=tokenizer, backend="inductor") if args.compile else None
    rows = load_gsm8k(args.data)[: max(args.batch_sizes)]
    all_prompts = encode_prompts(tokenizer, [r["prompt"] for r in rows], MAX_PROMPT_LENGTH)
    print(
        f"model smollm2 ({model.dtype}), threads {torch.get_num_threads()}, max_new_tokens {args.max_new_tokens}, "
        f"repeats {args.repeats}, {len(all_prompts)} GSM8K prompts "
        f"(mean length {statistics.mean(map(len, all_prompts)):.0f} tokens)",
        flush=True,
    )

    results = []
    for bs in args.batch_sizes:
        prompts = all_prompts[:bs]
        if len(prompts) < bs:
            print(f"only {len(prompts)} prompts available for batch size {bs}", file=sys.stderr)
        run_engine(engine, prompts, args.max_new_tokens)  # warm-up
        run_generate(model, tokenizer, prompts, args.max_new_tokens, eos)
        compile_s = 0.0
        if compiled is not None:
            for _ in range(2):  # compiles the row buckets the rollout meets, then runs them once more
                compile_s += compiled.generate(
                    prompts, SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
                ).stats.compile_time
        engine_rates, default_rates, generate_rates, compiled_rates = [], [], [], []
        for _ in range(args.repeats):
            e_ids, e_time = run_engine(engine, prompts, args.max_new_tokens)
            measured, engine.routes = engine.routes, LinearRoutes("off")
            d_ids, d_time = run_engine(engine, prompts, args.max_new_tokens)
            engine.routes = measured
            g_ids, g_time = run_generate(model, tokenizer, prompts, args.max_new_tokens, eos)
            engine_rates.append(sum(map(len, e_ids)) / e_time)
            default_rates.append(sum(map(len, d_ids)) / d_time)
            generate_rates.append(sum(map(len, g_ids)) / g_time)
            if compiled is not None:
                c_ids, c_time = run_engine(compiled, prompts, args.max_new_tokens)
                compiled_rates.append(sum(map(len, c_ids)) / c_time)
        same = sum(a == b for a, b in zip(e_ids, g_ids, strict=True))
        rates = [statistics.median(r) for r in (engine_rates, default_rates, generate_rates)]
        extra = []
        if compiled is not None:
            same_compiled = sum(a == b for a, b in zip(e_ids, c_ids, strict=True))
            extra = [statistics.median(compiled_rates), compile_s, same_compiled]
        results.append((bs, *rates, same, len(prompts), *extra))
        print(f"batch {bs}: engine {rates[0]:.1f} tok/s, generate {rates[2]:.1f} tok/s, identical {same}", flush=True)

    columns = ["batch", "engine tok/s", "engine, F.linear tok/s", "generate tok/s", "engine / generate", "identical"]
    table = [
        [bs, f"{e:.1f}", f"{d:.1f}", f"{g:.1f}", f"{e / g:.2f}x", f"{same}/{n}"] for bs, e, d, g, same, n, *_ in results
    ]
    if compiled is not None:
        columns += ["compiled tok/s", "compiled / engine", "compile s", "compiled = engine"]
        for row, (_, e, _, _, _, n, c, seconds, same_c) in zip(table, results, strict=True):
            row += [f"{c:.1f}", f"{c / e:.2f}x", f"{seconds:.0f}", f"{same_c}/{n}"]
    record.table(
        f"Greedy decoding of GSM8K test prompts, {args.max_new_tokens} new tokens, {model.dtype}, useful tokens/s "
        f"(median of {args.repeats})",
        columns,
        table,
    )
    record.save()
    print(f"\ntotal wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
