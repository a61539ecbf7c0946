"""Concurrency-aware speculation on SmolLM2-135M-Instruct: autoregressive decoding, static trees, the paper's
controller and the adaptive controller, side by side in one run.

1. GRPO rollouts replayed: GSM8K test prompts, ``num_generations`` samples each at T=1, top-p 0.95, up to 256 new
   tokens, so the number of active rows falls as answers finish, as in training. Every mode decodes the same prompts
   with the same seed, and since each position has its own uniform they emit the same tokens (counted).
2. A sweep at fixed concurrency: ``c`` rows decode ``--sweep-tokens`` tokens each with no EOS; ``--repeats``
   interleaved rounds of every mode, medians of decoding tokens/s over the steps that ran all ``c`` rows (the
   prefill, the same in every mode, is left out; so are a speculative call's last steps, where rows that accepted
   less are still short of the length limit after the others reached it and the concurrency falls below ``c``).

The latency profile is the one saved by ``fastgrpo profile`` (else a short calibration); the draft is a saved one
(``benchmarks/train_drafts.py``). Prints markdown tables and writes a plot of speedup against concurrency.

    python benchmarks/bench_controller.py --draft drafts/smollm2-gsm8k-v8192 --plot docs/controller_sweep.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from record import Record

from fastgrpo.data import load_gsm8k
from fastgrpo.models import encode_prompts, eos_token_ids, load_model, load_tokenizer
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.scheduling import StaticController
from fastgrpo.rollout.tree import TreeShape
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.controller import AdaptiveController, priced
from fastgrpo.speculative.eagle.drafter import EagleDrafter
from fastgrpo.speculative.eagle.head import DraftHead
from fastgrpo.speculative.eagle.plugin import EaglePlugin
from fastgrpo.speculative.paper import PaperController
from fastgrpo.speculative.plugin import cost_probes
from fastgrpo.speculative.profiler import load_or_calibrate

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def make_engines(model, tokenizer, draft: DraftHead, eos: list[int], c_peak: int, profile) -> dict[str, RolloutEngine]:
    """One engine per mode; each keeps its controller's state across calls, as a training run does."""
    adaptive = EagleDrafter(draft, model, profile=profile)
    drafters = {
        "static N4/K2/L3": (EagleDrafter(draft, model), StaticController(TreeShape(4, 2, 3))),
        "static N16/K4/L5": (EagleDrafter(draft, model), StaticController(TreeShape(16, 4, 5))),
        f"paper (C_peak {c_peak})": (EagleDrafter(draft, model), PaperController(c_peak)),
        "adaptive": (adaptive, AdaptiveController(profile, drafters=priced([adaptive]))),
    }
    engines = {"autoregressive": RolloutEngine(model, eos, tokenizer)}
    for name, (drafter, controller) in drafters.items():
        engines[name] = RolloutEngine(model, eos, tokenizer, drafter=drafter, controller=controller)
    return engines


def timed(engine: RolloutEngine, prompts, params: SamplingParams, num_generations: int, seed: int):
    t0 = time.perf_counter()
    out = engine.generate(prompts, params, num_generations, generator=torch.Generator().manual_seed(seed))
    return time.perf_counter() - t0, out


def rollout_table(engines, prompts, params: SamplingParams, num_generations: int, record: Record) -> None:
    rows, reference, base = [], None, None
    for name, engine in engines.items():
        seconds, out = timed(engine, prompts, params, num_generations, seed=0)
        if reference is None:
            reference, base = out.completion_ids, seconds
        same = sum(a == b for a, b in zip(out.completion_ids, reference, strict=True))
        s = out.stats
        rows.append(
            [name, f"{seconds:.1f}", s.tokens_emitted, f"{s.tokens_emitted / seconds:.1f}", f"{base / seconds:.2f}x"]
            + [f"{s.accept_length:.2f}", f"{s.n_verify_mean:.1f}", f"{same}/{len(reference)}"]
        )
        print(f"{name}: {seconds:.1f} s", flush=True)
    record.table(
        f"Rollout replay: {len(prompts)} prompts x {num_generations} generations, T=1, top-p 0.95",
        ["mode", "time s", "tokens", "tokens/s", "speedup", "mean accepted", "mean N verify", "same tokens as AR"],
        rows,
    )


def full_concurrency_rate(stats, rows: int) -> float:
    """Decoding tokens/s over the steps that ran ``rows`` rows. Decoding only: the prefill is the same work in every
    mode, and at 64 rows most of the call."""
    steps = [i for i, c in enumerate(stats.concurrency) if c == rows]
    return sum(stats.tokens_per_forward[i] for i in steps) / sum(stats.step_times[i] for i in steps)


def sweep_table(
    engines, prompts, concurrency: list[int], tokens: int, repeats: int, record: Record
) -> dict[str, list[float]]:
    """Each concurrency runs ``repeats`` rounds of every mode in turn; a mode's speedup is the median over rounds of
    its rate over the autoregressive rate of the same round, so a slow spell of the machine bends one round of all
    modes rather than one mode."""
    names = list(engines)
    table = []
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0, top_p=0.95)
    speedups: dict[str, list[float]] = {name: [] for name in names[1:]}
    for c in concurrency:
        rates: dict[str, list[float]] = {name: [] for name in names}
        trees: dict[str, list[float]] = {name: [] for name in names}  # share of decoding steps that ran a tree
        for _ in range(repeats):
            for name, engine in engines.items():
                eos_before = engine.eos
                engine.eos = torch.empty(0, dtype=torch.long)  # no row ends early: the concurrency stays c
                try:
                    _, out = timed(engine, prompts[:c], params, 1, seed=c)
                finally:
                    engine.eos = eos_before
                rates[name].append(full_concurrency_rate(out.stats, c))
                trees[name].append(len(out.stats.tree_nodes) / out.stats.target_forwards)
        ar = rates["autoregressive"]
        cells = []
        for name in names[1:]:
            ratio = statistics.median(r / a for r, a in zip(rates[name], ar, strict=True))
            speedups[name].append(ratio)
            share = sum(trees[name]) / len(trees[name])
            cells.append(f"{ratio:.2f}x ({statistics.median(rates[name]):.0f}, {share:.0%} trees)")
        table.append([c, f"{statistics.median(ar):.1f}", *cells])
        print(f"{c} rows: " + ", ".join(cells), flush=True)
    record.table(
        f"Fixed concurrency: c rows x {tokens} tokens, no EOS, T=1, top-p 0.95; speedup over AR (decoding tokens/s "
        f"over the steps that ran all c rows, share of decoding steps that ran a tree), median of {repeats} "
        "interleaved rounds",
        ["concurrency", "AR tok/s", *names[1:]],
        table,
    )
    return speedups


def plot(concurrency: list[int], speedups: dict[str, list[float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, values in speedups.items():
        ax.plot(concurrency, values, "o-", label=name)
    ax.axhline(1.0, color="gray", linestyle="--", label="autoregressive")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (active rows)")
    ax.set_ylabel("speedup over autoregressive")
    ax.set_title(f"SmolLM2-135M-Instruct, T=1, top-p 0.95, {title}")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="drafts/smollm2-gsm8k-v8192")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--sweep-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds per concurrency in the sweep")
    parser.add_argument(
        "--plot", default="runs/controller_sweep.png", help="PNG of the sweep (the README's plots are under docs/)"
    )
    parser.add_argument("--skip-rollout", action="store_true")
    parser.add_argument(
        "--modes",
        default="static,paper,adaptive",
        help="modes compared with autoregressive decoding, by the start of their names (static, paper, adaptive)",
    )
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (on CPUs with bf16 matrix units)")
    args = parser.parse_args()
    record = Record("bench_controller")
    torch.set_num_threads(os.cpu_count())
    start = time.perf_counter()
    model, tokenizer = load_model("smollm2", dtype=args.dtype), load_tokenizer("smollm2")
    model.requires_grad_(False)
    draft = DraftHead.load(args.draft, model)
    probes = cost_probes([EaglePlugin()], model, None, Path(args.draft))
    profile = load_or_calibrate(model, "smollm2", probes)
    print(f"SmolLM2-135M-Instruct, {args.dtype}, {torch.get_num_threads()} threads; profile C_peak {profile.c_peak}")
    engines = make_engines(model, tokenizer, draft, eos_token_ids(model, tokenizer), profile.c_peak, profile)
    wanted = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    engines = {name: e for name, e in engines.items() if name == "autoregressive" or name.startswith(wanted)}
    if len(engines) == 1:
        raise SystemExit(f"--modes {args.modes!r} names no mode (static, paper, adaptive)")
    rows = load_gsm8k(GSM8K / "test.jsonl")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in rows[: max(concurrency + [args.prompts])]], 512)
    warm = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.95)
    for engine in engines.values():
        engine.generate(prompts[:2], warm)
    if not args.skip_rollout:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=0.95)
        rollout_table(engines, prompts[: args.prompts], params, args.num_generations, record)
    speedups = sweep_table(engines, prompts, concurrency, args.sweep_tokens, args.repeats, record)
    plot(concurrency, speedups, args.plot, args.dtype)
    record.notes["plot"] = args.plot
    record.save()
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
