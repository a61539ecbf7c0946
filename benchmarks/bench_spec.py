"""Speculative against autoregressive decoding on SmolLM2-135M-Instruct, side by side in one run.

For each concurrency (rows decoded together, one GSM8K test prompt each) and for greedy and sampled decoding, prints
tokens/s of autoregressive decoding and of speculative decoding with static tree shapes, the speedup and the mean
accepted length (tokens per row per target forward). The draft is read from ``--draft``; if that directory does not
exist, train it first with ``benchmarks/train_drafts.py``.
With a reduced-vocabulary draft, the ``--full-vocab`` shape also runs with the same draft network proposing from the
full vocabulary (its LM head over all rows), which measures whether the reduced vocabulary pays. Peak memory (max RSS
of a fresh process) of an autoregressive and a speculative generation of the largest batch is compared at the end.

    python benchmarks/bench_spec.py --draft drafts/smollm2-gsm8k-v8192
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import os
import resource
import statistics
import time
from pathlib import Path

import torch

from fastgrpo.data import load_gsm8k
from fastgrpo.models import encode_prompts, eos_token_ids, load_model, load_tokenizer
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.spec.draft import DraftHead
from fastgrpo.spec.tree import TreeShape

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
SHAPES = {"small": TreeShape(4, 2, 3), "medium": TreeShape(8, 3, 4), "large": TreeShape(16, 4, 5)}


def prompts_for(tokenizer, split: str, n: int) -> list[list[int]]:
    rows = load_gsm8k(GSM8K / f"{split}.jsonl")[:n]
    return encode_prompts(tokenizer, [r["prompt"] for r in rows], 512)


def load_draft(path: str, model) -> DraftHead:
    if not Path(path).is_dir():
        raise SystemExit(f"no draft in {path}: train one first with python benchmarks/train_drafts.py")
    return DraftHead.load(path, model)


def run(engine: RolloutEngine, prompts, params: SamplingParams, seed: int) -> tuple[float, float]:
    """tokens/s and mean accepted length of one generation call."""
    out = engine.generate(prompts, params, generator=torch.Generator().manual_seed(seed))
    return out.stats.tokens_emitted / out.stats.total_time, out.stats.accept_length


def peak_rss_mb(shape_name: str | None, draft_dir: str, batch: int, max_new: int, queue) -> None:
    """Child process: one generation of ``batch`` rows; reports the process's max RSS."""
    torch.set_num_threads(os.cpu_count())
    model, tokenizer = load_model("smollm2"), load_tokenizer("smollm2")
    draft = DraftHead.load(draft_dir, model) if shape_name else None
    tree = SHAPES[shape_name] if shape_name else None
    engine = RolloutEngine(model, eos_token_ids(model, tokenizer), tokenizer, draft=draft, tree=tree)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine.generate(prompts_for(tokenizer, "test", batch), SamplingParams(max_new_tokens=max_new, temperature=0))
    queue.put((before / 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="drafts/smollm2-gsm8k-v8192")
    parser.add_argument("--full-vocab", default="medium", help="shape also run with a full-vocabulary draft ('': none)")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--shapes", default="small,medium,large")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())
    start = time.perf_counter()
    model, tokenizer = load_model("smollm2"), load_tokenizer("smollm2")
    model.requires_grad_(False)
    draft = load_draft(args.draft, model)
    eos = eos_token_ids(model, tokenizer)
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    engines = {"ar": RolloutEngine(model, eos, tokenizer)}
    engines.update({name: RolloutEngine(model, eos, tokenizer, draft=draft, tree=s) for name, s in shapes.items()})
    if args.full_vocab and draft.draft_vocab is not None:
        full = copy.deepcopy(draft)
        full.draft_vocab = None  # the same network, proposing from the whole vocabulary
        name = f"{args.full_vocab}-fullvocab"
        shapes[name] = SHAPES[args.full_vocab]
        engines[name] = RolloutEngine(model, eos, tokenizer, draft=full, tree=shapes[name])
    concurrency = [int(c) for c in args.concurrency.split(",")]
    prompts = prompts_for(tokenizer, "test", max(concurrency))
    sampling = {
        "greedy": SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0),
        "T=1,top-p=0.95": SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=0.95),
    }
    shape_text = ", ".join(f"{n}=N{s.nodes}/K{s.top_k}/L{s.depth}" for n, s in shapes.items())
    print(f"\nSmolLM2-135M-Instruct, float32, {torch.get_num_threads()} threads, max_new_tokens={args.max_new_tokens}")
    print(f"draft vocabulary: {draft.draft_vocab.numel() if draft.draft_vocab is not None else 'full'}; {shape_text}\n")
    header = "| decoding | concurrency | AR tok/s | " + " | ".join(
        f"{n} tok/s | {n} speedup | {n} accept" for n in shapes
    )
    print(header + " |")
    print("|" + "---|" * (3 + 3 * len(shapes)))
    for label, params in sampling.items():
        for c in concurrency:
            results = {name: [] for name in engines}
            for r in range(args.repeats):
                for name, engine in engines.items():  # side by side, same prompts and seed
                    results[name].append(run(engine, prompts[:c], params, seed=r))
            ar = statistics.median(t for t, _ in results["ar"])
            cells = [f"{ar:.1f}"]
            for name in shapes:
                tps = statistics.median(t for t, _ in results[name])
                acc = statistics.median(a for _, a in results[name])
                cells += [f"{tps:.1f}", f"{tps / ar:.2f}x", f"{acc:.2f}"]
            print(f"| {label} | {c} | " + " | ".join(cells) + " |", flush=True)
    if not args.skip_memory:
        ctx = mp.get_context("spawn")
        largest, peaks = max(concurrency), {}
        for name in (None, max(shapes, key=lambda n: shapes[n].nodes)):
            queue = ctx.Queue()
            proc = ctx.Process(target=peak_rss_mb, args=(name, args.draft, largest, args.max_new_tokens, queue))
            proc.start()
            peaks[name or "ar"] = queue.get()
            proc.join()
        (ar_before, ar_peak), (sp_before, sp_peak) = peaks.values()
        print(
            f"\npeak RSS at concurrency {largest}: autoregressive {ar_peak:.0f} MB, speculative "
            f"{sp_peak:.0f} MB ({sp_peak / ar_peak:.2f}x); during generation only: {ar_peak - ar_before:.0f} MB "
            f"vs {sp_peak - sp_before:.0f} MB"
        )
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
