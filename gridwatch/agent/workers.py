"""Child processes the agent starts for work it must be able to stop: killed at their deadline,
with the request that started them, and with the agent itself."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildResult:
    """What a finished child left: exit status and its output."""

    returncode: int
    stdout: bytes
    stderr: bytes


class ChildTimeout(TimeoutError):
    """The child ran past its deadline and was killed."""


def _load_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved once, in the agent: between fork and exec a dlopen could wait forever on a
# loader lock that another of the agent's threads held at the fork.
_PRCTL = _load_prctl()


def _die_with_parent() -> None:
    # Runs in the child between fork and exec. An agent killed with SIGKILL runs no
    # cleanup at all; the kernel then kills its workers for it.
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


async def _drain(stream: asyncio.StreamReader | None) -> None:
    while stream is not None and await stream.read(1 << 16):
        pass


async def _reap(proc: asyncio.subprocess.Process) -> None:
    # Read what the dead child left in its pipes first: a pipe whose reader was paused
    # (a full buffer nobody reads after a cancelled communicate) never reports its EOF,
    # and asyncio's wait() waits for every pipe to close, so it would wait forever.
    try:
        await asyncio.wait_for(asyncio.gather(_drain(proc.stdout), _drain(proc.stderr)), 5.0)
    except (TimeoutError, OSError):
        pass
    await proc.wait()


async def run_child(argv: list[str], stdin: bytes | None, timeout: float, env: dict[str, str] | None = None) -> ChildResult:
    """Run ``argv`` to completion within ``timeout`` seconds; the child never outlives this call.

    Raises :class:`ChildTimeout` after killing a child that ran too long; a
    cancelled caller kills the child too.
    """
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=_die_with_parent,
        process_group=0,  # a group of its own, so killing it also kills anything it started
        env=env,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
    except TimeoutError:
        _kill(proc)
        await _reap(proc)
        raise ChildTimeout(f"did not finish within {timeout:g} s") from None
    except BaseException:
        _kill(proc)
        # Reap it, even while being cancelled, so no zombie is left behind.
        await asyncio.shield(_reap(proc))
        raise
    return ChildResult(proc.returncode if proc.returncode is not None else -1, out, err)
