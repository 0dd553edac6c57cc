"""The exit codes every ``gridwatch`` command returns, so scripts can rely on them (imports nothing)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """0: done and all good; 1: it ran and found a failure; 2: it could not run."""

    OK = 0
    FAILED = 1  # the command ran and found a failure (a check failed, a node is bad)
    ERROR = 2  # the command could not run (bad usage, bad config, unreachable)


EXIT_OK, EXIT_FAILED, EXIT_ERROR = ExitCode.OK, ExitCode.FAILED, ExitCode.ERROR
