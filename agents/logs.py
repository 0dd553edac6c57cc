"""Log tailers: follow files and the kernel log, run detectors, keep recent lines for search."""

from __future__ import annotations

import errno
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loguru import logger

from agents.detectors import detect
from agents.framing import LineBuffer
from agents.logsearch import match_lines, vet_pattern
from agents.protocol import MAX_LINE_CHARS, Event, Text, clean_text

KERNEL_LOGS = ("/dev/kmsg", "/var/log/kern.log")
DEFAULT_READ_BYTES = 1 << 20
DEFAULT_BUFFER_LINES = 10_000
# A line with no newline is held at most this long before it is cut and
# emitted: one writer that never ends a line must not grow the agent.
_MAX_PENDING = MAX_LINE_CHARS * 4
_KMSG_RECORD = 8192

LogEntry = tuple[str, str, float]  # (source, line, ts)


def _decode(raw: bytes) -> str:
    return clean_text(raw.decode("utf-8", "replace").rstrip("\r"))


@dataclass
class _FileTail:
    """One followed file: the open descriptor, which file it is, and a partial line."""

    path: str
    fd: int | None = None
    ident: tuple[int, int] | None = None  # (st_dev, st_ino) of what fd reads
    offset: int = 0
    lines: LineBuffer = field(default_factory=lambda: LineBuffer(_MAX_PENDING, keep_prefix=True))
    missing_logged: bool = False

    def open(self, from_end: bool) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if not self.missing_logged:
                logger.debug("log {} not readable yet: {}", self.path, exc.strerror)
                self.missing_logged = True
            return False
        st = os.fstat(fd)
        self.close()
        self.fd, self.ident = fd, (st.st_dev, st.st_ino)
        self.offset = st.st_size if from_end else 0
        self.missing_logged = False
        return True

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.fd = None

    def read(self, budget: int) -> tuple[list[bytes], int]:
        """Complete lines read from the current position, and the bytes it took."""
        if self.fd is None or budget <= 0:
            return [], 0
        try:
            data = os.pread(self.fd, budget, self.offset)
        except OSError as exc:
            logger.warning("reading log {} failed: {}", self.path, exc.strerror)
            return [], 0
        self.offset += len(data)
        return self.lines.feed(data), len(data)

    def flush(self) -> list[bytes]:
        """The unfinished last line, when the file it came from is gone or cut."""
        return self.lines.flush()


class _KernelLog:
    """``/dev/kmsg``: one record per read, non-blocking, starting at the newest."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self.broken = False
        # Old records were handled (or not) before this agent started.
        os.lseek(self.fd, 0, os.SEEK_END)

    def read(self, budget: int) -> tuple[list[bytes], int]:
        lines: list[bytes] = []
        used = 0
        while used < budget:
            try:
                record = os.read(self.fd, _KMSG_RECORD)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # the ring overwrote records we had not read yet
                    continue
                # Containers often let /dev/kmsg open but not read: say so once, stop asking.
                logger.warning("kernel log {} unreadable ({}); XIDs come from NVML only", self.path, exc.strerror)
                self.broken = True
                break
            if not record:
                break
            used += len(record)
            lines.append(parse_kmsg_record(record))
        return lines, used

    def close(self) -> None:
        os.close(self.fd)


def parse_kmsg_record(record: bytes) -> bytes:
    """The message of one ``/dev/kmsg`` record (``pri,seq,usec,flags;message``, then key=value lines)."""
    head, sep, rest = record.partition(b";")
    message = rest if sep else head
    return message.split(b"\n", 1)[0]


def _open_kernel_log(paths: Iterable[str], from_end: bool) -> _KernelLog | _FileTail | None:
    for path in paths:
        if path.startswith("/dev/"):
            try:
                return _KernelLog(path)
            except OSError:
                continue
        tail = _FileTail(path)
        if tail.open(from_end):
            return tail
    logger.debug("no readable kernel log; XIDs come from NVML events only")
    return None


# A crash loop or a retrying NCCL can write the same error thousands of times a
# second; past this many events of one kind from one log in one poll, the rest
# are counted on the last one instead of sent.
MAX_EVENTS_PER_KIND = 5
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)\b")
_TRACEBACK_LOOKAHEAD = 200


def _events(entries: list[LogEntry]) -> list[Event]:
    """Detector events for a batch of lines, with floods folded and tracebacks named."""
    events: list[Event] = []
    counts: dict[tuple[str, str], int] = {}
    last: dict[tuple[str, str], Event] = {}
    for i, (source, line, ts) in enumerate(entries):
        event = detect(line, source, ts)
        if event is None:
            continue
        key = (source, str(event.kind))
        counts[key] = counts.get(key, 0) + 1
        if counts[key] > MAX_EVENTS_PER_KIND:
            last[key].details["suppressed"] = Text(str(counts[key] - MAX_EVENTS_PER_KIND))
            continue
        if event.kind == "traceback":
            _name_traceback(event, entries, i)
        last[key] = event
        events.append(event)
    return events


def _name_traceback(event: Event, entries: list[LogEntry], start: int) -> None:
    """Put the exception that ends a traceback into its event, when it arrived in the same batch."""
    source = entries[start][0]
    for other, line, _ in entries[start + 1 : start + 1 + _TRACEBACK_LOOKAHEAD]:
        if other == source and _EXCEPTION_LINE.match(line):
            event.message = Text(f"Python traceback: {line.strip()[:300]}")
            event.details["exception"] = Text(line.strip()[:300])
            return


class LogTailer:
    """Follows log files and the kernel log; turns lines into events; keeps recent lines.

    Files survive rotation (a new inode at the path), truncation (the size
    shrinks), deletion and re-creation: what was written to the old file is
    read to its end before the new one is opened, and a file that appears
    later is read from its start. Files present at start are followed from
    their end. Each poll reads at most ``read_bytes`` per source, so one
    flooding log cannot stall a tick. A line that copy-truncation rewrites past
    the old size before a poll sees it is not noticed (every tailer shares this).
    """

    def __init__(
        self,
        paths: Iterable[str] = (),
        *,
        kernel: bool = True,
        kernel_paths: Iterable[str] = KERNEL_LOGS,
        clock: Callable[[], float] = time.time,
        read_bytes: int = DEFAULT_READ_BYTES,
        buffer_lines: int = DEFAULT_BUFFER_LINES,
        from_start: bool = False,
    ) -> None:
        self._clock = clock
        self._read_bytes = read_bytes
        self._files = [_FileTail(p) for p in dict.fromkeys(paths)]
        for tail in self._files:
            tail.open(from_end=not from_start)
        self._kernel = _open_kernel_log(kernel_paths, from_end=True) if kernel else None
        self._buffer: deque[LogEntry] = deque(maxlen=buffer_lines)

    @property
    def sources(self) -> list[str]:
        """The paths being followed (the kernel log only if it is readable)."""
        names = [t.path for t in self._files]
        if self._kernel is not None:
            names.append(self._kernel.path)
        return names

    def poll(self) -> tuple[list[LogEntry], list[Event]]:
        """New lines since the last poll, as (source, line, ts), and the events they carry."""
        now = self._clock()
        entries: list[LogEntry] = []
        for tail in self._files:
            for raw in self._poll_file(tail):
                entries.append((tail.path, _decode(raw), now))
        if self._kernel is not None:
            kernel_path = self._kernel.path
            if isinstance(self._kernel, _FileTail):
                raws = self._poll_file(self._kernel)
            else:
                raws, _ = self._kernel.read(self._read_bytes)
                if self._kernel.broken:
                    self._kernel.close()
                    self._kernel = None
            entries.extend((kernel_path, _decode(raw), now) for raw in raws)
        self._buffer.extend(entries)
        return entries, _events(entries)

    def _poll_file(self, tail: _FileTail) -> list[bytes]:
        if tail.fd is None:
            return tail.read(self._read_bytes)[0] if tail.open(from_end=False) else []
        lines, used = tail.read(self._read_bytes)
        try:
            st = os.stat(tail.path)
        except OSError:
            # Deleted: what was written before the delete has been read above;
            # keep the descriptor until a new file appears at the path.
            return lines
        if (st.st_dev, st.st_ino) != tail.ident:
            if used >= self._read_bytes:
                return lines  # the old file still has bytes; finish it first
            lines += tail.flush()
            logger.debug("log {} was replaced (rotated or re-created); following the new file", tail.path)
            if tail.open(from_end=False):
                more, _ = tail.read(self._read_bytes - used)
                lines += more
        elif st.st_size < tail.offset:
            logger.debug("log {} was truncated; reading from its start", tail.path)
            lines += tail.flush()
            tail.offset = 0
            more, _ = tail.read(self._read_bytes - used)
            lines += more
        return lines

    def entries(self, since: float | None = None, until: float | None = None) -> list[LogEntry]:
        """The buffered lines stamped between ``since`` and ``until``, oldest first (a copy)."""
        if since is None and until is None:
            return list(self._buffer)
        return [e for e in self._buffer if (since is None or e[2] >= since) and (until is None or e[2] <= until)]

    def search(
        self, pattern: str, since: float | None = None, until: float | None = None, limit: int = 500
    ) -> list[LogEntry]:
        """The newest ``limit`` buffered lines matching a vetted regular expression, oldest first.

        In this process: for the agent's own use. A client's search goes through
        :func:`agents.logsearch.search_entries`, which runs it in a worker with a
        deadline. Raises ``ValueError`` with a one-line reason for a pattern that
        does not compile or could backtrack without bound.
        """
        regex = vet_pattern(pattern)
        entries = self.entries(since, until)
        return [entries[i] for i in match_lines(regex, [e[1] for e in entries], limit)]

    def close(self) -> None:
        for tail in self._files:
            tail.close()
        if self._kernel is not None:
            self._kernel.close()
