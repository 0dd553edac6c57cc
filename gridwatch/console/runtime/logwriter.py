"""The log store's writer, in a process of its own, and the console's end of the pipe to it.

SQLite's work for a batch (partitioning it by day, the inserts, the trigram index, retention) ran
on a thread of the console's process. Its Python between the statements shared the GIL with the
event loop, in slices of the switch interval: the loop was held up to 10-20 ms while the store
wrote. In a process of its own the writer has its own interpreter; what is left on the console's
side is encoding a batch (msgspec, in C, a few hundred ns a line) and waiting on a pipe, with the
GIL let go.

The pipe carries length-prefixed msgpack frames: :class:`Write` or :class:`Prune` one way,
:class:`Done` back, one answer a request. Nothing is pickled, and the child is started by
``python -I`` (no current directory, no environment's paths on ``sys.path``: nothing another local
user can write is imported), importing this module and :mod:`gridwatch.console.runtime.logschema`.
The file was made and checked by the console before the child opens it. A child that dies (killed,
out of memory) is started again and given the batch it held once more, with dedupe (the console's
LogStore): whether it had committed is not known, and a line already stored is not stored twice.
"""

from __future__ import annotations

import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
import traceback
from pathlib import Path

import msgspec

from gridwatch.console.runtime import logschema as ls
from gridwatch.console.runtime.logschema import KEPT, Row

_HEADER = 4  # a frame's length, big-endian
_MAX_FRAME = 1 << 30
RESPAWN_S = 1.0  # a writer that died this soon after its start is not started again before this long


class Write(msgspec.Struct, tag="write", array_like=True):
    """Write these batches in one transaction; ``batches`` are each a msgpack list of rows (encoded by the sender)."""

    batches: list[msgspec.Raw]
    dedupe: bool  # skip lines already stored (same node, time and text)
    latest: float  # no line is dated later than this (the console's clock plus a day)


class Prune(msgspec.Struct, tag="prune", array_like=True):
    """Apply retention now, keeping these windows (node, since, until)."""

    keep: list[tuple[str, float, float]]
    now: float
    retention_s: float | None
    max_bytes: int | None


class Done(msgspec.Struct, array_like=True):
    """What one request did."""

    written: int = 0
    failed: int = 0  # lines the disk refused
    pruned_age: int = 0
    pruned_size: int = 0
    bytes: int = -1  # bytes the store's pages hold after it; -1: not read
    trouble: str | None = None  # one line: why the disk refused (full, read-only ...)
    crash: str | None = None  # a traceback: the writer's own bug, the batch counted as failed


_ENCODER = msgspec.msgpack.Encoder()
_REQUEST = msgspec.msgpack.Decoder(Write | Prune)
_ROWS = msgspec.msgpack.Decoder(list[Row])
_DONE = msgspec.msgpack.Decoder(Done)


def encode_rows(rows: list[Row]) -> msgspec.Raw:
    """One batch as the child reads it; text that UTF-8 cannot carry (a lone surrogate) is replaced, not refused."""
    try:
        return msgspec.Raw(_ENCODER.encode(rows))
    except (UnicodeEncodeError, msgspec.EncodeError):
        return msgspec.Raw(_ENCODER.encode([tuple(_utf8(v) for v in row) for row in rows]))


def _utf8(value: object) -> object:
    return value.encode("utf-8", "replace").decode("utf-8") if isinstance(value, str) else value


def _write_frame(fd: int, payload: bytes) -> None:
    # The header on its own: a batch of megabytes is not copied once more to put four bytes before it.
    _write_all(fd, memoryview(len(payload).to_bytes(_HEADER, "big")))
    _write_all(fd, memoryview(payload))


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, size: int) -> bytes | None:
    parts: list[bytes] = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            return None  # the other end is gone
        parts.append(chunk)
        size -= len(chunk)
    return b"".join(parts)


def _read_frame(fd: int) -> bytes | None:
    header = _read_exact(fd, _HEADER)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > _MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes on the log writer's pipe")
    return _read_exact(fd, size)


# ------------------------------------------------------------ the console's end

class WriterGone(Exception):
    """The writer process stopped before it answered; the message says how, in one line."""


class WriterProcess:
    """The console's handle on its writer process: started at the first request, again after it dies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = 0.0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def call(self, request: Write | Prune) -> Done:
        """Send ``request``, wait for its answer (the GIL let go); WriterGone when the child cannot answer."""
        proc = self._ensure()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            _write_frame(proc.stdin.fileno(), _ENCODER.encode(request))
            reply = _read_frame(proc.stdout.fileno())
        except (OSError, ValueError):
            reply = None
        if reply is None:
            self._proc = None
            try:
                code = proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            raise WriterGone(f"the log store's writer process stopped (exit status {code})")
        return _DONE.decode(reply)

    def _ensure(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._proc is not None or self._started:
            # Dead since its last answer: started again, but not in a loop faster than RESPAWN_S.
            wait = self._started + RESPAWN_S - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # the writer's thread, never the event loop
        root = str(Path(__file__).resolve().parents[3])  # the folder that holds the gridwatch package
        code = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "from gridwatch.console.runtime.logwriter import main; main(sys.argv[2])")
        try:
            self._proc = subprocess.Popen([sys.executable, "-I", "-c", code, root, str(self.path)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          close_fds=True)
        except OSError as exc:
            self._proc = None
            raise WriterGone(f"cannot start the log store's writer process: {exc.strerror or exc}") from None
        finally:
            self._started = time.monotonic()
        return self._proc

    def close(self, timeout: float = 10.0) -> None:
        """Let the child finish and go: its stdin closes, it writes nothing more and exits."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# ------------------------------------------------------------ the writer's end

class Writer:
    """The writer's connection and the partitions it knows; one request at a time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.conn: sqlite3.Connection | None = None
        self.trouble: str | None = None
        self.parts: set[str] = set()
        try:
            conn = sqlite3.connect(path, isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout={ls.BUSY_TIMEOUT_MS}")
            # NORMAL in WAL mode: a commit does not wait for the disk, a checkpoint does. A power cut can lose the
            # last batches committed, never the file: what a checkpoint has copied back stays whole.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(f"PRAGMA cache_size=-{ls.CACHE_KIB}")
            conn.execute("PRAGMA temp_store=MEMORY")  # the prune's kept windows and sorts stay off the disk
            conn.execute(f"PRAGMA wal_autocheckpoint={ls.WAL_PAGES}")
            conn.execute("CREATE TEMP TABLE IF NOT EXISTS keep (node TEXT NOT NULL, since REAL NOT NULL, until REAL NOT NULL)")
            conn.execute("CREATE INDEX IF NOT EXISTS temp.keep_node ON keep(node)")
            self.parts = {*ls.partitions(conn), KEPT}
            self.conn = conn
        except sqlite3.Error as exc:
            # Every batch is refused (counted), and the console's log says why.
            self.trouble = f"cannot open the log store {path}: {exc}"

    def handle(self, request: Write | Prune) -> Done:
        if isinstance(request, Write):
            rows = [row for raw in request.batches for row in _ROWS.decode(raw)]
            if self.conn is None:
                return Done(failed=len(rows), trouble=self.trouble)
            return self.insert(self.conn, rows, request.dedupe, request.latest)
        if self.conn is None:
            return Done(trouble=self.trouble)
        return self.retention(self.conn, request)

    def insert(self, conn: sqlite3.Connection, rows: list[Row], dedupe: bool, latest: float) -> Done:
        by_day: dict[str, list[Row]] = {}
        names: dict[int, str] = {}  # a day's partition name by day number: strftime once a day, not once a line
        for row in rows:
            # A node's clock far ahead (or a hostile node) must not make lines outlive retention: no later than tomorrow.
            ts = min(row[1], latest)
            if not math.isfinite(row[1]):  # SQLite stores a NaN as NULL (refused): kept at its partition's time
                row = (row[0], ts if math.isfinite(ts) else 0.0, row[2], row[3], row[4], row[5], row[6])
            key = int(ts // ls.DAY_S) if math.isfinite(ts) else -1  # what partition_of clips goes to the epoch's day
            part = names.get(key)
            if part is None:
                part = names[key] = ls.partition_of(ts)
            by_day.setdefault(part, []).append(row)
        written = 0
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                made = [part for part in by_day if part not in self.parts]
                for part in made:
                    ls.make_partition(conn, part)
                for part, day in by_day.items():
                    after = ls.newest_id(conn, part)  # new rows get greater ids (a rowid table takes max + 1)
                    # rowcount: rows inserted (a line already stored is not, with dedupe).
                    written += conn.executemany(ls.insert_sql(part, dedupe), day).rowcount
                    ls.index_after(conn, part, after)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            return Done(failed=len(rows), trouble=f"cannot write {len(rows)} lines to the log store {self.path}: {exc}")
        self.parts.update(made)
        return Done(written=written, bytes=self._bytes(conn))

    def retention(self, conn: sqlite3.Connection, request: Prune) -> Done:
        done = Done()
        try:
            conn.execute("DELETE FROM temp.keep")
            conn.executemany("INSERT INTO temp.keep VALUES (?, ?, ?)", request.keep)
            if request.retention_s is not None:
                cutoff = request.now - request.retention_s
                for part in ls.partitions(conn):
                    start, end = ls.day_of(part)
                    if end <= cutoff:
                        done.pruned_age += self._retire(conn, part)
                    elif start < cutoff:  # the day the cutoff falls in: row by row
                        done.pruned_age += self._delete_all(conn, part, cutoff)
                done.pruned_age += self._delete_all(conn, KEPT, cutoff)
            if request.max_bytes is not None:
                done.pruned_size += self._fit(conn, request.max_bytes)
            conn.executescript("PRAGMA incremental_vacuum;")  # a page per step: sqlite3_exec runs it to the end
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            done.trouble = f"pruning the log store {self.path} failed: {exc}"
        done.bytes = self._bytes(conn)
        return done

    def _fit(self, conn: sqlite3.Connection, most: int) -> int:
        """Remove the oldest lines (whole days while there are several) until the store holds at most ``most`` bytes."""
        removed = 0
        for _ in range(10_000):  # bounded: each round removes a day or a chunk, or stops
            used = ls.used_bytes(conn)
            if used <= most:
                break
            parts = ls.partitions(conn)
            if len(parts) > 1:
                end = ls.day_of(parts[0])[1]
                removed += self._retire(conn, parts[0])
                removed += self._delete_all(conn, KEPT, end)
            else:
                rows = sum(ls.count(conn, p) for p in (*parts, KEPT))
                want = min(max(int((used - most) / max(used / max(rows, 1), 1.0) * 1.1) + 1, 100), ls.PRUNE_CHUNK)
                gone = 0
                for part in (*parts, KEPT):
                    gone = self._delete(conn, part, f"{ls.unkept(f'lines_{part}')} ORDER BY ts", (), want)
                    if gone:
                        # The index keeps a deleted row's entries until its segments merge: merge them now.
                        conn.execute(f"INSERT INTO fts_{part}(fts_{part}) VALUES ('optimize')")
                        break
                removed += gone
                if not gone:
                    break  # what is left is open incidents' evidence
            conn.executescript("PRAGMA incremental_vacuum;")  # a page per step: sqlite3_exec runs it to the end
        return removed

    def _retire(self, conn: sqlite3.Connection, part: str) -> int:
        """Drop a day's partition, its open incidents' lines moved to the kept one first; the lines removed."""
        t = f"lines_{part}"
        conn.execute("BEGIN IMMEDIATE")
        try:
            total = ls.count(conn, part)
            after = ls.newest_id(conn, KEPT)
            moved = conn.execute(f"INSERT INTO lines_{KEPT}(node, ts, source, severity, sev, kind, line) "
                                 f"SELECT node, ts, source, severity, sev, kind, line FROM {t} WHERE NOT {ls.unkept(t)}"
                                 ).rowcount
            ls.index_after(conn, KEPT, after)
            conn.execute(f"DROP TABLE {t}")
            conn.execute(f"DROP TABLE fts_{part}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        self.parts.discard(part)
        return total - max(moved, 0)

    def _delete_all(self, conn: sqlite3.Connection, part: str, before: float) -> int:
        """Remove ``part``'s lines older than ``before`` and in no kept window, a chunk per transaction."""
        total = 0
        while True:
            gone = self._delete(conn, part, f"ts < ? AND {ls.unkept(f'lines_{part}')} ORDER BY ts", (before,),
                                ls.PRUNE_CHUNK)
            total += gone
            if gone < ls.PRUNE_CHUNK:
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

    @staticmethod
    def _bytes(conn: sqlite3.Connection) -> int:
        try:
            return ls.used_bytes(conn)
        except sqlite3.Error:
            return -1  # the figure waits for the next batch


def _lines_in(request: Write | Prune) -> int:
    try:
        return sum(len(_ROWS.decode(raw)) for raw in request.batches) if isinstance(request, Write) else 0
    except msgspec.DecodeError:
        return 0


def main(path: str) -> None:
    """The writer process: requests on stdin, answers on stdout, until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the operator's ^C is the console's to handle; EOF stops this
    answers = os.dup(1)
    os.dup2(2, 1)  # a stray print cannot land in an answer
    writer = Writer(path)
    while True:
        frame = _read_frame(0)
        if frame is None:
            break
        try:
            request = _REQUEST.decode(frame)
        except msgspec.DecodeError as exc:
            _write_frame(answers, _ENCODER.encode(Done(crash=f"a request the writer cannot read: {exc}")))
            continue
        try:
            done = writer.handle(request)
        except Exception:  # noqa: BLE001 - the writer outlives one bad batch; the console's log says why
            done = Done(failed=_lines_in(request), crash=traceback.format_exc())
        _write_frame(answers, _ENCODER.encode(done))
    if writer.conn is not None:
        writer.conn.close()
