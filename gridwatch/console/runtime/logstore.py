"""The console's log store: the lines it keeps off the nodes, in SQLite (FTS5 over the text), written off the event loop.

What goes in is decided by :mod:`gridwatch.console.runtime.logfeed` (the lines behind
events, the lines streamed, an incident's window asked of its nodes); this module
keeps them, finds them and forgets them. It sits behind one small interface,
:class:`LogBackend` (write a batch, query), so that past one machine the same
queries can go to a log engine built for it.

Writes go through a bounded queue of batches to one writer thread, which hands
them to the writer's own process (:mod:`gridwatch.console.runtime.logwriter`:
SQLite's work off this interpreter, so off the event loop's GIL too). A full
queue drops its oldest batch and counts it, so a slow disk never blocks the
console's event loop. Queries open their own connection (the file is in WAL
mode: readers never wait for the writer), so ``gridwatch logs`` reads the file
of a running console, or of one long stopped, read-only.

Patterns are the Logs view's: a case-insensitive regular expression searched in
the line and its source, narrowed by the trigram index where it can be
(:mod:`gridwatch.console.runtime.logpattern`; no FTS syntax reaches the engine).
Node text is stored as received (it was cleaned on the wire) and only ever
passed as a bound parameter.

Retention: lines older than ``retention_s``, then the oldest lines while the
store holds more than ``max_bytes``, except the lines of an open incident's
nodes within its evidence window (:class:`Evidence`). The lines sit in one
partition per UTC day, so a day goes as one dropped table and its pages go back
to the disk at once; an open incident's lines move to the ``kept`` partition first.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec
from loguru import logger

from gridwatch.console.fleet.logquery import parse_log_query, severity_rank
from gridwatch.console.runtime.logpattern import PatternError, pattern_clause, searcher
from gridwatch.console.runtime.logschema import (
    BUSY_TIMEOUT_MS,
    DAY_S,
    KEPT,
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    Row,
    count,
    day_of,
    drop_insert_trigger,
    make_partition,
    partitions,
    used_bytes,
)
from gridwatch.console.runtime.logwriter import Done, Prune, Write, WriterGone, WriterProcess, encode_rows
from gridwatch.sshlink.hostlist import HostlistError, expand
from gridwatch.wire.protocol import SEVERITIES

STORE_NAME = "logs.db"  # inside the folder beside the incident database (store_path_for)
QUEUE_BATCHES = 256  # batches waiting for the writer before the oldest is dropped
BATCH_LINES = 512  # lines buffered by add() before they go to the writer as one batch
FLUSH_S = 0.5  # a batch not full goes to the writer after this long
COALESCE_LINES = 32_768  # batches waiting together are written in one transaction up to this many lines
MAX_LIMIT = 100_000  # rows one query returns at most
_COLUMNS = "node, ts, source, severity, kind, line"


class LogStoreError(ValueError):
    """The log store cannot be opened, or a query cannot be run; the message says why in one line."""


class LogRow(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One stored line: a raw log line (``kind`` "line", no severity) or the line behind an event."""

    node: str
    ts: float  # the line's own time, seconds since the epoch
    source: str  # log:/var/log/kern.log, nvml, trainer ...
    line: str
    severity: str = ""  # an event's; "" for a raw line, which carries none
    kind: str = "line"  # line | event
    where: str = "store"  # where the line came from: store | agent (a live agent's search)


@dataclass(frozen=True, slots=True)
class Evidence:
    """Lines of ``node`` from ``since`` to ``until`` that pruning never removes: an open incident's window."""

    node: str
    since: float
    until: float


@dataclass(slots=True)
class LogCounters:
    """What the store did since it was opened (the console's /metrics shows them)."""

    written: int = 0  # lines written
    dropped: int = 0  # lines in batches a full queue dropped
    dropped_batches: int = 0
    failed: int = 0  # lines the disk refused
    pruned_age: int = 0  # lines removed for their age
    pruned_size: int = 0  # lines removed to keep the store under its size

    @property
    def pruned(self) -> int:
        return self.pruned_age + self.pruned_size


class LogBackend(Protocol):
    """What the console needs of a log store: write a batch, query. SQLite here; a log engine past one machine."""

    def write(self, batch: Sequence[LogRow]) -> None: ...

    def query(self, nodes: Iterable[str] | str | None = None, since: float | None = None, until: float | None = None,
              severity: str | None = None, pattern: str | None = None, limit: int = 1000) -> list[LogRow]: ...


def store_path_for(db_path: str | os.PathLike[str]) -> Path:
    """Where the console that keeps its incidents in ``db_path`` keeps its logs: a private folder beside it."""
    return Path(db_path).with_suffix(".logs") / STORE_NAME


def row_tuple(row: LogRow) -> Row:
    sev = severity_rank(row.severity) if row.kind == "event" or row.severity else None
    return (row.node, float(row.ts), row.source, row.severity, sev, row.kind, row.line)


@dataclass(slots=True)
class _Batch:
    """Rows already encoded for the writer process: bytes, not tuples, wait in the queue (nothing for the collector
    to walk), and the writer thread holds the GIL for no encoding of its own (the loop waited on it, up to 12 ms)."""

    raw: msgspec.Raw
    lines: int
    dedupe: bool = False

    @classmethod
    def of(cls, rows: list[Row], dedupe: bool = False) -> _Batch:
        return cls(encode_rows(rows), len(rows), dedupe)


class LogStore:
    """The embedded log store in one SQLite file; see the module's docstring. Thread-safe: any thread may write or query."""

    def __init__(self, path: str | os.PathLike[str], *, retention_s: float | None = None, max_bytes: int | None = None,
                 queue_batches: int = QUEUE_BATCHES, batch_lines: int = BATCH_LINES, flush_s: float = FLUSH_S,
                 clock: Callable[[], float] = time.time, read_only: bool = False) -> None:
        """Open (or, unless ``read_only``, make) the store at ``path``; LogStoreError in one line when it cannot be used."""
        self.path = Path(path)
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self.queue_batches = max(int(queue_batches), 1)
        self.batch_lines = max(int(batch_lines), 1)
        self.flush_s = flush_s
        self.clock = clock
        self.read_only = read_only
        self.counters = LogCounters()
        self.bytes = 0  # bytes the store's pages hold, as of the last write or prune
        self.last_error: str | None = None
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Batch] = deque()
        self._pending: list[Row] = []
        self._prune: tuple[list[Evidence], float | None] | None = None
        self._asked = self._done = 0  # requests (batches, prunes) handed to the writer, and finished or dropped
        self._thread: threading.Thread | None = None
        self.writer_pid: int | None = None  # the writer process, once started
        self._closing = False
        self._said_at = 0.0
        if read_only:
            self._check_readable()
        else:
            self._create()

    # ------------------------------------------------------------ opening

    def _create(self) -> None:
        folder = self.path.parent
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if folder.stat().st_uid == os.getuid():
                os.chmod(folder, 0o700)
            # Made private before SQLite opens it; its -wal and -shm files take the same mode.
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            os.chmod(self.path, 0o600)
        except OSError as exc:
            raise LogStoreError(f"cannot make the log store {self.path}: {exc.strerror or exc}") from None
        try:
            conn = sqlite3.connect(self.path, isolation_level=None)
            try:
                # Freed pages go back to the disk (PRAGMA incremental_vacuum after a prune): store_max holds on disk.
                conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
                conn.execute("PRAGMA journal_mode=WAL")
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                # Version 1's partitions need no rewrite: pattern_clause's query reads both kinds of index.
                if version not in READABLE_VERSIONS:
                    raise LogStoreError(f"{self.path} is a log store of another version ({version}); move it aside")
                make_partition(conn, KEPT)
                for part in (KEPT, *partitions(conn)):
                    drop_insert_trigger(conn, part)
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                self.bytes = used_bytes(conn)
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise LogStoreError(f"cannot open the log store {self.path}: {exc}") from None

    def _check_readable(self) -> None:
        if not self.path.is_file():
            raise LogStoreError(f"no log store at {self.path}")
        try:
            conn = self._reader()
            try:
                conn.execute(f"SELECT 1 FROM lines_{KEPT} LIMIT 1").fetchall()
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise LogStoreError(f"cannot read the log store {self.path}: {exc}") from None

    def _reader(self) -> sqlite3.Connection:
        """A connection for one query (any thread); read-only for a read-only store."""
        if self.read_only:
            conn = sqlite3.connect(self.path.resolve().as_uri() + "?mode=ro", uri=True)
        else:
            conn = sqlite3.connect(self.path)
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        conn.create_function("gw_search", 3, searcher(), deterministic=True)
        return conn

    # ------------------------------------------------------------ writing (any thread, never blocks)

    def add(self, node: str, ts: float, source: str, line: str, severity: str = "", kind: str = "line") -> None:
        """Buffer one line; it goes to the writer with the next full batch, or within ``flush_s``. Cheap: O(1)."""
        sev = severity_rank(severity) if kind == "event" or severity else None
        row = (node, ts, source, severity, sev, kind, line)
        with self._cond:
            if self._closing:
                self.counters.dropped += 1
                return
            self._pending.append(row)
            count = len(self._pending)
            if count >= self.batch_lines:
                self._hand_over_locked()
            if count == 1 or count >= self.batch_lines:
                self._start_locked()
                self._cond.notify()

    def write(self, batch: Sequence[LogRow], dedupe: bool = False) -> None:
        """Hand ``batch`` to the writer thread; a full queue drops its oldest batch (counted). ``dedupe``: skip lines
        already stored (same node, time and text), as for lines asked again of an agent."""
        rows = [row_tuple(r) for r in batch]
        if not rows:
            return
        with self._cond:
            self._enqueue_locked(_Batch.of(rows, dedupe))
            self._start_locked()
            self._cond.notify()

    def prune(self, keep: Sequence[Evidence] = (), now: float | None = None) -> None:
        """Ask the writer to apply retention now, keeping ``keep``; a newer request replaces one not yet run."""
        if self.read_only:
            raise LogStoreError("a read-only log store is not pruned")
        with self._cond:
            if self._prune is not None:
                self._done += 1  # replaced before it ran
            self._prune = (list(keep), now)
            self._asked += 1
            self._start_locked()
            self._cond.notify()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything handed over so far (buffered lines too) is written or dropped; False on timeout."""
        with self._cond:
            self._hand_over_locked()
            target = self._asked
            if self._thread is None and self._done >= target:
                return True
            self._start_locked()
            self._cond.notify()
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    @property
    def queued(self) -> int:
        """Batches waiting for the writer (not the one it is writing)."""
        with self._cond:
            return len(self._queue)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is left (up to ``timeout``), then stop the writer."""
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _hand_over_locked(self) -> None:
        if self._pending:
            self._enqueue_locked(_Batch.of(self._pending))
            self._pending = []

    def _enqueue_locked(self, batch: _Batch) -> None:
        if self.read_only or self._closing:
            self.counters.dropped += batch.lines
            self.counters.dropped_batches += 1
            return
        if len(self._queue) >= self.queue_batches:
            old = self._queue.popleft()
            self.counters.dropped += old.lines
            self.counters.dropped_batches += 1
            self._done += 1
        self._queue.append(batch)
        self._asked += 1

    def _start_locked(self) -> None:
        if self._thread is None and not self.read_only and not self._closing:
            self._thread = threading.Thread(target=self._run, name="gridwatch-logstore", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ the writer thread

    def _run(self) -> None:
        writer = WriterProcess(self.path)
        try:
            while True:
                with self._cond:
                    while not (self._queue or self._prune is not None or self._closing or self._pending):
                        self._cond.wait()
                    if self._pending and not (self._queue or self._prune is not None or self._closing):
                        self._cond.wait(self.flush_s)  # let a batch gather
                    self._hand_over_locked()
                    batch = self._queue.popleft() if self._queue else None
                    # Behind a slow disk batches pile up: one transaction for several costs less per line.
                    taken = [batch] if batch is not None else []
                    lines = batch.lines if batch is not None else 0
                    while (batch is not None and self._queue and not batch.dedupe and not self._queue[0].dedupe
                           and lines + self._queue[0].lines <= COALESCE_LINES):
                        taken.append(self._queue.popleft())
                        lines += taken[-1].lines
                    prune = self._prune if batch is None else None
                    if prune is not None:
                        self._prune = None
                    if batch is None and prune is None and self._closing:
                        return
                if batch is not None:
                    request: Write | Prune = Write([b.raw for b in taken], batch.dedupe, self.clock() + DAY_S)
                else:
                    assert prune is not None
                    keep, now = prune
                    request = Prune([(e.node, e.since, e.until) for e in keep], self.clock() if now is None else now,
                                    self.retention_s, self.max_bytes)
                self._answer(writer, request, lines)
                with self._cond:
                    self._done += max(len(taken), 1)
                    self._cond.notify_all()
        finally:
            writer.close()

    def _answer(self, writer: WriterProcess, request: Write | Prune, lines: int) -> None:
        """Run ``request`` in the writer process and count what it did."""
        try:
            done = writer.call(request)
        except WriterGone as exc:
            # Whether it died before or after its commit is not known: sent once more to a new writer, as lines
            # already stored are skipped (dedupe), nothing is lost and nothing kept twice.
            logger.warning("{}; starting another", exc)
            if isinstance(request, Write):
                request = Write(request.batches, True, request.latest)
            try:
                done = writer.call(request)
            except WriterGone as again:
                done = Done(failed=lines, trouble=str(again))
        self.writer_pid = writer.pid
        if done.crash:
            logger.error("the log store's writer failed on a {}: {}", "batch" if lines else "prune", done.crash)
        self.counters.written += done.written
        self.counters.failed += done.failed
        self.counters.pruned_age += done.pruned_age
        self.counters.pruned_size += done.pruned_size
        if done.bytes >= 0:
            self.bytes = done.bytes
        if done.trouble:
            self._trouble(done.trouble)
        elif lines and not done.crash:
            self.last_error = None

    def _trouble(self, text: str) -> None:
        self.last_error = text
        now = time.monotonic()
        if now - self._said_at >= 60.0:  # the disk that fails once fails for every batch: a line a minute
            self._said_at = now
            logger.warning(text)

    # ------------------------------------------------------------ reading (any thread)

    def query(self, nodes: Iterable[str] | str | None = None, since: float | None = None, until: float | None = None,
              severity: str | None = None, pattern: str | None = None, limit: int = 1000) -> list[LogRow]:
        """The newest ``limit`` lines that match, oldest first; LogStoreError in one line for a bad filter.

        ``nodes``: names, or one hostlist string (``node[01-04]``); ``since``/``until``: seconds since
        the epoch; ``severity``: the least an event must have (raw lines carry none: a severity keeps
        events only); ``pattern``: the Logs view's case-insensitive regular expression.
        """
        sql = [f"SELECT {_COLUMNS}, id FROM {{t}} WHERE 1"]
        args: list[object] = []
        if nodes is not None:
            names = _node_names(nodes)
            sql.append("AND node IN (SELECT value FROM json_each(?))")
            args.append(json.dumps(names))
        if since is not None:
            sql.append("AND ts >= ?")
            args.append(float(since))
        if until is not None:
            sql.append("AND ts <= ?")
            args.append(float(until))
        if since is not None and until is not None and until < since:
            raise LogStoreError("until is before since: the range holds no time")
        if severity:
            if severity not in SEVERITIES:
                raise LogStoreError(f"severity {severity!r} is not one of {', '.join(SEVERITIES)}")
            sql.append("AND sev >= ?")
            args.append(severity_rank(severity))
        if pattern:
            try:
                clause, values = pattern_clause(pattern, narrow_regex=since is None and until is None)
            except PatternError as exc:
                raise LogStoreError(str(exc)) from None
            sql.append(clause)
            args.extend(values)
        sql.append("ORDER BY ts DESC, id DESC LIMIT ?")
        limit = min(max(int(limit), 0), MAX_LIMIT)
        args.append(limit)
        template = " ".join(sql)
        found: list[tuple[str, float, str, str, str, str, int]] = []
        try:
            conn = self._reader()
            try:
                # The kept lines (any day), then the days newest first, until the newest ``limit`` are in hand.
                dated = 0
                for part in (KEPT, *reversed(partitions(conn))):
                    if part != KEPT:
                        start, end = day_of(part)
                        if (since is not None and end <= since) or (until is not None and start > until):
                            continue
                        if dated >= limit:
                            break
                    rows = conn.execute(template.format(t=f"lines_{part}", f=f"fts_{part}"), args).fetchall()
                    dated += len(rows) if part != KEPT else 0
                    found.extend(rows)
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise LogStoreError(f"cannot read the log store {self.path}: {exc}") from None
        found.sort(key=lambda r: (r[1], r[6]))  # by time, then as written
        return [LogRow(node=n, ts=t, source=s, severity=sev, kind=k, line=line)
                for n, t, s, sev, k, line, _id in found[-limit:] if limit]

    def query_text(self, text: str, now: float | None = None, limit: int = 1000) -> list[LogRow]:
        """Lines that the Logs view's one-line query ``text`` keeps (``node:node[1-4] sev:error since:2h xid``)."""
        query = parse_log_query(text, now)  # QueryError (a ValueError) in one line
        since, until = query.window(self.clock() if now is None else now)
        return self.query(query.nodes, since, until, query.min_severity, query.regex or None, limit)

    def count(self) -> int:
        """Lines stored now."""
        try:
            conn = self._reader()
            try:
                return sum(count(conn, p) for p in (KEPT, *partitions(conn)))
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise LogStoreError(f"cannot read the log store {self.path}: {exc}") from None


def _node_names(nodes: Iterable[str] | str) -> list[str]:
    if isinstance(nodes, str):
        try:
            return expand(nodes)
        except HostlistError as exc:
            raise LogStoreError(f"node set: {exc}") from None
    return [str(n) for n in nodes]
