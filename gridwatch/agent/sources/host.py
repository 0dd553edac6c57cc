"""The host itself: CPU, memory, load, NICs, disk I/O and PSI pressure, from ``/proc`` and ``/sys/class/net``."""

from __future__ import annotations

import operator
import os
import time
from collections.abc import Callable
from pathlib import Path

from gridwatch.agent.sources import Reading
from gridwatch.agent.sources.procfs import ProcFile, busy_percent, cpu_times, meminfo_kib, net_dev, psi_some_avg10
from gridwatch.wire.protocol import HostSample, NicSample

_KIB_PER_MIB = 1024
# Interfaces that carry no training traffic; watching them only adds rows.
_SKIP_NICS = ("lo",)
NicCounters = tuple[int, int, int, int, int, int, int, int]  # psutil's order: see procfs.net_dev


class _NoWrap:
    """NIC counters that never go backwards, as psutil's ``net_io_counters(nowrap=True)`` gave them.

    A counter lower than last time (a 32-bit one wrapped, or a driver reload
    reset it) carries what it had counted into what follows, so totals and
    rates read on as before; an interface that leaves forgets its carry.
    """

    def __init__(self) -> None:
        self._last: dict[str, NicCounters] = {}
        self._carry: dict[str, tuple[int, ...]] = {}

    def __call__(self, raw: dict[str, NicCounters]) -> dict[str, NicCounters]:
        out: dict[str, NicCounters] = {}
        for name, values in raw.items():
            before = self._last.get(name)
            carry = self._carry.get(name)
            if before is not None and any(map(operator.lt, values, before)):
                old = carry or (0,) * len(values)
                carry = self._carry[name] = tuple(c + (b if v < b else 0) for v, b, c in zip(values, before, old))
            out[name] = values if carry is None else tuple(map(operator.add, values, carry))
        if self._carry and raw.keys() != self._last.keys():
            for gone in self._carry.keys() - raw.keys():
                del self._carry[gone]
        self._last = raw
        return out


class _DiskStats:
    """Bytes read and written by whole disks, from ``/proc/diskstats``.

    psutil's disk_io_counters costs about 0.25 ms a call (it checks every
    partition against sysfs); the set of whole disks is listed once here.
    """

    def __init__(self, proc: Path, sys_block: Path) -> None:
        self._file = ProcFile(str(proc / "diskstats"))
        try:
            self._disks = {d.name.encode() for d in sys_block.iterdir() if not d.name.startswith(("loop", "ram", "zram"))}
        except OSError:
            self._disks = set()

    def read(self) -> tuple[int, int] | None:
        if not self._disks:
            return None
        text = self._file.read()
        if text is None:
            return None
        read = written = 0
        disks = self._disks
        for line in text.split(b"\n"):
            parts = line.split(None, 10)
            # major minor name reads merged sectors_read ms writes merged sectors_written ...
            if len(parts) > 9 and parts[2] in disks:
                read += int(parts[5]) * 512
                written += int(parts[9]) * 512
        return read, written

    def close(self) -> None:
        self._file.close()


class HostSource:
    """Reads the host once per tick; rates come from counter deltas over ``clock``.

    Every figure is read every tick (the ``/proc`` files held open, read from
    their start), except each NIC's link state and speed: every
    ``NIC_STATS_EVERY`` ticks. The constructor takes the first counter
    readings, so the first ``sample()`` already has rates (over the time since
    construction).
    """

    name = "host"
    blocking = True  # /proc and /sys reads can stall on a node under memory pressure
    # Link state and speed change rarely and cost an ioctl per NIC to read: every 10 s at 1 s ticks (a link
    # that goes down shows in its counters and in the kernel log at once).
    NIC_STATS_EVERY = 10

    def __init__(self, clock: Callable[[], float] = time.monotonic, proc: str = "/proc", sys_root: str = "/sys") -> None:
        self._clock = clock
        root = Path(proc)
        self._disks = _DiskStats(root, Path(sys_root) / "block")
        self._stat = ProcFile(str(root / "stat"), whole=True)
        self._meminfo = ProcFile(str(root / "meminfo"), whole=True)
        self._net_dev = ProcFile(str(root / "net" / "dev"))
        self._nowrap = _NoWrap()
        self._net = Path(sys_root) / "class" / "net"
        self._nic_stats: dict[str, tuple[bool, float | None]] = {}
        self._ticks = 0
        pressure = root / "pressure"
        # Kernels before 4.20 (or with psi=0) have no pressure files: N/A for good.
        self._psi = [(f"psi_{name}", ProcFile(str(pressure / name), whole=True)) for name in ("cpu", "memory", "io")
                     if (pressure / name).exists()]
        # CPU % from our own deltas of /proc/stat: psutil.cpu_percent() keeps one
        # baseline per process, which any other caller would move under us.
        self._last_cpu = self._cpu_times()
        self._last_busy: float | None = None
        self._last_t = clock()
        self._last_nics = self._nic_counters()
        self._last_disk = self._disk_counters()

    def _cpu_times(self) -> tuple[int, ...] | None:
        stat = self._stat.read()
        return None if stat is None else cpu_times(stat)

    def _nic_counters(self) -> dict[str, NicCounters]:
        text = self._net_dev.read()
        return {} if text is None else self._nowrap(net_dev(text))

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
        cpu = self._cpu_times()
        sample = HostSample()
        busy = busy_percent(self._last_cpu, cpu) if cpu is not None and self._last_cpu is not None else None
        if busy is None and cpu is not None and self._last_cpu is not None and self._last_busy is not None:
            # Two reads inside one clock tick of /proc/stat (10 ms): no time passed for it, so the last figure
            # stands and the baseline stays where it was, rather than a sample that says "no reading".
            sample.cpu_percent, cpu = self._last_busy, self._last_cpu
        else:
            sample.cpu_percent = self._last_busy = busy
        sample.mem_total_mb, sample.mem_used_mb = self._memory()
        try:
            sample.load1, sample.load5, sample.load15 = os.getloadavg()
        except OSError:
            pass
        sample.nics = self._nic_samples(nics, dt)
        if disk is not None and self._last_disk is not None and dt > 0:
            sample.disk_read_bps = max(disk[0] - self._last_disk[0], 0) / dt
            sample.disk_write_bps = max(disk[1] - self._last_disk[1], 0) / dt
        for field, file in self._psi:
            pressure = file.read()
            setattr(sample, field, None if pressure is None else psi_some_avg10(pressure))
        if dt > 0:
            self._last_t, self._last_nics, self._last_disk = now, nics, disk
        self._last_cpu = cpu
        return sample

    def _memory(self) -> tuple[float | None, float | None]:
        """Total and used MB as ``free`` counts them (used: total less MemAvailable), psutil's way."""
        text = self._meminfo.read()
        if text is None:
            return None, None
        total, available, free = meminfo_kib(text, b"MemTotal", b"MemAvailable", b"MemFree")
        if total is None:
            return None, None
        if not available:  # before 3.14 (or a kernel bug's 0): psutil's estimate, as ``free`` makes it
            import psutil  # only here: 1.3 MB of an agent's memory for a kernel older than 3.14

            try:
                mem = psutil.virtual_memory()
            except (OSError, RuntimeError):
                return total / _KIB_PER_MIB, None
            return mem.total / 2**20, (mem.total - mem.available) / 2**20
        if available > total and free is not None:  # a container's view (LXC): psutil and procps take MemFree
            available = free
        return total / _KIB_PER_MIB, (total - available) / _KIB_PER_MIB

    def _nic_samples(self, counters: dict[str, NicCounters], dt: float) -> list[NicSample]:
        if self._ticks % self.NIC_STATS_EVERY == 0:
            self._nic_stats = nic_links(self._net)
        self._ticks += 1
        stats = self._nic_stats
        out = []
        for name, c in sorted(counters.items()):
            if name in _SKIP_NICS:
                continue
            # c: bytes_sent, bytes_recv, packets_sent, packets_recv, errin, errout, dropin, dropout. The name a
            # plain str: the wire's Text is one, and the encoder takes a str subclass through a slower hook.
            nic = NicSample(name=name, rx_errors=c[4], tx_errors=c[5], rx_drops=c[6], tx_drops=c[7])
            last = self._last_nics.get(name)
            if last is not None and dt > 0:
                # Never lower than before (see _NoWrap); max() keeps a rate from going negative all the same.
                nic.rx_bps = max(c[1] - last[1], 0) / dt
                nic.tx_bps = max(c[0] - last[0], 0) / dt
            link = stats.get(name)
            if link is not None:
                nic.up, nic.speed_mbps = link
            out.append(nic)
        return out

    def close(self) -> None:
        for file in (self._stat, self._meminfo, self._net_dev, *(f for _, f in self._psi)):
            file.close()
        self._disks.close()


def nic_links(net: Path) -> dict[str, tuple[bool, float | None]]:
    """Each NIC's state and speed from ``/sys/class/net``: up (running: ``ip link``'s LOWER_UP, what psutil's
    ``net_if_stats().isup`` reads by ioctl) and Mb/s (None where the kernel knows none: a link down, a virtual
    NIC). Files, not psutil: psutil is 1.3 MB of the agent's memory for this alone."""
    links: dict[str, tuple[bool, float | None]] = {}
    try:
        names = os.listdir(net)
    except OSError:
        return links
    for name in names:
        try:
            state = (net / name / "operstate").read_text().strip()
        except OSError:
            continue  # gone since the listing
        try:
            speed: float | None = float((net / name / "speed").read_text().strip())
        except (OSError, ValueError):  # EINVAL while the link is down, or no such attribute
            speed = None
        # IFF_RUNNING is the kernel's "operationally up": operstate up, or unknown for a NIC that reports none (lo).
        links[name] = (state in ("up", "unknown"), speed if speed is not None and speed > 0 else None)
    return links
