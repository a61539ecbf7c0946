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
    from fastgrpo.config.commands import GenerateOptions


def parse_command_options(command: str, args: argparse.Namespace, overrides: list[str]) -> tuple:
    """The option dataclasses of ``command`` (`fastgrpo.config.commands.COMMANDS`), from ``--config`` and the
    ``--name value`` overrides, validated."""
    from fastgrpo.config.commands import COMMANDS
    from fastgrpo.config.files import parse_options

    return parse_options(COMMANDS[command], args.config, overrides)


def train(args: argparse.Namespace, overrides: list[str]) -> None:
    from fastgrpo.config import load_config

    processes = getattr(args, "processes", None)
    if processes is not None and (processes < 1 or not args.dry_run):
        raise ValueError("--processes: a number of processes of at least 1, with --dry-run (torchrun sets a run's)")
    config = load_config(args.config, overrides)
    if getattr(args, "dry_run", False):
        from fastgrpo.memory_plan.fitting import dry_run

        print(dry_run(config, processes))
        return
    from fastgrpo import distributed
    from fastgrpo.grpo.checkpoint import latest_checkpoint
    from fastgrpo.grpo.trainer import GRPOTrainer

    try:
        trainer = GRPOTrainer(config, resume=args.resume)
        history, is_main = trainer.train(), trainer.dist.is_main
    except KeyboardInterrupt as e:
        from fastgrpo.errors import exit_code, interruption

        latest = latest_checkpoint(Path(config.output_dir))
        kept = f"the latest checkpoint is {latest}; add --resume to continue from it" if latest else "no checkpoint yet"
        print(f"fastgrpo train: {interruption(e)}; {kept}", file=sys.stderr)
        sys.exit(exit_code(e))
    finally:
        trainer = None  # freed while the process group is up (`distributed.shutdown`)
        distributed.shutdown()
    if history and is_main:
        last = [m["reward"] for m in history if "reward" in m][-5:]  # of the steps that generated
        mean = sum(last) / len(last) if last else float("nan")
        print(
            f"done: {len(history)} steps, mean reward of the last {len(last)}: {mean:.3f}; run in {config.output_dir}"
        )


def read_prompts(args: GenerateOptions) -> list[list[dict]]:
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
    (opts,) = parse_command_options("generate", args, overrides)
    import torch

    from fastgrpo.distributed import resolve_device
    from fastgrpo.memory_plan.fitting import check_sequence_length, read_model_config
    from fastgrpo.models import (
        check_cache_dir,
        check_model_source,
        encode_prompts,
        eos_token_ids,
        load_model,
        load_tokenizer,
    )
    from fastgrpo.paths import check_not_an_input, check_writable_file
    from fastgrpo.rollout.engine import RolloutEngine

    params = opts.sampling_params()
    check_model_source(opts.model, "--model")
    device = resolve_device(opts.device)
    prompts = read_prompts(opts)
    if opts.output:
        check_writable_file(opts.output, "--output")
        inputs = {"--prompts_file": opts.prompts_file, "--config": args.config, "--model": opts.model}
        check_not_an_input(opts.output, "--output", inputs)
    check_cache_dir()
    check_sequence_length(read_model_config(opts.model), opts.max_prompt_length, opts.max_completion_length)
    tokenizer = load_tokenizer(opts.model)
    model = load_model(opts.model, dtype=opts.dtype, device=device)
    engine = RolloutEngine(model, eos_token_ids(model, tokenizer), tokenizer)
    ids = encode_prompts(tokenizer, prompts, max_prompt_length=opts.max_prompt_length)
    generator = torch.Generator(device="cpu").manual_seed(opts.seed)
    out = engine.generate(ids, params, num_generations=opts.num_generations, generator=generator)
    texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    output = Path(opts.output) if opts.output else None
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
    sink = open(output, "w", encoding="utf-8") if output else None  # noqa: SIM115
    for i, text in enumerate(texts):
        prompt = prompts[i // opts.num_generations]
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
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if config.tools or config.environment_factory:
        raise ValueError(
            "fastgrpo eval generates without tools: to evaluate with tools or environment_factory, evaluate during "
            "training (eval_strategy: steps, with an eval_dataset)"
        )
    import torch
    from tqdm.auto import tqdm

    from fastgrpo.data import load_dataset
    from fastgrpo.distributed import resolve_device
    from fastgrpo.models import (
        check_cache_dir,
        check_tokenizer_files,
        encode_prompts,
        eos_token_ids,
        load_model,
        load_tokenizer,
    )
    from fastgrpo.reward_model import load_reward_models
    from fastgrpo.rewards import check_columns, compute_rewards, resolve_reward_funcs
    from fastgrpo.rollout.engine import RolloutEngine

    check_tokenizer_files(config.model)
    check_cache_dir()
    rows = load_dataset(config.dataset)
    funcs = resolve_reward_funcs(config.reward_funcs)
    check_columns(funcs, rows)
    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, dtype=config.dtype, device=resolve_device(config.device))
    load_reward_models(funcs, model.device, config.dtype, config.chat_template_kwargs)
    engine = RolloutEngine(model, eos_token_ids(model, tokenizer), tokenizer)
    params = config.sampling_params()
    generator = torch.Generator(device="cpu").manual_seed(config.seed)
    total, n = 0.0, 0
    for start in tqdm(range(0, len(rows), batch_size), desc="eval"):
        part = rows[start : start + batch_size]
        ids = encode_prompts(tokenizer, [r["prompt"] for r in part], config.max_prompt_length)
        out = engine.generate(ids, params, generator=generator)
        texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        prompts = [r["prompt"] for r in part]
        rewards, _ = compute_rewards(
            funcs, config.reward_weights, prompts, texts, out.completion_ids, part, timeout=config.reward_timeout
        )
        total += float(rewards.nansum())  # a completion no function scores counts 0, as before
        n += len(part)
    return {"reward": total / n, "examples": n}


def eval_command(args: argparse.Namespace, overrides: list[str]) -> None:
    from fastgrpo.config.commands import COMMANDS
    from fastgrpo.config.files import build_options, read_options

    values = read_options(args.config, overrides, COMMANDS["eval"])
    # eval samples one completion per prompt, in batches of batch_size: training's group and batch are not used
    unused = {
        k: values.pop(k)
        for k in (
            "num_generations",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "steps_per_generation",
            "generation_batch_size",
        )
        if k in values
    }
    if "num_generations" in unused:
        print(
            f"eval: num_generations ({unused['num_generations']}) is not used: eval samples one completion per prompt",
            file=sys.stderr,
        )
    dataset = values.get("dataset")
    dataset = dataset if isinstance(dataset, dict) else {}  # anything else is refused by build_options, naming it
    held_out = dataset.get("name", "arithmetic") == "arithmetic" and "split" not in dataset
    defaults = {"dataset": {"split": "test"}} if held_out else None
    opts, config = build_options(COMMANDS["eval"], values, defaults)
    from fastgrpo.memory_plan.fitting import check_sequence_length, read_model_config
    from fastgrpo.models import check_cache_dir

    check_cache_dir()  # before the embedded model is converted to read its config
    check_sequence_length(read_model_config(config.model), config.max_prompt_length, config.max_completion_length)
    if held_out:
        print(
            "eval: arithmetic questions of the test split, which training never draws (--dataset.split train for "
            "training's)",
            file=sys.stderr,
        )
    result = evaluate(config, opts.batch_size)
    print(json.dumps({"model": config.model, "dataset": config.dataset.name, **result}))


def draft_train(args: argparse.Namespace, overrides: list[str]) -> None:
    opts, config = parse_command_options("draft train", args, overrides)
    if config.tools or config.environment_factory:
        raise ValueError(
            "fastgrpo draft train generates without tools, so its draft would learn from completions unlike a tools "
            "run's: remove tools and environment_factory, or let the draft learn online during training "
            "(draft_training.online)"
        )
    from fastgrpo.data import load_dataset
    from fastgrpo.distributed import resolve_device
    from fastgrpo.memory_plan.fitting import check_sequence_length, read_model_config
    from fastgrpo.models import (
        DTYPES,
        check_cache_dir,
        check_tokenizer_files,
        eos_token_ids,
        load_model,
        load_tokenizer,
        resolve_dtype,
    )
    from fastgrpo.paths import check_free_space, check_not_an_input, check_writable_dir
    from fastgrpo.rollout.engine import RolloutEngine
    from fastgrpo.speculative.eagle.memory import draft_file_bytes
    from fastgrpo.speculative.eagle.offline import train_offline

    check_writable_dir(opts.output, "--output")
    inputs = {"model": config.model, "--config": args.config, "dataset.name": config.dataset.name}
    check_not_an_input(opts.output, "--output", {**inputs, "dataset.path": config.dataset.path})
    check_tokenizer_files(config.model)
    check_cache_dir()
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model_config = read_model_config(config.model)
    check_sequence_length(model_config, config.max_prompt_length, config.max_completion_length)
    needed = draft_file_bytes(model_config, DTYPES[dtype].itemsize, config.speculation.draft_vocab_size)
    check_free_space(opts.output, needed, "--output")  # before the fit: the draft is saved after it
    rows = load_dataset(config.dataset)
    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, dtype=config.dtype, device=device)
    model.requires_grad_(False)
    engine = RolloutEngine(model, eos_token_ids(model, tokenizer), tokenizer)
    draft, report = train_offline(
        engine,
        tokenizer,
        rows,
        config.sampling_params(),
        config.draft_training,
        target_name=config.model,
        batch_size=opts.batch_size,
        max_prompt_length=config.max_prompt_length,
        draft_vocab_size=config.speculation.draft_vocab_size,
        greedy_fraction=opts.greedy_fraction,
    )
    draft.save(opts.output)
    print(json.dumps({"draft": opts.output, **report}))


def profile(args: argparse.Namespace, overrides: list[str]) -> None:
    (opts,) = parse_command_options("profile", args, overrides)
    tokens = opts.token_counts()
    from fastgrpo.config.speculation import SpeculationConfig
    from fastgrpo.distributed import resolve_device
    from fastgrpo.models import check_cache_dir, check_model_source, load_model
    from fastgrpo.paths import check_not_an_input, check_writable_file
    from fastgrpo.report import plot_profile
    from fastgrpo.rollout.compiled import compile_backend
    from fastgrpo.speculative import profiler
    from fastgrpo.speculative.plugin import cost_probes
    from fastgrpo.speculative.registry import PLUGINS, check_speculation, drafter_names

    names = drafter_names(opts.speculation.drafter)
    # as train refuses them: a draft saved by none of the drafters timed, or whose files cannot be read
    check_speculation(SpeculationConfig(drafter=opts.speculation.drafter, draft=opts.draft))
    check_model_source(opts.model, "--model")
    check_cache_dir()
    if opts.output:
        check_writable_file(opts.output, "--output")
        inputs = {"--model": opts.model, "--config": args.config, "speculation.draft": opts.draft}
        for written in (opts.output, str(Path(opts.output).with_suffix(".png"))):
            check_not_an_input(written, "--output", inputs)
    device = resolve_device(opts.device)
    backend = compile_backend(opts.compile, device)
    model = load_model(opts.model, dtype=opts.dtype, device=device)
    model.requires_grad_(False)
    saved = Path(opts.draft) if opts.draft else None
    probes = cost_probes([PLUGINS[n] for n in names], model, backend, saved)
    profile = profiler.measure(
        model, opts.model, probes, tokens, opts.context_length, opts.repeats, progress=True, backend=backend
    )
    param = next(model.parameters())
    path = profile.save(opts.output or profiler.profile_path(opts.model, param.device, param.dtype, backend=backend))
    png = plot_profile(profile, path.with_suffix(".png"))
    print(f"{profile.model} on {profile.device}, {profile.dtype}, context {profile.context_length}")
    drafters = list(profile.drafter_seconds)
    print("| tokens | target forward ms | ms per token |" + "".join(f" {n} drafter ms |" for n in drafters))
    print("|---|---|---|" + "---|" * len(drafters))
    for i, (t, target) in enumerate(zip(profile.tokens, profile.target_seconds, strict=True)):
        cells = "".join(f" {1e3 * profile.drafter_seconds[n][i]:.1f} |" for n in drafters)
        print(f"| {t} | {1e3 * target:.1f} | {1e3 * target / t:.2f} |{cells}")
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
    from fastgrpo.paths import check_writable_dir, expand_user
    from fastgrpo.report import plot_runs, read_metrics, summary

    runs = {}
    run_dirs = [expand_user(run_dir, "report") for run_dir in args.run_dirs]
    for run_dir in run_dirs:
        name = Path(run_dir).name if Path(run_dir).name not in runs else str(run_dir)
        runs[name] = read_metrics(run_dir)
    output = expand_user(args.output, "--output") if args.output else Path(run_dirs[0]) / "report"
    check_writable_dir(output, "--output")
    paths = plot_runs(runs, output)
    print(summary(runs))
    print("plots: " + ", ".join(map(str, paths)))
