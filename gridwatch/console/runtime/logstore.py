"""The console's log store: the lines it keeps off the nodes, in SQLite (FTS5 over the text), written off the event loop.

What goes in is decided by :mod:`gridwatch.console.runtime.logfeed` (the lines behind
events, the lines streamed, an incident's window asked of its nodes); this module
keeps them, finds them and forgets them. It sits behind one small interface,
:class:`LogBackend` (write a batch, query), so that past one machine the same
queries can go to a log engine built for it.

Writes go through one writer thread and a bounded queue of batches: a full
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

import calendar
import json
import math
import os
import re
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
from gridwatch.sshlink.hostlist import HostlistError, expand
from gridwatch.wire.protocol import SEVERITIES

# 2: new partitions index without positions (detail=none); a version-1 store opens as it is, its older
# partitions queried the same way until their days go.
# 3: the writer indexes each batch's new rows in one statement, not by a trigger per row (FTS5 flushes its
# pending terms at each statement's savepoint, and a trigger makes one a row: about 3x the CPU a line). An
# older store's insert triggers are dropped on opening; an older gridwatch refuses this store rather than
# write rows it would not index.
SCHEMA_VERSION = 3
STORE_NAME = "logs.db"  # inside the folder beside the incident database (store_path_for)
QUEUE_BATCHES = 256  # batches waiting for the writer before the oldest is dropped
BATCH_LINES = 512  # lines buffered by add() before they go to the writer as one batch
FLUSH_S = 0.5  # a batch not full goes to the writer after this long
COALESCE_LINES = 32_768  # batches waiting together are written in one transaction up to this many lines
CACHE_KIB = 65_536  # the writer's page cache: a day's index pages stay in memory while it is written
WAL_PAGES = 16_384  # pages the WAL grows to before the writer copies it back (fewer, larger checkpoints)
# The trigram index's tuning, kept in each partition's own config: its in-memory terms flush as a new
# segment when they pass FTS_HASH_BYTES (1 MB by default, a segment every thousand lines or so), and
# segments merge FTS_AUTOMERGE at a time (4 by default): bigger and fewer merges cost less per line.
FTS_HASH_BYTES = 32 * 1024 * 1024
FTS_AUTOMERGE = 8
FTS_CRISISMERGE = 32
BUSY_TIMEOUT_MS = 10_000
MAX_LIMIT = 100_000  # rows one query returns at most
PRUNE_CHUNK = 20_000  # rows deleted per transaction while pruning (short write locks, bounded WAL)
KEPT = "kept"  # the partition an open incident's lines move to when their day's partition goes
_DAY_S = 86_400
_MAX_TS = 253_402_300_799.0  # 9999-12-31: a node's clock that says more is clipped here
_COLUMNS = "node, ts, source, severity, kind, line"
_PARTITION = re.compile(r"^lines_(p\d{8}|kept)$")

# One partition per UTC day of the lines' own time, so that retention drops whole tables (an FTS5
# index keeps a deleted row's entries until its segments merge; a dropped table gives its pages
# back at once). ``lines_<p>`` holds the rows, ``fts_<p>`` is an external-content trigram index over
# line and source, kept in step by triggers. ``sev`` is the severity's rank (NULL for a raw line,
# which carries none: a severity filter keeps events only, as in the Logs view). Table names come
# from dates only, never from node text.


def _ddl(part: str) -> tuple[str, ...]:
    t, f = f"lines_{part}", f"fts_{part}"
    return (
        f"CREATE TABLE IF NOT EXISTS {t} (id INTEGER PRIMARY KEY, node TEXT NOT NULL, ts REAL NOT NULL, "
        "source TEXT NOT NULL, severity TEXT NOT NULL, sev INTEGER, kind TEXT NOT NULL, line TEXT NOT NULL)",
        f"CREATE INDEX IF NOT EXISTS {t}_ts ON {t}(ts)",
        f"CREATE INDEX IF NOT EXISTS {t}_node ON {t}(node, ts)",
        # detail=none: the index holds which rows have a trigram, not where (about half the size, and cheaper to
        # write and merge); a substring is found as all of its trigrams, then checked in the row (pattern_clause).
        # columnsize=0: no per-row sizes (they serve ranking, and the Logs view orders by time), one write less a line.
        f"CREATE VIRTUAL TABLE IF NOT EXISTS {f} USING fts5(line, source, content='{t}', content_rowid='id', "
        "tokenize='trigram', detail=none, columnsize=0)",
        f"CREATE TRIGGER IF NOT EXISTS {t}_ad AFTER DELETE ON {t} BEGIN "
        f"INSERT INTO {f}({f}, rowid, line, source) VALUES ('delete', old.id, old.line, old.source); END",
    )


def _drop_insert_trigger(conn: sqlite3.Connection, part: str) -> None:
    """An older store indexed each row by a trigger: dropped, as the writer indexes its batches itself now."""
    conn.execute(f"DROP TRIGGER IF EXISTS lines_{part}_ai")


def _newest_id(conn: sqlite3.Connection, part: str) -> int:
    return int(conn.execute(f"SELECT coalesce(max(id), 0) FROM lines_{part}").fetchone()[0])


def _index_after(conn: sqlite3.Connection, part: str, after: int) -> None:
    """Index ``part``'s rows written after row ``after`` (in this transaction): one statement, not one a row."""
    conn.execute(f"INSERT INTO fts_{part}(rowid, line, source) SELECT id, line, source FROM lines_{part} "
                 "WHERE id > ?", (after,))


def _make_partition(conn: sqlite3.Connection, part: str) -> None:
    """Create ``part``'s tables (if missing) and tune its index; a partition an older store made keeps its columns."""
    for statement in _ddl(part):
        conn.execute(statement)
    f = f"fts_{part}"
    for key, value in (("hashsize", FTS_HASH_BYTES), ("automerge", FTS_AUTOMERGE), ("crisismerge", FTS_CRISISMERGE)):
        conn.execute(f"INSERT INTO {f}({f}, rank) VALUES (?, ?)", (key, value))


def _insert_sql(part: str, dedupe: bool) -> str:
    t = f"lines_{part}"
    if not dedupe:
        return f"INSERT INTO {t}(node, ts, source, severity, sev, kind, line) VALUES (?, ?, ?, ?, ?, ?, ?)"
    # A line asked of an agent may already be here (streamed, or asked before): kept once.
    return (f"INSERT INTO {t}(node, ts, source, severity, sev, kind, line) SELECT ?, ?, ?, ?, ?, ?, ? "
            f"WHERE NOT EXISTS (SELECT 1 FROM {t} WHERE node = ?1 AND ts = ?2 AND line = ?7)")


def _unkept(table: str) -> str:
    """A row of ``table`` in no kept window (temp.keep, filled for each prune)."""
    return f"NOT EXISTS (SELECT 1 FROM temp.keep k WHERE k.node = {table}.node AND {table}.ts BETWEEN k.since AND k.until)"


def partition_of(ts: float) -> str:
    """The partition a line of time ``ts`` goes to: ``p20261201``, its UTC day."""
    clipped = min(max(ts, 0.0), _MAX_TS) if math.isfinite(ts) else 0.0
    return time.strftime("p%Y%m%d", time.gmtime(clipped))


def _day(part: str) -> tuple[float, float]:
    """The range of times a dated partition holds (start included, end not)."""
    start = float(calendar.timegm(time.strptime(part[1:], "%Y%m%d")))
    return start, start + _DAY_S


def _partitions(conn: sqlite3.Connection) -> list[str]:
    """The dated partitions, oldest first (the kept one is not among them)."""
    names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name GLOB 'lines_*'")]
    found = [m.group(1) for m in map(_PARTITION.match, names) if m is not None]
    return sorted(p for p in found if p != KEPT)


# (node, ts, source, severity, sev, kind, line): a row as the writer inserts it.
_Row = tuple[str, float, str, str, int | None, str, str]


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


def row_tuple(row: LogRow) -> _Row:
    sev = severity_rank(row.severity) if row.kind == "event" or row.severity else None
    return (row.node, float(row.ts), row.source, row.severity, sev, row.kind, row.line)


@dataclass(slots=True)
class _Batch:
    rows: list[_Row]
    dedupe: bool = False


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
        self._pending: list[_Row] = []
        self._prune: tuple[list[Evidence], float | None] | None = None
        self._asked = self._done = 0  # requests (batches, prunes) handed to the writer, and finished or dropped
        self._thread: threading.Thread | None = None
        self._parts: set[str] = set()  # the partitions that exist (the writer thread's to change)
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
                if version not in (0, 1, 2, SCHEMA_VERSION):
                    raise LogStoreError(f"{self.path} is a log store of another version ({version}); move it aside")
                _make_partition(conn, KEPT)
                for part in (KEPT, *_partitions(conn)):
                    _drop_insert_trigger(conn, part)
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                self.bytes = _used_bytes(conn)
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
            self._enqueue_locked(_Batch(rows, dedupe))
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
            self._enqueue_locked(_Batch(self._pending))
            self._pending = []

    def _enqueue_locked(self, batch: _Batch) -> None:
        if self.read_only or self._closing:
            self.counters.dropped += len(batch.rows)
            self.counters.dropped_batches += 1
            return
        if len(self._queue) >= self.queue_batches:
            old = self._queue.popleft()
            self.counters.dropped += len(old.rows)
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
        conn: sqlite3.Connection | None
        try:
            conn = sqlite3.connect(self.path, isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            # NORMAL in WAL mode: a commit does not wait for the disk, a checkpoint does. A power cut can lose the
            # last batches committed, never the file: what a checkpoint has copied back stays whole.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
            conn.execute("PRAGMA temp_store=MEMORY")  # the prune's kept windows and sorts stay off the disk
            conn.execute(f"PRAGMA wal_autocheckpoint={WAL_PAGES}")
            conn.execute("CREATE TEMP TABLE IF NOT EXISTS keep (node TEXT NOT NULL, since REAL NOT NULL, until REAL NOT NULL)")
            conn.execute("CREATE INDEX IF NOT EXISTS temp.keep_node ON keep(node)")
            self._parts = {*_partitions(conn), KEPT}
        except sqlite3.Error as exc:
            conn = None  # every batch is refused (counted), and the log says why once a minute
            self._trouble(f"cannot open the log store {self.path}: {exc}")
        try:
            while True:
                with self._cond:
                    while not (self._queue or self._prune is not None or self._closing or self._pending):
                        self._cond.wait()
                    if self._pending and not (self._queue or self._prune is not None or self._closing):
                        self._cond.wait(self.flush_s)  # let a batch gather
                    self._hand_over_locked()
                    batch = self._queue.popleft() if self._queue else None
                    # Behind a slow disk batches pile up: one transaction for several costs less per line. Only
                    # taken here; joined after the lock is let go, so that add() on the event loop never waits on it.
                    more: list[_Batch] = []
                    lines = len(batch.rows) if batch is not None else 0
                    while (batch is not None and self._queue and not batch.dedupe and not self._queue[0].dedupe
                           and lines + len(self._queue[0].rows) <= COALESCE_LINES):
                        more.append(self._queue.popleft())
                        lines += len(more[-1].rows)
                    taken = 1 + len(more)
                    prune = self._prune if batch is None else None
                    if prune is not None:
                        self._prune = None
                    if batch is None and prune is None and self._closing:
                        return
                if batch is not None and more:
                    batch = _Batch([row for b in (batch, *more) for row in b.rows])
                try:
                    if batch is not None:
                        if conn is None:
                            self.counters.failed += len(batch.rows)
                        else:
                            self._insert(conn, batch)
                    elif prune is not None and conn is not None:
                        self._apply_retention(conn, *prune)
                except Exception:  # noqa: BLE001 - the writer outlives one bad batch; the log says why
                    logger.exception("the log store's writer failed on a {}", "batch" if batch is not None else "prune")
                    if batch is not None:
                        self.counters.failed += len(batch.rows)
                with self._cond:
                    self._done += taken
                    self._cond.notify_all()
        finally:
            if conn is not None:
                conn.close()

    def _insert(self, conn: sqlite3.Connection, batch: _Batch) -> None:
        by_day: dict[str, list[_Row]] = {}
        # A node's clock far ahead (or a hostile node) must not make lines outlive retention: no later than tomorrow.
        latest = self.clock() + _DAY_S
        names: dict[int, str] = {}  # a day's partition name by day number: strftime once a day, not once a line
        for row in batch.rows:
            ts = min(row[1], latest)
            if not math.isfinite(row[1]):  # SQLite stores a NaN as NULL (refused): kept at its partition's time
                row = (row[0], ts if math.isfinite(ts) else 0.0, row[2], row[3], row[4], row[5], row[6])
            key = int(ts // _DAY_S) if math.isfinite(ts) else -1  # what partition_of clips goes to the epoch's day
            part = names.get(key)
            if part is None:
                part = names[key] = partition_of(ts)
            by_day.setdefault(part, []).append(row)
        written = 0
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                made = [part for part in by_day if part not in self._parts]
                for part in made:
                    _make_partition(conn, part)
                for part, rows in by_day.items():
                    after = _newest_id(conn, part)  # new rows get greater ids (a rowid table takes max + 1)
                    # rowcount: rows inserted (a line already stored is not, with dedupe).
                    written += conn.executemany(_insert_sql(part, batch.dedupe), rows).rowcount
                    _index_after(conn, part, after)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            self.counters.failed += len(batch.rows)
            self._trouble(f"cannot write {len(batch.rows)} lines to the log store {self.path}: {exc}")
            return
        self._parts.update(made)
        self.counters.written += written
        self.last_error = None
        try:
            self.bytes = _used_bytes(conn)
        except sqlite3.Error:
            pass  # the figure waits for the next batch

    def _apply_retention(self, conn: sqlite3.Connection, keep: list[Evidence], now: float | None) -> None:
        now = self.clock() if now is None else now
        try:
            conn.execute("DELETE FROM temp.keep")
            conn.executemany("INSERT INTO temp.keep VALUES (?, ?, ?)", [(e.node, e.since, e.until) for e in keep])
            if self.retention_s is not None:
                cutoff = now - self.retention_s
                for part in _partitions(conn):
                    start, end = _day(part)
                    if end <= cutoff:
                        self.counters.pruned_age += self._retire(conn, part)
                    elif start < cutoff:  # the day the cutoff falls in: row by row
                        self.counters.pruned_age += self._delete_all(conn, part, cutoff)
                self.counters.pruned_age += self._delete_all(conn, KEPT, cutoff)
            if self.max_bytes is not None:
                self._fit(conn, self.max_bytes)
            conn.executescript("PRAGMA incremental_vacuum;")  # a page per step: sqlite3_exec runs it to the end
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self.bytes = _used_bytes(conn)
        except sqlite3.Error as exc:
            self._trouble(f"pruning the log store {self.path} failed: {exc}")

    def _fit(self, conn: sqlite3.Connection, most: int) -> None:
        """Remove the oldest lines (whole days while there are several) until the store holds at most ``most`` bytes."""
        for _ in range(10_000):  # bounded: each round removes a day or a chunk, or stops
            used = _used_bytes(conn)
            if used <= most:
                return
            parts = _partitions(conn)
            if len(parts) > 1:
                end = _day(parts[0])[1]
                self.counters.pruned_size += self._retire(conn, parts[0])
                self.counters.pruned_size += self._delete_all(conn, KEPT, end)
            else:
                rows = sum(_count(conn, p) for p in (*parts, KEPT))
                want = min(max(int((used - most) / max(used / max(rows, 1), 1.0) * 1.1) + 1, 100), PRUNE_CHUNK)
                gone = 0
                for part in (*parts, KEPT):
                    gone = self._delete(conn, part, f"{_unkept(f'lines_{part}')} ORDER BY ts", (), want)
                    if gone:
                        # The index keeps a deleted row's entries until its segments merge: merge them now.
                        conn.execute(f"INSERT INTO fts_{part}(fts_{part}) VALUES ('optimize')")
                        break
                self.counters.pruned_size += gone
                if not gone:
                    return  # what is left is open incidents' evidence
            conn.executescript("PRAGMA incremental_vacuum;")  # a page per step: sqlite3_exec runs it to the end

    def _retire(self, conn: sqlite3.Connection, part: str) -> int:
        """Drop a day's partition, its open incidents' lines moved to the kept one first; the lines removed."""
        t = f"lines_{part}"
        conn.execute("BEGIN IMMEDIATE")
        try:
            total = _count(conn, part)
            after = _newest_id(conn, KEPT)
            moved = conn.execute(f"INSERT INTO lines_{KEPT}(node, ts, source, severity, sev, kind, line) "
                                 f"SELECT node, ts, source, severity, sev, kind, line FROM {t} WHERE NOT {_unkept(t)}"
                                 ).rowcount
            _index_after(conn, KEPT, after)
            conn.execute(f"DROP TABLE {t}")
            conn.execute(f"DROP TABLE fts_{part}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        self._parts.discard(part)
        return total - max(moved, 0)

    def _delete_all(self, conn: sqlite3.Connection, part: str, before: float) -> int:
        """Remove ``part``'s lines older than ``before`` and in no kept window, a chunk per transaction."""
        total = 0
        while True:
            gone = self._delete(conn, part, f"ts < ? AND {_unkept(f'lines_{part}')} ORDER BY ts", (before,), PRUNE_CHUNK)
            total += gone
            if gone < PRUNE_CHUNK:
                return total

    @staticmethod
    def _delete(conn: sqlite3.Connection, part: str, where_order: str, args: tuple[object, ...], limit: int) -> int:
        t = f"lines_{part}"
        conn.execute("BEGIN IMMEDIATE")
        try:
            cur = conn.execute(f"DELETE FROM {t} WHERE id IN (SELECT id FROM {t} WHERE {where_order} LIMIT ?)",
                               (*args, limit))
            gone = cur.rowcount
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return max(gone, 0)

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
                for part in (KEPT, *reversed(_partitions(conn))):
                    if part != KEPT:
                        start, end = _day(part)
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
                return sum(_count(conn, p) for p in (KEPT, *_partitions(conn)))
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


def _count(conn: sqlite3.Connection, part: str) -> int:
    return int(conn.execute(f"SELECT count(*) FROM lines_{part}").fetchone()[0])


def _used_bytes(conn: sqlite3.Connection) -> int:
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    size = conn.execute("PRAGMA page_size").fetchone()[0]
    return int((pages - free) * size)
