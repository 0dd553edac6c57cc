"""The host itself through psutil: CPU, memory, load, NICs, disk I/O and PSI pressure."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from loguru import logger

from gridwatch.agent.sources import Reading
from gridwatch.wire.protocol import HostSample, NicSample, Text

_MIB = 1024 * 1024
# Interfaces that carry no training traffic; watching them only adds rows.
_SKIP_NICS = ("lo",)


def _psi_some_avg10(path: Path) -> float | None:
    """``some avg10`` from a ``/proc/pressure/*`` file: % of the last 10 s some task stalled."""
    try:
        first = path.read_text().split("\n", 1)[0]
    except OSError:
        return None
    for part in first.split():
        if part.startswith("avg10="):
            try:
                return float(part[6:])
            except ValueError:
                return None
    return None


def _busy_percent(before: Any, after: Any) -> float | None:
    """Share of CPU time not idle (nor waiting on I/O) between two ``psutil.cpu_times()``."""
    def spent(t: Any) -> float:
        # Linux counts guest time inside user time too; psutil leaves it out the same way.
        return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    total = spent(after) - spent(before)
    if total <= 0:
        return None
    idle = (after.idle - before.idle) + (getattr(after, "iowait", 0.0) - getattr(before, "iowait", 0.0))
    return round(min(max(100.0 * (1.0 - idle / total), 0.0), 100.0), 1)


class _DiskStats:
    """Bytes read and written by whole disks, from ``/proc/diskstats``.

    psutil's disk_io_counters costs about 0.25 ms a call (it checks every
    partition against sysfs); the set of whole disks is listed once here.
    """

    def __init__(self, proc: Path, sys_block: Path) -> None:
        self._path = proc / "diskstats"
        try:
            self._disks = {d.name for d in sys_block.iterdir() if not d.name.startswith(("loop", "ram", "zram"))}
        except OSError:
            self._disks = set()

    def read(self) -> tuple[int, int] | None:
        if not self._disks:
            return None
        try:
            text = self._path.read_text()
        except OSError:
            return None
        read = written = 0
        for line in text.splitlines():
            parts = line.split()
            # major minor name reads merged sectors_read ms writes merged sectors_written ...
            if len(parts) > 9 and parts[2] in self._disks:
                read += int(parts[5]) * 512
                written += int(parts[9]) * 512
        return read, written


class HostSource:
    """Reads the host once per tick; rates come from counter deltas over ``clock``.

    The constructor takes the first counter readings, so the first ``sample()``
    already has rates (over the time since construction).
    """

    name = "host"
    blocking = True  # /proc and /sys reads can stall on a node under memory pressure
    # Link state and speed change rarely and cost an ioctl per NIC to read.
    NIC_STATS_EVERY = 10

    def __init__(self, clock: Callable[[], float] = time.monotonic, proc: str = "/proc", sys_root: str = "/sys") -> None:
        self._clock = clock
        self._disks = _DiskStats(Path(proc), Path(sys_root) / "block")
        self._nic_stats: dict[str, Any] = {}
        self._ticks = 0
        pressure = Path(proc) / "pressure"
        # Kernels before 4.20 (or with psi=0) have no pressure files: N/A for good.
        self._psi = {name: pressure / name for name in ("cpu", "memory", "io") if (pressure / name).exists()}
        # CPU % from our own cpu_times deltas: psutil.cpu_percent() keeps one
        # baseline per process, which any other caller would move under us.
        self._last_cpu = psutil.cpu_times()
        self._last_t = clock()
        self._last_nics = self._nic_counters()
        self._last_disk = self._disk_counters()

    @staticmethod
    def _nic_counters() -> dict[str, Any]:
        try:
            return psutil.net_io_counters(pernic=True)
        except (OSError, RuntimeError) as exc:
            logger.debug("NIC counters unavailable: {}", exc)
            return {}

    def _disk_counters(self) -> tuple[int, int] | None:
        return self._disks.read()

    def read(self) -> Reading:
        """The sampler's view of :meth:`sample`."""
        return Reading(host=self.sample())

    def sample(self) -> HostSample:
        """One reading of the host (``top``, ``free``, ``ip -s link``, ``iostat``, ``/proc/pressure``)."""
        now = self._clock()
        dt = now - self._last_t
        nics = self._nic_counters()
        disk = self._disk_counters()
        cpu = psutil.cpu_times()
        sample = HostSample(cpu_percent=_busy_percent(self._last_cpu, cpu))
        mem = psutil.virtual_memory()
        sample.mem_total_mb = mem.total / _MIB
        sample.mem_used_mb = (mem.total - mem.available) / _MIB
        try:
            sample.load1, sample.load5, sample.load15 = os.getloadavg()
        except OSError:
            pass
        sample.nics = self._nic_samples(nics, dt)
        if disk is not None and self._last_disk is not None and dt > 0:
            sample.disk_read_bps = max(disk[0] - self._last_disk[0], 0) / dt
            sample.disk_write_bps = max(disk[1] - self._last_disk[1], 0) / dt
        for name, path in self._psi.items():
            setattr(sample, f"psi_{name}", _psi_some_avg10(path))
        if dt > 0:
            self._last_t, self._last_nics, self._last_disk = now, nics, disk
        self._last_cpu = cpu
        return sample

    def _nic_samples(self, counters: dict[str, Any], dt: float) -> list[NicSample]:
        if self._ticks % self.NIC_STATS_EVERY == 0:
            try:
                self._nic_stats = psutil.net_if_stats()
            except OSError:
                self._nic_stats = {}
        self._ticks += 1
        stats = self._nic_stats
        out = []
        for name, c in sorted(counters.items()):
            if name in _SKIP_NICS:
                continue
            nic = NicSample(
                name=Text(name), rx_errors=c.errin, tx_errors=c.errout, rx_drops=c.dropin, tx_drops=c.dropout
            )
            last = self._last_nics.get(name)
            if last is not None and dt > 0:
                # A counter that went backwards was reset (driver reload): no rate this tick.
                nic.rx_bps = max(c.bytes_recv - last.bytes_recv, 0) / dt
                nic.tx_bps = max(c.bytes_sent - last.bytes_sent, 0) / dt
            st = stats.get(name)
            if st is not None:
                nic.up = st.isup
                nic.speed_mbps = float(st.speed) if st.speed > 0 else None
            out.append(nic)
        return out
