"""Command line: ``fastgrpo train | generate | eval | report | profile | draft train``.

``train``, ``eval`` and ``draft train`` take a YAML config (``--config``) and any option as ``--name value`` (nested
ones as ``--dataset.name gsm8k``); everything is validated before a model loads. torch and transformers are imported
by the commands that use them, so that ``--help`` answers at once.

The commands that run a model set one process-wide thing first: glibc keeps freed memory in the process
(`fastgrpo.rollout.allocator`); ``FASTGRPO_MALLOC=system`` turns that off.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from fastgrpo import commands
from fastgrpo.errors import RewardFunctionError, Terminated, exit_code, interruption

PROFILE_TOKENS = "1,2,3,4,6,8,12,16,24,32,48,64,96,128,192,256"
CONFIG_COMMANDS = ("train", "eval", "draft")  # the commands whose options come from the config


class _HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default (also where there is no help text); flags and options whose help says what their
    default means are left as they are."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.nargs == 0 or "default" in text or action.default is argparse.SUPPRESS:
            return text
        return text + (" (default: none)" if action.default is None else " (default: %(default)s)")


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    """List every config option in ``parser``'s help (parsed as overrides of the YAML file, not by argparse)."""
    from fastgrpo.config import option_rows, yaml_value

    parser.usage = "%(prog)s [-h] [--config FILE] [command options] [--OPTION VALUE ...]"
    group = parser.add_argument_group(
        "config options",
        "any option of the config file, set or overridden as --name value (nested ones as --dataset.name value); "
        "reference: docs/options.md",
    )
    for name, _, default, help_ in option_rows():
        value = yaml_value(default).replace("%", "%%")
        group.add_argument(f"--{name}", metavar="V", help=f"{help_.replace('%', '%%')} (default: {value})")


def build_parser(config_options: bool = False) -> argparse.ArgumentParser:
    """The command-line parser; ``config_options`` lists every config option in the help of the commands that read
    a config (it imports the config module, so only a help request builds it)."""
    parser = argparse.ArgumentParser(
        prog="fastgrpo",
        description="GRPO fine-tuning of language models with lossless speculative rollouts. "
        "`fastgrpo COMMAND --help` lists a command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_: str, parent: argparse._SubParsersAction = sub) -> argparse.ArgumentParser:
        return parent.add_parser(name, help=help_, description=help_, formatter_class=_HelpFormatter)

    train = command("train", "GRPO training of a model on a dataset")
    train.add_argument("--config", help="YAML config file (every option below can be set there)")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="check the options, read the model's config (no weights), print the estimated device memory per "
        "process and, on a GPU, whether it fits; then exit without training",
    )
    train.set_defaults(func=commands.train)

    gen = command("generate", "sample completions for prompts")
    gen.add_argument("--model", default="smollm2", help="a model directory, a hub id, or the embedded smollm2")
    gen.add_argument("--dtype", default="auto", help="auto (bfloat16 on a GPU, float32 on CPU) or a dtype")
    gen.add_argument("--device", default="auto", help="auto (a GPU if there is one), cpu or cuda")
    gen.add_argument("--prompt", action="append", default=[], help="a user message (repeatable)")
    gen.add_argument(
        "--prompts_file", "--prompts-file", help=".txt (one prompt per line) or .jsonl with a 'prompt' column"
    )
    gen.add_argument(
        "--max_completion_length", "--max-new-tokens", type=int, default=256, help="new tokens per completion at most"
    )
    gen.add_argument("--max_prompt_length", type=int, default=4096, help="longer prompts keep their last tokens")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top_p", "--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top_k", "--top-k", type=int, default=0, help="0: no top-k")
    gen.add_argument("--min_p", type=float, default=0.0, help="0: no min-p")
    gen.add_argument("--num_generations", "--num-generations", type=int, default=1, help="completions per prompt")
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    gen.add_argument("--output", help="a JSONL file to write (default: print to the terminal)")
    gen.set_defaults(func=commands.generate)

    ev = command("eval", "mean reward of a model or checkpoint on a dataset, one sample per prompt")
    ev.add_argument(
        "--config", help="YAML config file (model, dataset, reward_funcs, sampling); options below override it"
    )
    ev.add_argument("--batch_size", "--batch-size", type=int, default=32, help="prompts generated at once")
    ev.set_defaults(func=commands.eval_command)

    rep = command("report", "plot a run's metrics, or several runs' overlaid")
    rep.add_argument("run_dirs", nargs="+", help="run directories (output_dir of fastgrpo train)")
    rep.add_argument("--output", help="directory for the PNGs (default: RUN_DIR/report of the first run)")
    rep.set_defaults(func=commands.report)

    prof = command("profile", "measure forward latency against tokens per forward and find the verification capacity")
    prof.add_argument("--model", default="smollm2", help="a model directory, a hub id, or the embedded smollm2")
    prof.add_argument("--dtype", default="auto", help="auto (bfloat16 on a GPU, float32 on CPU) or a dtype")
    prof.add_argument("--device", default="auto", help="auto (a GPU if there is one), cpu or cuda")
    prof.add_argument(
        "--speculation.draft",
        "--draft",
        dest="draft",
        help="a saved draft to time (default: a fresh draft of the same architecture)",
    )
    prof.add_argument("--tokens", default=PROFILE_TOKENS, help="token counts to time")
    prof.add_argument(
        "--context_length", "--context-length", type=int, default=256, help="cached tokens each row attends to"
    )
    prof.add_argument("--repeats", type=int, default=9, help="rounds timing every token count once (median)")
    prof.add_argument(
        "--compile",
        default="auto",
        help="auto, on or off: time the forwards compiled, as training's `compile` option runs them (auto: on a GPU)",
    )
    prof.add_argument(
        "--output", help="JSON file to write (default: the profile cache, where training finds it), a plot beside it"
    )
    prof.set_defaults(func=commands.profile)

    draft = sub.add_parser("draft", help="draft-model commands").add_subparsers(dest="draft_command", required=True)
    dt = command(
        "train",
        "generate responses with the target for a dataset's prompts, then fit a draft head on them",
        parent=draft,
    )
    dt.add_argument(
        "--config", help="YAML config file (model, dataset, sampling, draft_training); options below override it"
    )
    dt.add_argument("--output", required=True, help="directory to save the draft in")
    dt.add_argument("--batch_size", "--batch-size", type=int, default=32, help="prompts generated at once")
    dt.add_argument(
        "--draft_vocab_size",
        "--draft-vocab-size",
        type=int,
        help="reduced draft vocabulary, the most frequent tokens (default: the model's whole vocabulary)",
    )
    dt.add_argument(
        "--greedy_fraction",
        "--greedy-fraction",
        type=float,
        default=0.0,
        help="share of the prompts answered greedily; the rest are sampled with the config's sampling options",
    )
    dt.set_defaults(func=commands.draft_train)
    if config_options:
        for p in (train, ev, dt):
            _add_config_options(p)
    return parser


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block, SIGTERM raises `Terminated` (a KeyboardInterrupt) in the main thread; the previous handler
    is restored after it."""
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    wants_help = any(a in ("-h", "--help") for a in argv)
    parser = build_parser(config_options=wants_help and bool(argv) and argv[0] in CONFIG_COMMANDS)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command in ("generate", "report", "profile"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command != "report":
        from fastgrpo.rollout.allocator import keep_freed_memory

        keep_freed_memory()
    try:
        with sigterm_as_interrupt():
            args.func(args, rest)
    except (ValueError, OSError, RewardFunctionError) as e:
        # OSError: a file or directory the system refused (missing, not permitted, a full disk), named by the error
        print(f"fastgrpo {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        print(f"fastgrpo {args.command}: {interruption(e)}", file=sys.stderr)
        sys.exit(exit_code(e))
