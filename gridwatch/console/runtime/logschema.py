"""The log store's tables: one partition per UTC day, its trigram index, and the statements both sides share.

The console's process reads them (:mod:`gridwatch.console.runtime.logstore`), the writer's
process writes them (:mod:`gridwatch.console.runtime.logwriter`). This module imports nothing
of gridwatch: the writer process starts on it and SQLite alone.

One partition per UTC day of the lines' own time, so that retention drops whole tables (an FTS5
index keeps a deleted row's entries until its segments merge; a dropped table gives its pages
back at once). ``lines_<p>`` holds the rows, ``fts_<p>`` is an external-content trigram index over
line and source, filled by the writer a batch at a time. ``sev`` is the severity's rank (NULL for
a raw line, which carries none: a severity filter keeps events only, as in the Logs view). Table
names come from dates only, never from node text.
"""

from __future__ import annotations

import calendar
import math
import re
import sqlite3
import time

# 2: new partitions index without positions (detail=none); a version-1 store opens as it is, its older
# partitions queried the same way until their days go.
# 3: the writer indexes each batch's new rows in one statement, not by a trigger per row (FTS5 flushes its
# pending terms at each statement's savepoint, and a trigger makes one a row: about 3x the CPU a line). An
# older store's insert triggers are dropped on opening; an older gridwatch refuses this store rather than
# write rows it would not index.
SCHEMA_VERSION = 3
READABLE_VERSIONS = (0, 1, 2, SCHEMA_VERSION)  # 0: a file just made
CACHE_KIB = 65_536  # the writer's page cache: a day's index pages stay in memory while it is written
WAL_PAGES = 16_384  # pages the WAL grows to before the writer copies it back (fewer, larger checkpoints)
# The trigram index's tuning, kept in each partition's own config: its in-memory terms flush as a new
# segment when they pass FTS_HASH_BYTES (1 MB by default, a segment every thousand lines or so), and
# segments merge FTS_AUTOMERGE at a time (4 by default): bigger and fewer merges cost less per line.
FTS_HASH_BYTES = 32 * 1024 * 1024
FTS_AUTOMERGE = 8
FTS_CRISISMERGE = 32
BUSY_TIMEOUT_MS = 10_000
PRUNE_CHUNK = 20_000  # rows deleted per transaction while pruning (short write locks, bounded WAL)
KEPT = "kept"  # the partition an open incident's lines move to when their day's partition goes
DAY_S = 86_400
MAX_TS = 253_402_300_799.0  # 9999-12-31: a node's clock that says more is clipped here
_PARTITION = re.compile(r"^lines_(p\d{8}|kept)$")

# (node, ts, source, severity, sev, kind, line): a row as the writer inserts it.
Row = tuple[str, float, str, str, int | None, str, str]


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


def drop_insert_trigger(conn: sqlite3.Connection, part: str) -> None:
    """An older store indexed each row by a trigger: dropped, as the writer indexes its batches itself now."""
    conn.execute(f"DROP TRIGGER IF EXISTS lines_{part}_ai")


def newest_id(conn: sqlite3.Connection, part: str) -> int:
    return int(conn.execute(f"SELECT coalesce(max(id), 0) FROM lines_{part}").fetchone()[0])


def index_after(conn: sqlite3.Connection, part: str, after: int) -> None:
    """Index ``part``'s rows written after row ``after`` (in this transaction): one statement, not one a row."""
    conn.execute(f"INSERT INTO fts_{part}(rowid, line, source) SELECT id, line, source FROM lines_{part} "
                 "WHERE id > ?", (after,))


def make_partition(conn: sqlite3.Connection, part: str) -> None:
    """Create ``part``'s tables (if missing) and tune its index; a partition an older store made keeps its columns."""
    for statement in _ddl(part):
        conn.execute(statement)
    f = f"fts_{part}"
    for key, value in (("hashsize", FTS_HASH_BYTES), ("automerge", FTS_AUTOMERGE), ("crisismerge", FTS_CRISISMERGE)):
        conn.execute(f"INSERT INTO {f}({f}, rank) VALUES (?, ?)", (key, value))


def insert_sql(part: str, dedupe: bool) -> str:
    t = f"lines_{part}"
    if not dedupe:
        return f"INSERT INTO {t}(node, ts, source, severity, sev, kind, line) VALUES (?, ?, ?, ?, ?, ?, ?)"
    # A line asked of an agent may already be here (streamed, or asked before): kept once.
    return (f"INSERT INTO {t}(node, ts, source, severity, sev, kind, line) SELECT ?, ?, ?, ?, ?, ?, ? "
            f"WHERE NOT EXISTS (SELECT 1 FROM {t} WHERE node = ?1 AND ts = ?2 AND line = ?7)")


def unkept(table: str) -> str:
    """A row of ``table`` in no kept window (temp.keep, filled for each prune)."""
    return f"NOT EXISTS (SELECT 1 FROM temp.keep k WHERE k.node = {table}.node AND {table}.ts BETWEEN k.since AND k.until)"


def partition_of(ts: float) -> str:
    """The partition a line of time ``ts`` goes to: ``p20261201``, its UTC day."""
    clipped = min(max(ts, 0.0), MAX_TS) if math.isfinite(ts) else 0.0
    return time.strftime("p%Y%m%d", time.gmtime(clipped))


def day_of(part: str) -> tuple[float, float]:
    """The range of times a dated partition holds (start included, end not)."""
    start = float(calendar.timegm(time.strptime(part[1:], "%Y%m%d")))
    return start, start + DAY_S


def partitions(conn: sqlite3.Connection) -> list[str]:
    """The dated partitions, oldest first (the kept one is not among them)."""
    names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name GLOB 'lines_*'")]
    found = [m.group(1) for m in map(_PARTITION.match, names) if m is not None]
    return sorted(p for p in found if p != KEPT)


def count(conn: sqlite3.Connection, part: str) -> int:
    return int(conn.execute(f"SELECT count(*) FROM lines_{part}").fetchone()[0])


def used_bytes(conn: sqlite3.Connection) -> int:
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    size = conn.execute("PRAGMA page_size").fetchone()[0]
    return int((pages - free) * size)
