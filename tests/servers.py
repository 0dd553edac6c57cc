"""Start a real server from Debian's packages for a test, wait until it answers, and always stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import wait_until_sync


def http_ok(url: str) -> bool:
    """Whether ``url`` answers 200 now (a readiness or health endpoint)."""
    try:
        with urllib.request.urlopen(url, timeout=1) as response:  # noqa: S310 - loopback
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def served(argv: list[str], log: Path, ready_url: str, timeout: float) -> Iterator[subprocess.Popen[bytes] | None]:
    """``argv`` running with its output in ``log`` once ``ready_url`` answers; None if it exits or never answers.

    However the block ends, the server is continued (a test may have stopped it), terminated and reaped.
    """
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            wait_until_sync(lambda: http_ok(ready_url) or proc.poll() is not None, timeout, "the server ready")
        except AssertionError:
            pass  # never ready: said below as None
        yield proc if proc.poll() is None and http_ok(ready_url) else None
    finally:
        try:
            os.kill(proc.pid, signal.SIGCONT)
        except OSError:
            pass
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def log_tail(log: Path, chars: int = 300) -> str:
    """The end of a server's log, for a one-line reason why it did not start."""
    try:
        return log.read_text(errors="replace")[-chars:].strip() or "no output"
    except OSError:
        return "no output"
