"""Errors that stand for a mistake in what a run was given rather than a bug in fastgrpo: the command line reports
them (and ``ValueError`` and ``OSError``, which names the file the system refused) as a one-paragraph message,
without a traceback."""

from __future__ import annotations


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names the function and the first row it fails on."""


class EnvironmentFault(RuntimeError):
    """An environment's own code (its factory, ``reset``) failed during a run; the message names the environment and
    the completion."""


class RolloutFailed(Exception):
    """A rollout process (``rollout_processes``) failed or stayed silent past ``heartbeat_stale_after_s``, or they all
    ended before the run did; the message says which and the checkpoint to resume from. Not a ``RuntimeError``: a
    checkpoint's write does not take it for a full disk."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what ``kill`` and job schedulers send) received by a ``fastgrpo`` command: it unwinds as Ctrl-C does,
    so that what is half written is removed, and the command exits with 143."""


def interruption(e: KeyboardInterrupt) -> str:
    """How a command was stopped, in the words its last line uses."""
    return "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"


def exit_code(e: KeyboardInterrupt) -> int:
    """The shell's code for a process ended by the signal: 128 + 15 for SIGTERM, 128 + 2 for Ctrl-C (SIGINT)."""
    return 143 if isinstance(e, Terminated) else 130
