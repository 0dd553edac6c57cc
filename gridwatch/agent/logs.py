"""Log tailers: follow files, the kernel log and the journal, run detectors, keep recent lines for search."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import signal
import stat
import subprocess
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec
from loguru import logger

from gridwatch.agent.config import JOURNAL_SOURCE
from gridwatch.agent.detectors import detect, kernel_kind
from gridwatch.agent.detectors.progress import JobProgress, ProgressTracker
from gridwatch.agent.logsearch import match_lines, vet_pattern
from gridwatch.sshlink.ratelimit import LogLimiter
from gridwatch.wire.framing import LineBuffer
from gridwatch.wire.protocol import MAX_LINE_CHARS, Event, Text, clean_text

KERNEL_LOGS = ("/dev/kmsg", "/var/log/kern.log")
DEFAULT_READ_BYTES = 1 << 20
DEFAULT_BUFFER_LINES = 10_000
# A line with no newline is held at most this long before it is cut and
# emitted: one writer that never ends a line must not grow the agent.
_MAX_PENDING = MAX_LINE_CHARS * 4
_KMSG_RECORD = 8192
# A poll reads in chunks this big, up to its budget: asking for the whole budget (1 MiB) at once made Python
# map and unmap a 1 MiB buffer per file per tick, for the few hundred bytes a log grows by in a second.
_READ_CHUNK = 1 << 16

# A job's progress lines older than this no longer say it is training (it hangs, or it ended).
PROGRESS_FRESH_S = 300.0
LogEntry = tuple[str, str, float]  # (source, line, ts)


# Owners up to this uid are system accounts (Debian's SYS_UID_MAX): rsyslog writes kern.log as "syslog".
SYSTEM_UID_MAX = 999


def others_may_write(st: os.stat_result) -> str | None:
    """Why an open log file with this status is writable by someone other than root, a system account and
    this process (None when it is not): what such a file says cannot be evidence about the node."""
    if st.st_uid not in (0, os.geteuid()) and st.st_uid > SYSTEM_UID_MAX:
        return f"owned by uid {st.st_uid}"
    if st.st_mode & stat.S_IWOTH:
        return f"writable by every local user (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_mode & stat.S_IWGRP and st.st_gid != 0:
        return f"writable by group {st.st_gid} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _open_flags(path: str) -> int:
    """Read-only, and not through a symlink when others may write the directory (one planted there would
    make the agent read, and serve to a viewer's search, a file its own user can read and they cannot)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        parent = os.stat(os.path.dirname(os.path.abspath(path)) or "/")
    except OSError:
        return flags | os.O_NOFOLLOW
    if parent.st_uid not in (0, os.geteuid()) or parent.st_mode & (stat.S_IWOTH | stat.S_IWGRP):
        flags |= os.O_NOFOLLOW
    return flags


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
    kernel: bool = False  # configured as the kernel's lines (kern.log): trusted only while only root can write it
    untrusted: str | None = None  # why the open file cannot be evidence about the node (others may write it)
    refused_logged: str = ""

    def open(self, from_end: bool) -> bool:
        try:
            fd = os.open(self.path, _open_flags(self.path))
        except OSError as exc:
            if not self.missing_logged:
                why = "a symlink in a directory others can write" if exc.errno == errno.ELOOP else exc.strerror
                logger.log("WARNING" if exc.errno == errno.ELOOP else "DEBUG", "log {} not readable: {}", self.path, why)
                self.missing_logged = True
            return False
        st = os.fstat(fd)
        why = others_may_write(st)
        if why is not None and st.st_mode & stat.S_IWOTH:
            # Anyone could make this file say a trainer crashed: not read at all.
            os.close(fd)
            if self.refused_logged != why:
                logger.warning("log {} not read: {}; make it writable by its writer alone", self.path, why)
                self.refused_logged = why
            return False
        if why is not None and self.kernel and self.refused_logged != why:
            logger.warning("kernel log {} is {}: its lines report no kernel or driver fault", self.path, why)
            self.refused_logged = why
        self.untrusted = why
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
            data = os.pread(self.fd, min(budget, _READ_CHUNK), self.offset)
            if len(data) == _READ_CHUNK and budget > _READ_CHUNK:
                parts = [data]
                got = len(data)
                while got < budget:
                    more = os.pread(self.fd, min(budget - got, _READ_CHUNK), self.offset + got)
                    parts.append(more)
                    got += len(more)
                    if len(more) < _READ_CHUNK:
                        break
                data = b"".join(parts)
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
        tail = _FileTail(path, kernel=True)  # trusted only while no one but root or a system account can write it
        if tail.open(from_end):
            return tail
    logger.debug("no readable kernel log; XIDs come from NVML events only")
    return None


# ----------------------------------------------------------------- journald

JOURNAL_KERNEL = "kernel"  # in ``journal``: the kernel's messages (what /dev/kmsg holds)
JOURNALCTL = "journalctl"
_SOURCE = re.compile(JOURNAL_SOURCE)
_CURSOR = re.compile(r"^[A-Za-z0-9=;_.:\-]{1,512}$")
# A record is one JSON object; journald keeps fields under 64 KiB unless told otherwise.
_JOURNAL_RECORD = 1 << 17
_JOURNAL_RESTART_S = 5.0


class _JournalRecord(msgspec.Struct):
    """The fields of one ``journalctl --output=json`` record this reader uses."""

    message: str | list[int] | None = msgspec.field(default=None, name="MESSAGE")
    cursor: str | None = msgspec.field(default=None, name="__CURSOR")
    transport: str | None = msgspec.field(default=None, name="_TRANSPORT")
    unit: str | None = msgspec.field(default=None, name="_SYSTEMD_UNIT")
    identifier: str | None = msgspec.field(default=None, name="SYSLOG_IDENTIFIER")


_RECORD = msgspec.json.Decoder(_JournalRecord)


def journal_argv(sources: Iterable[str], cursor: str | None, journalctl: str = JOURNALCTL) -> list[str]:
    """The fixed argv that follows ``sources`` ("kernel" and unit names), after ``cursor`` when one is kept.

    Matches are OR-ed with ``+``; raises ``ValueError`` for a source that is
    neither "kernel" nor a unit name.
    """
    matches: list[str] = []
    for source in dict.fromkeys(sources):
        if source == JOURNAL_KERNEL:
            match = "_TRANSPORT=kernel"
        elif _SOURCE.match(source):
            match = f"_SYSTEMD_UNIT={source}"
        else:
            raise ValueError(f"journal: {source!r} is neither {JOURNAL_KERNEL!r} nor a unit name such as 'nvidia-fabricmanager.service'")
        matches += ["+", match] if matches else [match]
    start = [f"--after-cursor={cursor}"] if cursor else ["--lines=0"]
    return [journalctl, "--follow", "--output=json", "--all", "--quiet", *start, *matches]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    # PR_SET_PDEATHSIG: the follower must not outlive an agent that was killed outright.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _message(record: _JournalRecord) -> str:
    """MESSAGE as text: journald sends it as a byte array when it is not valid UTF-8 or holds control bytes."""
    value = record.message
    if value is None:
        return ""
    if isinstance(value, list):
        value = bytes(b & 0xFF for b in value).decode("utf-8", "replace")
    return clean_text(value.rstrip("\r\n"))


class _Journal:
    """``journalctl --follow --output=json`` as a child: the kernel's and named units' records, read without blocking.

    The cursor of the last record read is kept (in ``cursor_file`` when given,
    written privately), so an agent restarted later resumes after it instead
    of reading the journal again or losing what came in between. A follower
    that exits is started again, after the cursor, a few seconds later.
    """

    path = "journal"

    def __init__(
        self,
        sources: Iterable[str],
        cursor_file: str | None = None,
        *,
        journalctl: str = JOURNALCTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sources = list(dict.fromkeys(sources))
        journal_argv(self.sources, None, journalctl)  # a bad source fails here, before anything runs
        self.cursor_file = cursor_file
        self.journalctl = journalctl
        self.clock = clock
        self.cursor = self._load_cursor()
        self.broken = False
        self.proc: subprocess.Popen[bytes] | None = None
        self.lines = LineBuffer(_JOURNAL_RECORD)
        self._saved = self.cursor
        self._retry_at = 0.0
        self._start()

    def _load_cursor(self) -> str | None:
        if not self.cursor_file:
            return None
        try:
            with open(self.cursor_file, encoding="ascii") as fh:
                text = fh.read(1024).strip()
        except (OSError, UnicodeDecodeError):
            return None
        if not _CURSOR.match(text):
            logger.warning("journal cursor {} is not a cursor; following from now", self.cursor_file)
            return None
        return text

    def _save_cursor(self) -> None:
        if not self.cursor_file or self.cursor == self._saved or self.cursor is None:
            return
        tmp = f"{self.cursor_file}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as fh:
                fh.write(self.cursor + "\n")
            os.replace(tmp, self.cursor_file)
            self._saved = self.cursor
        except OSError as exc:
            logger.warning("cannot keep the journal cursor in {}: {}; a restart may read records again", self.cursor_file, exc.strerror)
            self.cursor_file = None

    def _start(self) -> None:
        argv = journal_argv(self.sources, self.cursor, self.journalctl)
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - the child only calls prctl before exec
            )
        except OSError as exc:
            logger.warning("cannot run {} ({}); the journal is not read", self.journalctl, exc.strerror or exc)
            self.broken = True
            return
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        self.lines = LineBuffer(_JOURNAL_RECORD)
        logger.debug("following the journal: {}", " ".join(argv))

    def read(self, budget: int) -> tuple[list[tuple[str, str]], int]:
        """(source, message) of the records that arrived, and the bytes they took."""
        if self.proc is None:
            if not self.broken and self.clock() >= self._retry_at:
                self._start()
            return [], 0
        assert self.proc.stdout is not None
        chunks: list[bytes] = []
        used = 0
        ended = False
        while used < budget:
            try:
                data = os.read(self.proc.stdout.fileno(), min(1 << 16, budget - used))
            except BlockingIOError:
                break
            except OSError as exc:
                logger.warning("reading the journal failed: {}", exc.strerror)
                ended = True
                break
            if not data:
                ended = True
                break
            used += len(data)
            chunks.append(data)
        out: list[tuple[str, str]] = []
        for raw in self.lines.feed(b"".join(chunks)):
            try:
                record = _RECORD.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not a record (a truncated one, or a journalctl notice): skip it
            if record.cursor:
                self.cursor = record.cursor
            message = _message(record)
            if not message:
                continue
            if record.transport == "kernel":
                where = f"journal:{JOURNAL_KERNEL}"
            else:
                where = f"journal:{clean_text(record.unit or record.identifier or 'unknown', 200)}"
            out.append((where, message))
        self._save_cursor()
        if ended:
            self._reap()
        return out, used

    def _reap(self) -> None:
        if self.proc is None:
            return
        code = self.proc.poll()
        if code is None:
            return
        logger.warning("{} exited with status {}; following the journal again in {:g}s", self.journalctl, code, _JOURNAL_RESTART_S)
        self._close_proc()
        self._retry_at = self.clock() + _JOURNAL_RESTART_S

    def _close_proc(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.warning("{} (pid {}) did not exit after SIGKILL", self.journalctl, proc.pid)
        if proc.stdout is not None:
            proc.stdout.close()

    def close(self) -> None:
        self._save_cursor()
        self._close_proc()


# A crash loop or a retrying NCCL can write the same error thousands of times a
# second; past this many events of one kind from one log in one poll, the rest
# are counted on the last one instead of sent.
MAX_EVENTS_PER_KIND = 5
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)\b")
_TRACEBACK_LOOKAHEAD = 200


def _events(entries: list[LogEntry], kernel_sources: set[str] | None = None,
            quoted: Callable[[str, str], None] | None = None) -> list[Event]:
    """Detector events for a batch of lines, with floods folded and tracebacks named.

    Only lines of ``kernel_sources`` (every source when None) may report kernel and driver kinds;
    ``quoted`` is told of a line elsewhere that reads as one (source, line).
    """
    events: list[Event] = []
    counts: dict[tuple[str, str], int] = {}
    last: dict[tuple[str, str], Event] = {}
    for i, (source, line, ts) in enumerate(entries):
        trusted = kernel_sources is None or source in kernel_sources
        event = detect(line, source, ts, kernel=trusted)
        if event is None:
            if not trusted and quoted is not None and kernel_kind(line):
                quoted(source, line)
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
        journal: Iterable[str] = (),
        journal_cursor: str | None = None,
        journalctl: str = JOURNALCTL,
        kernel_files: Iterable[str] = (),
    ) -> None:
        self._clock = clock
        self._read_bytes = read_bytes
        kernel_named = list(dict.fromkeys(kernel_files))
        self._files = [_FileTail(p, kernel=p in kernel_named) for p in dict.fromkeys([*paths, *kernel_named])]
        for tail in self._files:
            tail.open(from_end=not from_start)
        # The journal's kernel transport and the units named here are written by the kernel and by system
        # services (journald sets those fields itself): their lines may report kernel and driver faults.
        self._journal_trusted = {f"journal:{s}" for s in journal}
        self.quoted = 0  # lines of application logs that read as a kernel fault (reported as none)
        self._quoted_log = LogLimiter(rate=1 / 60, burst=3)
        self._kernel = _open_kernel_log(kernel_paths, from_end=True) if kernel else None
        sources = list(journal)
        # Where the kernel log is only in the journal, reading /dev/kmsg as well would report each line twice.
        if JOURNAL_KERNEL in sources and self._kernel is not None:
            logger.debug("kernel messages come from the journal; not reading {}", self._kernel.path)
            self._kernel.close()
            self._kernel = None
        self._journal = _Journal(sources, journal_cursor, journalctl=journalctl) if sources else None
        self._buffer: deque[LogEntry] = deque(maxlen=buffer_lines)
        # A job gridwatch did not write says how far it is in its own log: its progress lines, folded per log.
        self.progress = ProgressTracker()

    @property
    def sources(self) -> list[str]:
        """The paths being followed (the kernel log only if it is readable)."""
        names = [t.path for t in self._files]
        if self._kernel is not None:
            names.append(self._kernel.path)
        if self._journal is not None and not self._journal.broken:
            names.append(self._journal.path)
        return names

    def poll(self) -> tuple[list[LogEntry], list[Event]]:
        """New lines since the last poll, as (source, line, ts), and the events they carry."""
        now = self._clock()
        entries: list[LogEntry] = []
        for tail in self._files:
            for raw in self._poll_file(tail):
                line = _decode(raw)
                entries.append((tail.path, line, now))
                if not tail.kernel:
                    self.progress.feed(tail.path, line, now)
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
        if self._journal is not None:
            records, _ = self._journal.read(self._read_bytes)
            entries.extend((where, message, now) for where, message in records)
            if self._journal.broken:
                self._journal = None
        self._buffer.extend(entries)
        return entries, _events(entries, self.kernel_sources(), self._quoted)

    def now(self) -> float:
        """The tailer's clock: what a progress line's ``ts`` is read against."""
        return self._clock()

    def job_progress(self, fresh_s: float = PROGRESS_FRESH_S) -> tuple[str, JobProgress] | None:
        """The log that printed progress most recently, within ``fresh_s``, and what it said; None if none."""
        now = self._clock()
        fresh = [(job.ts, path, job) for path, job in self.progress.logs().items() if now - job.ts <= fresh_s]
        if not fresh:
            return None
        _, path, job = max(fresh)
        return path, job

    def kernel_sources(self) -> set[str]:
        """The sources whose lines may report kernel, driver and NVSwitch faults now: the kernel log, the
        journal's kernel transport and named units, and kernel log files only root (or this agent) can write."""
        trusted = {t.path for t in self._files if t.kernel and t.fd is not None and t.untrusted is None}
        if isinstance(self._kernel, _FileTail):
            if self._kernel.untrusted is None:
                trusted.add(self._kernel.path)
        elif self._kernel is not None:
            trusted.add(self._kernel.path)
        return trusted | self._journal_trusted

    def _quoted(self, source: str, line: str) -> None:
        self.quoted += 1
        held = self._quoted_log.allow()
        if held is not None:
            logger.warning("{} has a line that reads as a kernel fault; an application log reports no kernel or "
                           "driver fault (list the kernel's own log under kernel_logs): {}", source, line[:160])

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
        :func:`gridwatch.agent.logsearch.search_entries`, which runs it in a worker with a
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
        if self._journal is not None:
            self._journal.close()
