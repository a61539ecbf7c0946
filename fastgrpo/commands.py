"""What each ``fastgrpo`` command does (`fastgrpo.cli` parses the command line and calls one of these). torch and
transformers are imported inside the commands, so that ``--help`` answers at once."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastgrpo.config import GRPOConfig


def train(args: argparse.Namespace, overrides: list[str]) -> None:
    from fastgrpo.config import load_config

    config = load_config(args.config, overrides)
    if getattr(args, "dry_run", False):
        from fastgrpo.memory_plan import dry_run

        print(dry_run(config))
        return
    from fastgrpo import distributed
    from fastgrpo.grpo.checkpoint import latest_checkpoint
    from fastgrpo.grpo.trainer import GRPOTrainer

    try:
        trainer = GRPOTrainer(config, resume=args.resume)
        history = trainer.train()
    except KeyboardInterrupt as e:
        from fastgrpo.errors import exit_code, interruption

        latest = latest_checkpoint(Path(config.output_dir))
        kept = f"the latest checkpoint is {latest}; add --resume to continue from it" if latest else "no checkpoint yet"
        print(f"fastgrpo train: {interruption(e)}; {kept}", file=sys.stderr)
        sys.exit(exit_code(e))
    finally:
        distributed.shutdown()
    if history and trainer.dist.is_main:
        last = history[-5:]
        mean = sum(m["reward"] for m in last) / len(last)
        print(
            f"done: {len(history)} steps, mean reward of the last {len(last)}: {mean:.3f}; run in {config.output_dir}"
        )


def read_prompts(args: argparse.Namespace) -> list[list[dict]]:
    """The chat prompts of ``--prompt`` and ``--prompts_file``, each checked as a dataset's prompt is; an error names
    the option, or the file and line."""
    from fastgrpo.data.prompts import prompt_problem
    from fastgrpo.paths import read_lines

    given: list[tuple[str, object]] = [(f"--prompt {n}", p) for n, p in enumerate(args.prompt, 1)]
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"--prompts_file: {path} is not a file")
        for n, line in read_lines(path):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            where = f"{path} line {n}"
            if path.suffix == ".jsonl":
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
                if not isinstance(row, dict) or "prompt" not in row:
                    raise ValueError(f"{where}: expected an object with a 'prompt' column, got {_shown(row)}")
                given.append((f"{where}: 'prompt'", row["prompt"]))
            else:
                given.append((where, line))
    if not given:
        raise ValueError("give at least one --prompt or a --prompts_file")
    prompts = []
    for where, prompt in given:
        problem = prompt_problem(prompt)
        if problem is not None:
            raise ValueError(f"{where} {problem}")
        prompts.append([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)
    return prompts


def _shown(value: object, limit: int = 60) -> str:
    """A JSON value as a message shows it: its type and its start."""
    text = json.dumps(value)
    return f"{type(value).__name__} {text[:limit]}{'...' if len(text) > limit else ''}"


def generate(args: argparse.Namespace, overrides: list[str]) -> None:
    for option in ("num_generations", "max_prompt_length"):
        if getattr(args, option) < 1:
            raise ValueError(f"--{option} must be >= 1, got {getattr(args, option)}")
    if not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be in [0, 2**63), got {args.seed}")
    import torch

    from fastgrpo.distributed import resolve_device
    from fastgrpo.models import (
        check_cache_dir,
        check_model_source,
        encode_prompts,
        eos_token_ids,
        load_model,
        load_tokenizer,
    )
    from fastgrpo.paths import check_writable_file
    from fastgrpo.rollout.engine import RolloutEngine
    from fastgrpo.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
        )
    except ValueError as e:
        raise ValueError(f"--{str(e).replace('max_new_tokens', 'max_completion_length')}") from None
    check_model_source(args.model, "--model")
    device = resolve_device(args.device)
    prompts = read_prompts(args)
    if args.output:
        check_writable_file(args.output, "--output")
    check_cache_dir()
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=args.dtype, device=device)
    engine = RolloutEngine(model, eos_token_ids(model, tokenizer), tokenizer)
    ids = encode_prompts(tokenizer, prompts, max_prompt_length=args.max_prompt_length)
    generator = torch.Generator(device="cpu").manual_seed(args.seed)
    out = engine.generate(ids, params, num_generations=args.num_generations, generator=generator)
    texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    output = Path(args.output).expanduser() if args.output else None
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
    sink = open(output, "w", encoding="utf-8") if output else None  # noqa: SIM115
    for i, text in enumerate(texts):
        prompt = prompts[i // args.num_generations]
        if sink:
            sink.write(json.dumps({"prompt": prompt, "completion": text}) + "\n")
        else:
            print(f"--- {prompt[-1]['content']}\n{text.strip()}\n")
    if sink:
        sink.close()
    s = out.stats
    print(
        f"{s.tokens_emitted} tokens in {s.total_time:.2f}s ({s.tokens_per_second:.1f} tokens/s)",
        file=sys.stderr,
    )


def evaluate(config: GRPOConfig, batch_size: int) -> dict[str, float]:
    """Mean reward (accuracy for 0/1 rewards) of ``config.model`` on ``config.dataset``, one sample per prompt."""
    if batch_size < 1:
        raise ValueError(f"--batch_size must be >= 1, got {batch_size}")
    import torch
    from tqdm.auto import tqdm

    from fastgrpo.data import load_dataset
    from fastgrpo.distributed import resolve_device
    from fastgrpo.models import check_cache_dir, encode_prompts, eos_token_ids, load_model, load_tokenizer
    from fastgrpo.rewards import check_columns, compute_rewards, resolve_reward_funcs
    from fastgrpo.rollout.engine import RolloutEngine

    check_cache_dir()
    rows = load_dataset(config.dataset)
    funcs = resolve_reward_funcs(config.reward_funcs)
    check_columns(funcs, rows)
    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, dtype=config.dtype, device=resolve_device(config.device))
    engine = RolloutEngine(model, eos_token_ids(model, tokenizer), tokenizer)
    params = config.sampling_params()
    generator = torch.Generator(device="cpu").manual_seed(config.seed)
    total, n = 0.0, 0
    for start in tqdm(range(0, len(rows), batch_size), desc="eval"):
        part = rows[start : start + batch_size]
        ids = encode_prompts(tokenizer, [r["prompt"] for r in part], config.max_prompt_length)
        out = engine.generate(ids, params, generator=generator)
        texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        rewards, _ = compute_rewards(
            funcs, config.reward_weights, [r["prompt"] for r in part], texts, out.completion_ids, part
        )
        total += float(rewards.sum())
        n += len(part)
    return {"reward": total / n, "examples": n}


def eval_command(args: argparse.Namespace, overrides: list[str]) -> None:
    from fastgrpo.config.files import build_config, read_options

    values = read_options(args.config, overrides)
    dataset = values.get("dataset")
    dataset = dataset if isinstance(dataset, dict) else {}  # anything else is refused by build_config, naming it
    held_out = dataset.get("name", "arithmetic") == "arithmetic" and "split" not in dataset
    config = build_config(values, defaults={"dataset": {"split": "test"}} if held_out else None)
    if held_out:
        print(
            "eval: arithmetic questions of the test split, which training never draws (--dataset.split train for "
            "training's)",
            file=sys.stderr,
        )
    result = evaluate(config, args.batch_size)
    print(json.dumps({"model": config.model, "dataset": config.dataset.name, **result}))


def draft_train(args: argparse.Namespace, overrides: list[str]) -> None:
    if not 0.0 <= args.greedy_fraction <= 1.0:
        raise ValueError(f"--greedy_fraction must be in [0, 1], got {args.greedy_fraction}")
    if args.batch_size < 1:
        raise ValueError(f"--batch_size must be >= 1, got {args.batch_size}")
    if args.draft_vocab_size is not None and args.draft_vocab_size < 1:
        raise ValueError(f"--draft_vocab_size must be >= 1, got {args.draft_vocab_size}")
    from fastgrpo.config import load_config

    config = load_config(args.config, overrides)
    from fastgrpo.data import load_dataset
    from fastgrpo.distributed import resolve_device
    from fastgrpo.models import check_cache_dir, eos_token_ids, load_model, load_tokenizer
    from fastgrpo.paths import check_writable_dir
    from fastgrpo.rollout.engine import RolloutEngine
    from fastgrpo.speculative.eagle.offline import train_offline

    check_writable_dir(args.output, "--output")
    check_cache_dir()
    rows = load_dataset(config.dataset)
    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, dtype=config.dtype, device=resolve_device(config.device))
    model.requires_grad_(False)
    engine = RolloutEngine(model, eos_token_ids(model, tokenizer), tokenizer)
    draft, report = train_offline(
        engine,
        tokenizer,
        rows,
        config.sampling_params(),
        config.draft_training,
        target_name=config.model,
        batch_size=args.batch_size,
        max_prompt_length=config.max_prompt_length,
        draft_vocab_size=args.draft_vocab_size,
        greedy_fraction=args.greedy_fraction,
    )
    draft.save(args.output)
    print(json.dumps({"draft": args.output, **report}))


def parse_tokens(text: str) -> tuple[int, ...]:
    try:
        tokens = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise ValueError(f"--tokens must be comma-separated integers, got {text!r}") from None
    if min(tokens) < 1 or list(tokens) != sorted(set(tokens)):
        raise ValueError(f"--tokens must be increasing positive integers, got {text!r}")
    return tokens


def profile(args: argparse.Namespace, overrides: list[str]) -> None:
    tokens = parse_tokens(args.tokens)
    if args.repeats < 1 or args.context_length < 2:
        raise ValueError("--repeats must be >= 1 and --context_length >= 2")
    if args.draft is not None and not Path(args.draft).is_dir():
        raise ValueError(f"--draft: {args.draft} is not a directory with a saved draft")
    from fastgrpo.distributed import resolve_device
    from fastgrpo.models import check_cache_dir, check_model_source, load_model
    from fastgrpo.paths import check_writable_file
    from fastgrpo.report import plot_profile
    from fastgrpo.rollout.compiled import compile_backend
    from fastgrpo.speculative import profiler
    from fastgrpo.speculative.eagle.head import DraftHead

    check_model_source(args.model, "--model")
    check_cache_dir()
    if args.output:
        check_writable_file(args.output, "--output")
    device = resolve_device(args.device)
    backend = compile_backend(args.compile, device)
    model = load_model(args.model, dtype=args.dtype, device=device)
    model.requires_grad_(False)
    draft = DraftHead.load(args.draft, model) if args.draft else None
    profile = profiler.measure(
        model, draft, args.model, tokens, args.context_length, args.repeats, progress=True, compile=backend
    )
    param = next(model.parameters())
    path = profile.save(args.output or profiler.profile_path(args.model, param.device, param.dtype, compile=backend))
    png = plot_profile(profile, path.with_suffix(".png"))
    print(f"{profile.model} on {profile.device}, {profile.dtype}, context {profile.context_length}")
    print("| tokens | target forward ms | ms per token | draft level ms |")
    print("|---|---|---|---|")
    for t, target, draft_s in zip(profile.tokens, profile.target_seconds, profile.draft_seconds, strict=True):
        print(f"| {t} | {1e3 * target:.1f} | {1e3 * target / t:.2f} | {1e3 * draft_s:.1f} |")
    if profile.tree_rows:
        print("\nTarget forward over rows x N tokens per row, as a multiple of one token per row:")
        print("| rows | one token ms | " + " | ".join(f"N={n}" for n in profile.tree_nodes) + " |")
        print("|---|---|" + "---|" * len(profile.tree_nodes))
        for rows, seconds in zip(profile.tree_rows, profile.tree_seconds, strict=True):
            one = profile.target_time(rows)
            cells = ["" if s is None else f"{s / one:.2f}" for s in seconds]
            print(f"| {rows} | {1e3 * one:.1f} | " + " | ".join(cells) + " |")
    print(f"C_peak = {profile.c_peak} tokens; profile {path}; plot {png}")


def report(args: argparse.Namespace, overrides: list[str]) -> None:
    from fastgrpo.paths import check_writable_dir
    from fastgrpo.report import plot_runs, read_metrics, summary

    runs = {}
    for run_dir in args.run_dirs:
        name = Path(run_dir).name if Path(run_dir).name not in runs else str(run_dir)
        runs[name] = read_metrics(run_dir)
    output = args.output or Path(args.run_dirs[0]) / "report"
    check_writable_dir(output, "--output")
    paths = plot_runs(runs, output)
    print(summary(runs))
    print("plots: " + ", ".join(map(str, paths)))
