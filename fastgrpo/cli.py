"""Command line: ``fastgrpo train | generate | eval | report | profile | draft train``.

Every command but ``report`` reads its options into dataclasses (`fastgrpo.config.commands.COMMANDS`; an option
two commands share is one field with one default) from a YAML ``--config`` and ``--name value`` overrides (nested ones
as ``--dataset.name gsm8k``); everything is validated before a model loads. torch and transformers are imported by
the commands that use them, so that ``fastgrpo --help`` answers at once.

The commands that run a model set one process-wide thing first: glibc keeps freed memory in the process
(`fastgrpo.malloc`); ``FASTGRPO_MALLOC=system`` turns that off.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from fastgrpo import commands
from fastgrpo.errors import (
    EnvironmentFault,
    RewardFunctionError,
    RolloutFailed,
    Terminated,
    exit_code,
    interruption,
)

OPTION_COMMANDS = ("train", "generate", "eval", "profile", "draft")  # the commands whose options are dataclasses


class _HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default (also where there is no help text); flags and options whose help says what their
    default means are left as they are."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.nargs == 0 or "default" in text or action.default is argparse.SUPPRESS:
            return text
        return text + (" (default: none)" if action.default is None else " (default: %(default)s)")


def _add_options(parser: argparse.ArgumentParser, command: str) -> None:
    """List every option of ``command`` in ``parser``'s help (parsed as overrides of the YAML file, not by
    argparse)."""
    from fastgrpo.config.files import yaml_value
    from fastgrpo.config.reference import command_option_rows

    flags = "".join(f" [{a.option_strings[-1]}]" for a in parser._actions if a.nargs == 0 and a.dest != "help")
    parser.usage = f"%(prog)s [-h] [--config FILE]{flags} [--OPTION VALUE ...]"
    group = parser.add_argument_group(
        "config options",
        "each set in the --config file or as --name value (nested ones as --dataset.name value), which overrides "
        "the file; reference: docs/options.md",
    )
    for name, _, default, help_ in command_option_rows(command):
        value = yaml_value(default).replace("%", "%%")
        group.add_argument(f"--{name}", metavar="V", help=f"{help_.replace('%', '%%')} (default: {value})")


def _version() -> str:
    """The installed fastgrpo's version (read from its package metadata, without importing anything heavy)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fastgrpo")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(version unknown: not installed)"


def build_parser(options: str | None = None) -> argparse.ArgumentParser:
    """The command-line parser; ``options``: the command (``draft train`` for the subcommand) whose help lists every
    option it takes (that imports the option dataclasses, so only a help request asks for it)."""
    parser = argparse.ArgumentParser(
        prog="fastgrpo",
        description="GRPO fine-tuning of language models with lossless speculative rollouts. "
        "`fastgrpo COMMAND --help` lists a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"fastgrpo {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    parsers: dict[str, argparse.ArgumentParser] = {}

    def command(
        name: str, help_: str, func: object, parent: argparse._SubParsersAction = sub, full_name: str = ""
    ) -> argparse.ArgumentParser:
        p = parsers[full_name or name] = parent.add_parser(
            name, help=help_, description=help_, formatter_class=_HelpFormatter
        )
        p.set_defaults(func=func)
        if name != "report":
            p.add_argument(
                "--config",
                metavar="FILE",
                default=argparse.SUPPRESS if options else None,  # no "(default: none)" in the help
                help="YAML file of options (any of the config options below; the command line overrides it)",
            )
        return p

    train = command("train", "GRPO training of a model on a dataset", commands.train)
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="check the options, read the model's config (no weights), print the estimated device memory per "
        "process and, on a GPU, whether it fits (and what would); then exit without training",
    )
    train.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="with --dry-run: plan for N processes, one GPU each (default: torchrun's WORLD_SIZE, or 1)",
    )
    command("generate", "sample completions for prompts", commands.generate)
    command("eval", "mean reward of a model or checkpoint on a dataset, one sample per prompt", commands.eval_command)
    rep = command("report", "plot a run's metrics, or several runs' overlaid", commands.report)
    rep.add_argument("run_dirs", nargs="+", help="run directories (output_dir of fastgrpo train)")
    rep.add_argument("--output", help="directory for the PNGs (default: RUN_DIR/report of the first run)")
    command(
        "profile",
        "measure forward latency against tokens per forward and find the verification capacity",
        commands.profile,
    )
    draft = sub.add_parser("draft", help="draft-model commands").add_subparsers(dest="draft_command", required=True)
    command(
        "train",
        "generate responses with the target for a dataset's prompts, then fit a draft head on them",
        commands.draft_train,
        parent=draft,
        full_name="draft train",
    )
    if options in parsers:
        _add_options(parsers[options], options)
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
    name = None
    if wants_help and argv and argv[0] in OPTION_COMMANDS:
        name = "draft train" if argv[:2] == ["draft", "train"] else argv[0]
    parser = build_parser(options=name)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command == "report":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command != "report":
            from fastgrpo.malloc import keep_freed_memory

            keep_freed_memory()  # a FASTGRPO_MALLOC it does not know is refused as an option is
        with sigterm_as_interrupt():
            args.func(args, rest)
    except (ValueError, OSError, RewardFunctionError, EnvironmentFault, RolloutFailed) as e:
        # OSError: a file or directory the system refused (missing, not permitted, a full disk), named by the error
        print(f"fastgrpo {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        print(f"fastgrpo {args.command}: {interruption(e)}", file=sys.stderr)
        sys.exit(exit_code(e))
