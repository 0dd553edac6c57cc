"""When a local process ended, read from the kernel rather than guessed from when it last answered.

A pidfd (Linux 5.3+) becomes readable the moment its process exits, child of ours or not; the event loop
wakes on it and the wall-clock time then is the exit's, within the loop's own latency. Where pidfds are
not to be had (another OS, an old kernel, a seccomp profile that forbids them, a pid in another pid
namespace) nothing is recorded and the caller keeps its own bound.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from loguru import logger

KEPT_EXITS = 8  # the previous life or two is all a restart asks about; older exits are dropped


class ExitWatch:
    """Watches pids and keeps when each one exited (epoch seconds)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._fds: dict[int, int] = {}  # pid -> its pidfd, while it lives
        self._exited: dict[int, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.unavailable = ""  # why pidfds cannot be used here, once found out

    def watch(self, pid: int) -> bool:
        """Start watching ``pid`` (idempotent); False when it cannot be watched (no running loop, no pidfds,
        the process is already gone)."""
        if pid in self._fds or pid in self._exited:
            return True
        if self.unavailable or not hasattr(os, "pidfd_open"):
            self.unavailable = self.unavailable or "os.pidfd_open is not available"
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError as exc:  # ENOSYS, EPERM under a seccomp profile: the caller keeps its own bound
            self.unavailable = f"pidfd_open: {exc.strerror or exc}"
            logger.info("process exits are dated from the last answer: {}", self.unavailable)
            return False
        try:
            loop.add_reader(fd, self._ended, pid)
        except (NotImplementedError, ValueError, OSError) as exc:  # an event loop without add_reader
            os.close(fd)
            self.unavailable = f"the event loop cannot wait on a pidfd: {exc}"
            return False
        self._loop = loop
        self._fds[pid] = fd
        return True

    def exited_at(self, pid: int | None) -> float | None:
        """When ``pid`` exited, if it was watched and has."""
        return self._exited.get(pid) if pid is not None else None

    def _ended(self, pid: int) -> None:
        self._exited[pid] = self.clock()
        self._forget(pid)
        while len(self._exited) > KEPT_EXITS:
            del self._exited[next(iter(self._exited))]

    def _forget(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(fd)
        os.close(fd)

    def close(self) -> None:
        """Stop watching everything (the agent is stopping)."""
        for pid in list(self._fds):
            self._forget(pid)
