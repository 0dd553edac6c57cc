"""The agent's own footprint, as every sample carries it: CPU % of one core since the last sample, and resident memory."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from gridwatch.agent.sources.procfs import ProcFile


class Footprint:
    """What the agent itself costs, read each tick for the sample's ``agent`` part (``top``'s %CPU and RES).

    The figures are psutil's ``Process.cpu_percent()`` and ``memory_info().rss``,
    read more cheaply: CPU from ``os.times()`` (one system call: the user and
    system time of all the agent's threads, not its children's), memory from
    ``/proc/self/statm`` held open. psutil's pair parsed two /proc files a tick
    (about 30 µs, a twentieth of the whole tick).
    """

    def __init__(
        self,
        monotonic: Callable[[], float] = time.monotonic,
        times: Callable[[], os.times_result] = os.times,
        statm: str = "/proc/self/statm",
    ) -> None:
        self._monotonic = monotonic
        self._times = times
        self._statm = ProcFile(statm, whole=True)
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._last_t = monotonic()
        self._last_cpu = self._cpu_s()

    def _cpu_s(self) -> float:
        t = self._times()
        return t.user + t.system

    def cpu_percent(self) -> float:
        """% of one core the agent used since the last call (or since it started), to 0.1; 0.0 when no time passed."""
        now, cpu = self._monotonic(), self._cpu_s()
        dt, used = now - self._last_t, cpu - self._last_cpu
        self._last_t, self._last_cpu = now, cpu
        if dt <= 0:
            return 0.0  # as psutil: no interval to measure over
        return round(used / dt * 100.0, 1)

    def rss_mb(self) -> float | None:
        """Resident memory now, in MiB; None where ``/proc/self/statm`` cannot be read."""
        statm = self._statm.read()
        if statm is None:
            return None
        try:
            return int(statm.split(None, 2)[1]) * self._page / 2**20
        except (ValueError, IndexError):
            return None

    def close(self) -> None:
        self._statm.close()
