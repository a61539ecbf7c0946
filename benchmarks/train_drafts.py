"""Train the drafts the speculative benchmarks use: SmolLM2-135M-Instruct answers GSM8K train prompts (a share
greedily, the rest sampled at T=1, top-p 0.95), capturing its hidden states while it generates, and a draft with a
reduced vocabulary is fit on the responses (with ``--full-vocab``, a second one with the full vocabulary too, on the
same responses, so that the two can be compared).

    python benchmarks/train_drafts.py --prompts 1024 --output drafts

With ``--samples FILE``, the generated responses and hidden states are saved to FILE, or read from it when it exists
(made with the same ``--prompts``, ``--first-prompt``, ``--greedy-fraction`` and ``--max-new-tokens``), so that
fitting recipes can be compared without generating again. ``--extra-samples`` adds files saved that way (from other
prompts) to the training set, so a draft can be fit on more prompts without generating the earlier ones again:

    python benchmarks/train_drafts.py --prompts 1024 --samples runs/samples1024.pt ...
    python benchmarks/train_drafts.py --first-prompt 1024 --prompts 2048 --samples runs/samples1024-3071.pt \
        --extra-samples runs/samples1024.pt ...
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from record import Record

from fastgrpo.config import LR_SCHEDULERS, DraftTrainConfig
from fastgrpo.data import load_gsm8k
from fastgrpo.models import eos_token_ids, load_model, load_tokenizer
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.sampling_params import SamplingParams
from fastgrpo.speculative.eagle.offline import collect_mixed, fit_draft

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="drafts")
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--first-prompt", type=int, default=0, help="index of the first GSM8K train prompt to answer")
    parser.add_argument("--greedy-fraction", type=float, default=0.5)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--token-loss-weight", type=float, default=1.0)
    parser.add_argument(
        "--lr-scheduler", choices=LR_SCHEDULERS, default="constant", help="draft_training.lr_scheduler_type"
    )
    parser.add_argument("--warmup-ratio", type=float, default=0.0, help="draft_training.warmup_ratio")
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument(
        "--unroll", type=int, default=1, help="tree depths trained per position (draft_training.unroll)"
    )
    parser.add_argument("--full-vocab", action="store_true", help="also fit a draft with the full vocabulary")
    parser.add_argument(
        "--bf16", action="store_true", help="bfloat16 autocast (pays only on CPUs with bf16 units, e.g. AVX512-BF16)"
    )
    parser.add_argument(
        "--generate-dtype",
        default="float32",
        help="dtype the target generates the responses in (bfloat16 is faster on CPUs with bf16 units); the draft is "
        "fit in float32 either way",
    )
    parser.add_argument("--samples", type=Path, help="file to save the generated samples to, or to read them from")
    parser.add_argument(
        "--extra-samples", type=Path, nargs="*", default=[], help="more --samples files (other prompts) to fit on"
    )
    args = parser.parse_args()
    missing = [str(p) for p in args.extra_samples if not p.is_file()]
    if missing:
        raise SystemExit(f"--extra-samples: no such file: {', '.join(missing)}")
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2", dtype=args.generate_dtype), load_tokenizer("smollm2")
    model.requires_grad_(False)
    engine = RolloutEngine(model, eos_token_ids(model, tokenizer), tokenizer)
    recipe = {"prompts": args.prompts, "greedy_fraction": args.greedy_fraction, "max_new_tokens": args.max_new_tokens}
    if args.generate_dtype != "float32":  # files made before --generate-dtype existed were generated in float32
        recipe["generate_dtype"] = args.generate_dtype
    if args.first_prompt:  # files made before --first-prompt existed start at prompt 0 and do not name it
        recipe["first_prompt"] = args.first_prompt
    if args.samples and args.samples.is_file():
        saved = torch.load(args.samples, weights_only=False)
        if saved["recipe"] != recipe:
            raise SystemExit(f"--samples {args.samples} was made with {saved['recipe']}, not {recipe}")
        samples, generate_s = saved["samples"], saved["generate_seconds"]
    else:
        rows = load_gsm8k(GSM8K / "train.jsonl")[args.first_prompt : args.first_prompt + args.prompts]
        t0 = time.perf_counter()
        sampled = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=0.95)
        samples = collect_mixed(engine, tokenizer, rows, sampled, args.greedy_fraction, args.batch_size, 512, seed=1)
        generate_s = time.perf_counter() - t0
        if args.samples:
            torch.save({"recipe": recipe, "samples": samples, "generate_seconds": generate_s}, args.samples)
    for path in args.extra_samples:
        saved = torch.load(path, weights_only=False)
        other = {k: v for k, v in saved["recipe"].items() if k not in ("prompts", "first_prompt")}
        if other != {k: v for k, v in recipe.items() if k not in ("prompts", "first_prompt")}:
            raise SystemExit(f"--extra-samples {path} was made with {saved['recipe']}, not like {recipe}")
        samples, generate_s = samples + saved["samples"], generate_s + saved["generate_seconds"]
    model.float()  # the draft is fit in float32 (with --bf16, under bfloat16 autocast)
    tokens = sum(s.tokens.numel() - s.prompt_len for s in samples)
    print(json.dumps({"sequences": len(samples), "completion_tokens": tokens, "generate_seconds": generate_s}))
    config = DraftTrainConfig(
        learning_rate=args.lr,
        epochs=args.epochs,
        token_loss_weight=args.token_loss_weight,
        bf16=args.bf16,
        unroll=args.unroll,
        lr_scheduler_type=args.lr_scheduler,
        warmup_ratio=args.warmup_ratio,
    )
    record = Record("train_drafts")
    record.notes.update(sequences=len(samples), completion_tokens=tokens, generate_seconds=round(generate_s, 1))
    fitted = []
    vocabularies = {f"v{args.draft_vocab_size}": args.draft_vocab_size} | ({"full": None} if args.full_vocab else {})
    for name, size in vocabularies.items():
        torch.manual_seed(0)
        t1 = time.perf_counter()
        draft, fit = fit_draft(model, samples, config, "smollm2", engine.eos.tolist(), size)
        path = draft.save(Path(args.output) / f"smollm2-gsm8k-{name}")
        report = {
            "draft": str(path),
            "train_seconds": time.perf_counter() - t1,
            "last_loss": fit.losses[-1],
            "first_epoch_accuracy": fit.accuracy,
        }
        print(json.dumps(report), flush=True)
        fitted.append([str(path), f"{report['train_seconds']:.0f}", f"{fit.losses[-1]:.4f}", f"{fit.accuracy:.3f}"])
    record.table("Drafts fit", ["draft", "train s", "last loss", "first-epoch accuracy"], fitted)
    record.save()


if __name__ == "__main__":
    main()
