"""Errors that stand for a mistake in what a run was given rather than a bug in fastgrpo: the command line reports
them (and ``ValueError``, ``FileNotFoundError``) as a one-paragraph message, without a traceback."""

from __future__ import annotations


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names the function and the first row it fails on."""
