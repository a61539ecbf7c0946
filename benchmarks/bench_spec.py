"""Speculative against autoregressive decoding on SmolLM2-135M-Instruct, side by side in one run.

For each concurrency (rows decoded together, one GSM8K test prompt each; with ``--prompt-sets P``, P disjoint sets of
that many prompts, one after the other, their tokens and times summed; the engines take turns on each set) and for
greedy and sampled decoding, prints tokens/s of autoregressive decoding and of speculative decoding with static tree
shapes, the speedup and the mean accepted length (tokens per row per target forward). The draft is read from
``--draft``; if that directory does not exist, train it first with ``benchmarks/train_drafts.py``.
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
import re
import statistics
import time
from pathlib import Path

import torch
from record import Record

from fastgrpo.data import load_gsm8k
from fastgrpo.models import encode_prompts, eos_token_ids, load_model, load_tokenizer
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.eagle.head import DraftHead

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
SHAPES = {"small": TreeShape(4, 2, 3), "medium": TreeShape(8, 3, 4), "large": TreeShape(16, 4, 5)}


def parse_shapes(text: str) -> dict[str, TreeShape]:
    """``--shapes``: names from `SHAPES` or trees written ``N8K3L4`` (nodes, top-k, depth), comma-separated."""
    shapes = {}
    for name in text.split(","):
        spec = re.fullmatch(r"N(\d+)K(\d+)L(\d+)", name)
        if name not in SHAPES and spec is None:
            raise SystemExit(f"--shapes: {name!r} is neither one of {', '.join(SHAPES)} nor a tree like N8K3L4")
        shapes[name] = SHAPES[name] if spec is None else TreeShape(*map(int, spec.groups()))
    return shapes


def prompts_for(tokenizer, split: str, n: int) -> list[list[int]]:
    rows = load_gsm8k(GSM8K / f"{split}.jsonl")[:n]
    return encode_prompts(tokenizer, [r["prompt"] for r in rows], 512)


def load_draft(path: str, model) -> DraftHead:
    if not Path(path).is_dir():
        raise SystemExit(f"no draft in {path}: train one first with python benchmarks/train_drafts.py")
    return DraftHead.load(path, model)


def run(engines: dict[str, RolloutEngine], prompt_sets, params: SamplingParams, seed: int) -> dict[str, tuple]:
    """Per engine: tokens/s and mean accepted length (tokens emitted per row per target forward) of one generation
    call per set of prompts, summed over the sets. The engines take turns on each set, so a drift in the machine's
    speed over the run reaches every engine alike."""
    sums = {name: [0.0, 0.0, 0.0, 0.0] for name in engines}  # tokens, seconds, decoded tokens, row-forwards
    for prompts in prompt_sets:
        for name, engine in engines.items():  # side by side, same prompts and seed
            stats = engine.generate(prompts, params, generator=torch.Generator().manual_seed(seed)).stats
            for i, value in enumerate(
                (stats.tokens_emitted, stats.total_time, stats.decode_tokens, sum(stats.concurrency))
            ):
                sums[name][i] += value
    return {name: (t / s, d / max(f, 1)) for name, (t, s, d, f) in sums.items()}


def _status_mb(field: str) -> float:
    """A memory figure of this process from /proc/self/status, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_rss_mb(shape_name: str | None, draft_dir: str, batch: int, max_new: int, dtype: str, queue) -> None:
    """Child process: one generation of ``batch`` rows. Reports the resident memory once the model is loaded and the
    peak during the generation (the high-water mark is reset after loading, so the loading peak does not count)."""
    torch.set_num_threads(os.cpu_count())
    model, tokenizer = load_model("smollm2", dtype=dtype), load_tokenizer("smollm2")
    draft = DraftHead.load(draft_dir, model) if shape_name else None
    tree = parse_shapes(shape_name)[shape_name] if shape_name else None
    engine = RolloutEngine(
        model, eos_token_ids(model, tokenizer), tokenizer, drafter=EagleDrafter(draft, model), tree=tree
    )
    prompts = prompts_for(tokenizer, "test", batch)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    loaded = _status_mb("VmRSS")
    engine.generate(prompts, SamplingParams(max_new_tokens=max_new, temperature=0))
    queue.put((loaded, _status_mb("VmHWM")))


def measure_memory(shapes: dict[str, TreeShape], draft_dir: str, batch: int, max_new: int, dtype: str) -> str:
    """Peak memory of an autoregressive and a speculative generation (the largest tree) of the same batch, each in a
    fresh process."""
    ctx = mp.get_context("spawn")
    peaks = {}
    for name in (None, max(shapes, key=lambda n: shapes[n].nodes)):
        queue = ctx.Queue()
        proc = ctx.Process(target=peak_rss_mb, args=(name, draft_dir, batch, max_new, dtype, queue))
        proc.start()
        peaks[name or "ar"] = queue.get()
        proc.join()
    (ar_loaded, ar_peak), (sp_loaded, sp_peak) = peaks.values()
    text = (
        f"peak RSS of a generation at concurrency {batch}: autoregressive {ar_peak:.0f} MB, speculative "
        f"{sp_peak:.0f} MB ({sp_peak / ar_peak:.2f}x); above the loaded process "
        f"({ar_loaded:.0f} / {sp_loaded:.0f} MB): {ar_peak - ar_loaded:.0f} MB vs {sp_peak - sp_loaded:.0f} MB"
    )
    print("\n" + text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="drafts/smollm2-gsm8k-v8192")
    parser.add_argument("--full-vocab", default="medium", help="shape also run with a full-vocabulary draft ('': none)")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument(
        "--shapes", default="small,medium,large", help="names (small, medium, large) or trees like N8K3L4"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--prompt-sets", type=int, default=1, help="disjoint sets of prompts run at each concurrency")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (on CPUs with bf16 matrix units)")
    parser.add_argument("--decoding", default="greedy,sampled", help="greedy, sampled (T=1, top-p 0.95) or both")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--memory-only", action="store_true")
    args = parser.parse_args()
    decodings = [m.strip() for m in args.decoding.split(",") if m.strip()]
    if not decodings or any(m not in ("greedy", "sampled") for m in decodings):
        raise SystemExit(f"--decoding must name greedy and/or sampled, got {args.decoding!r}")
    record = Record("bench_spec")
    if args.memory_only:
        shapes = parse_shapes(args.shapes)
        concurrency = max(int(c) for c in args.concurrency.split(","))
        record.notes["memory"] = measure_memory(shapes, args.draft, concurrency, args.max_new_tokens, args.dtype)
        record.save()
        return
    torch.set_num_threads(os.cpu_count())
    start = time.perf_counter()
    model, tokenizer = load_model("smollm2", dtype=args.dtype), load_tokenizer("smollm2")
    model.requires_grad_(False)
    draft = load_draft(args.draft, model)
    eos = eos_token_ids(model, tokenizer)
    shapes = parse_shapes(args.shapes)
    engines = {"ar": RolloutEngine(model, eos, tokenizer)}
    engines.update(
        {
            name: RolloutEngine(model, eos, tokenizer, drafter=EagleDrafter(draft, model), tree=s)
            for name, s in shapes.items()
        }
    )
    if args.full_vocab and draft.draft_vocab is not None:
        full = copy.deepcopy(draft)
        full.draft_vocab = None  # the same network, proposing from the whole vocabulary
        name = f"{args.full_vocab}-fullvocab"
        shapes[name] = parse_shapes(args.full_vocab)[args.full_vocab]
        engines[name] = RolloutEngine(model, eos, tokenizer, drafter=EagleDrafter(full, model), tree=shapes[name])
    concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.prompt_sets < 1:
        raise SystemExit(f"--prompt-sets must be >= 1, got {args.prompt_sets}")
    prompts = prompts_for(tokenizer, "test", max(concurrency) * args.prompt_sets)
    modes = {
        "greedy": ("greedy", SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)),
        "sampled": ("T=1,top-p=0.95", SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=0.95)),
    }
    sampling = dict(modes[m] for m in decodings)
    for engine in engines.values():  # warm-up: the first call of a process pays one-off costs (kernels, allocation)
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=8, temperature=0.0))
    shape_text = ", ".join(f"{n}=N{s.nodes}/K{s.top_k}/L{s.max_levels}" for n, s in shapes.items())
    threads = torch.get_num_threads()
    print(
        f"\nSmolLM2-135M-Instruct, {args.dtype}, {threads} threads, max_new_tokens={args.max_new_tokens}, "
        f"{args.prompt_sets} prompt set(s) per concurrency"
    )
    print(f"draft vocabulary: {draft.draft_vocab.numel() if draft.draft_vocab is not None else 'full'}; {shape_text}\n")
    columns = ["decoding", "concurrency", "AR tok/s"]
    columns += [f"{n} {what}" for n in shapes for what in ("tok/s", "speedup", "accept")]
    rows = []
    for label, params in sampling.items():
        for c in concurrency:
            results = {name: [] for name in engines}
            sets = [prompts[i * c : (i + 1) * c] for i in range(args.prompt_sets)]
            for r in range(args.repeats):
                for name, measured in run(engines, sets, params, seed=r).items():
                    results[name].append(measured)
            ar = statistics.median(t for t, _ in results["ar"])
            cells = [f"{ar:.1f}"]
            for name in shapes:
                tps = statistics.median(t for t, _ in results[name])
                acc = statistics.median(a for _, a in results[name])
                cells += [f"{tps:.1f}", f"{tps / ar:.2f}x", f"{acc:.2f}"]
            rows.append([label, c, *cells])
            print(f"{label}, {c} rows: " + ", ".join(cells), flush=True)
    record.table(
        f"Static trees against autoregressive decoding (SmolLM2-135M-Instruct, {args.dtype}, {threads} threads, "
        f"{args.max_new_tokens} new tokens, {args.prompt_sets} prompt set(s); {shape_text})",
        columns,
        rows,
    )
    if not args.skip_memory:
        shapes = parse_shapes(args.shapes)
        record.notes["memory"] = measure_memory(shapes, args.draft, max(concurrency), args.max_new_tokens, args.dtype)
    record.save()
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
