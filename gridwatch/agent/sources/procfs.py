"""The ``/proc`` files the host source reads every tick: each held open and read again from its start, and parsed.

psutil opens, decodes and parses each file whole on every call (``virtual_memory`` alone takes about 25 µs, more
than the file's read); these read the bytes and take only the fields the sample carries.
"""

from __future__ import annotations

import os

from loguru import logger

# One read of a seq_file that lists records (net/dev, diskstats) returns at most its buffer (a page or more):
# read on until the kernel says the end. One that shows a single record (stat, meminfo, pressure; the
# kernel's single_open) grows its buffer to fit and gives it whole in one read up to this size.
_CHUNK = 1 << 16


class ProcFile:
    """One ``/proc`` file, opened once and read from offset 0 each time (the kernel writes it afresh).

    ``read`` is None while the file cannot be read (absent: an old kernel; or a
    read that failed, then opened again on the next call). ``whole``: the
    kernel writes it as one record, so one read short of the chunk is all of
    it (saves the read that would find its end).
    """

    def __init__(self, path: str, whole: bool = False) -> None:
        self.path = path
        self.whole = whole
        self._fd: int | None = None
        self._missing_logged = False

    def read(self) -> bytes | None:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                if not self._missing_logged:
                    logger.debug("{} unreadable ({}): its values are N/A", self.path, exc.strerror)
                    self._missing_logged = True
                return None
        try:
            data = os.pread(self._fd, _CHUNK, 0)
            if data and not (self.whole and len(data) < _CHUNK):
                more = os.pread(self._fd, _CHUNK, len(data))
                while more:
                    data += more
                    more = os.pread(self._fd, _CHUNK, len(data))
        except OSError as exc:
            logger.debug("reading {} failed ({}): opened again next time", self.path, exc.strerror)
            self.close()
            return None
        self._missing_logged = False
        return data

    def close(self) -> None:
        """Close the file (a later :meth:`read` opens it again)."""
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None

    def __del__(self) -> None:
        # As a file object does: an owner that never closed it (a test's agent) does not leak the descriptor.
        try:
            self.close()
        except OSError:
            pass


def cpu_times(stat: bytes) -> tuple[int, ...] | None:
    """The whole machine's ``cpu`` line of ``/proc/stat`` (user nice system idle iowait irq softirq steal guest
    guest_nice, in clock ticks); None when it is not there."""
    if not stat.startswith(b"cpu "):
        return None
    try:
        return tuple(map(int, stat[4 : stat.index(b"\n")].split()))
    except ValueError:
        return None


def busy_percent(before: tuple[int, ...], after: tuple[int, ...]) -> float | None:
    """Share of CPU time not idle (nor waiting on I/O) between two :func:`cpu_times`, as psutil's ``cpu_times`` gave it."""
    # Linux counts guest time inside user time too: left out of the total (the 9th and 10th), as psutil does.
    total = sum(after[:8]) - sum(before[:8])
    if total <= 0 or len(after) < 4 or len(before) < 4:
        return None
    idle = after[3] - before[3]
    if len(after) > 4 and len(before) > 4:
        idle += after[4] - before[4]
    return round(min(max(100.0 * (1.0 - idle / total), 0.0), 100.0), 1)


def meminfo_kib(meminfo: bytes, *names: bytes) -> list[int | None]:
    """The named ``/proc/meminfo`` fields (``b"MemTotal"``), in KiB; None for one it does not list."""
    out: list[int | None] = []
    for name in names:
        key = name + b":"
        if meminfo.startswith(key):
            at = len(key)
        else:
            found = meminfo.find(b"\n" + key)
            if found < 0:
                out.append(None)
                continue
            at = found + 1 + len(key)
        end = meminfo.find(b"\n", at)
        try:
            out.append(int((meminfo[at:end] if end >= 0 else meminfo[at:]).split()[0]))
        except (ValueError, IndexError):
            out.append(None)
    return out


def net_dev(text: bytes) -> dict[str, tuple[int, int, int, int, int, int, int, int]]:
    """``/proc/net/dev`` per interface, in psutil's order: bytes_sent, bytes_recv, packets_sent, packets_recv,
    errin, errout, dropin, dropout."""
    out: dict[str, tuple[int, int, int, int, int, int, int, int]] = {}
    for line in text.split(b"\n")[2:]:
        name, colon, rest = line.rpartition(b":")
        if not colon:
            continue
        f = rest.split()
        if len(f) < 12:
            continue
        try:
            out[name.strip().decode("utf-8", "replace")] = (
                int(f[8]), int(f[0]), int(f[9]), int(f[1]), int(f[2]), int(f[10]), int(f[3]), int(f[11]))
        except ValueError:
            continue
    return out


def psi_some_avg10(pressure: bytes) -> float | None:
    """``some avg10`` of a ``/proc/pressure/*`` file: % of the last 10 s some task stalled."""
    first = pressure.split(b"\n", 1)[0]
    for part in first.split():
        if part.startswith(b"avg10="):
            try:
                return float(part[6:])
            except ValueError:
                return None
    return None
