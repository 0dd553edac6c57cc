"""The incident store's SQLite file: made and kept private, its schema and the upgrades of older files, one transaction."""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import Callable
from typing import Any

from loguru import logger

from gridwatch.playbooks.history import RETURN_WHAT
from gridwatch.playbooks.model import ACTING_STEPS

# PRAGMA user_version of a database this code made; a newer one is refused, 0 is a file from before versions.
# 1 -> 2: incidents keep when their fault happened (fault_at) and the training step then (fault_step), so
# the time to detect and to recover of each is in the file (view incident_times).
# 2 -> 3: the history table (per node and per GPU), filled on upgrade from the incidents, steps and audit kept.
SCHEMA_VERSION = 3
_TABLES = frozenset({"incidents", "steps", "audit"})

# One write: its SQL and parameters (a transaction is a list of them).
Op = tuple[str, tuple[Any, ...]]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS incidents (
    id TEXT PRIMARY KEY, playbook TEXT NOT NULL, node TEXT NOT NULL, gpu INTEGER,
    kind TEXT NOT NULL, severity TEXT NOT NULL, scope TEXT NOT NULL, summary TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'open', silenced_until REAL, symptoms INTEGER NOT NULL DEFAULT 1,
    detected_at REAL NOT NULL, acted_at REAL, recovered_at REAL, resolved_at REAL,
    acknowledged_by TEXT, incident_json BLOB NOT NULL, fault_at REAL, fault_step INTEGER
);
-- The incidents not recovered yet: what the status line counts at every redraw (IncidentStore.open_count),
-- read from this rather than from every incident of weeks.
CREATE INDEX IF NOT EXISTS incidents_unrecovered ON incidents(state, silenced_until) WHERE recovered_at IS NULL;
CREATE TABLE IF NOT EXISTS steps (
    id TEXT PRIMARY KEY, incident TEXT NOT NULL REFERENCES incidents(id), idx INTEGER NOT NULL,
    step TEXT NOT NULL, target TEXT NOT NULL, decision TEXT NOT NULL, reason TEXT NOT NULL,
    state TEXT NOT NULL, started_at REAL, finished_at REAL, outcome TEXT NOT NULL DEFAULT '',
    planned_json BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS steps_by_incident ON steps(incident, idx);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, who TEXT NOT NULL, what TEXT NOT NULL,
    why TEXT NOT NULL, incident TEXT, step TEXT, phase TEXT NOT NULL, outcome TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS audit_by_incident ON audit(incident, id);
CREATE TABLE IF NOT EXISTS history (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, kind TEXT NOT NULL, node TEXT NOT NULL, gpu INTEGER,
    gpu_uuid TEXT NOT NULL DEFAULT '', gpu_serial TEXT NOT NULL DEFAULT '', incident TEXT,
    playbook TEXT NOT NULL DEFAULT '', what TEXT NOT NULL DEFAULT '', code INTEGER,
    severity TEXT NOT NULL DEFAULT '', outcome TEXT NOT NULL DEFAULT '', verdict TEXT NOT NULL DEFAULT '',
    shadow INTEGER NOT NULL DEFAULT 0, reason TEXT NOT NULL DEFAULT '', who TEXT NOT NULL DEFAULT '',
    step TEXT NOT NULL DEFAULT '', ref TEXT UNIQUE
);
CREATE INDEX IF NOT EXISTS history_by_node ON history(node, at);
CREATE INDEX IF NOT EXISTS history_by_gpu ON history(gpu_uuid, at);
CREATE VIEW IF NOT EXISTS incident_times AS
    SELECT id, node, playbook, fault_at, detected_at, recovered_at,
           detected_at - fault_at AS detect_s, recovered_at - fault_at AS recover_s
    FROM incidents;
"""
# Columns schema 2 added to incidents, with their types (a version 1 file gets them on open).
_V2_COLUMNS: tuple[tuple[str, str], ...] = (("fault_at", "REAL"), ("fault_step", "INTEGER"))
# What each incident cost, added to any file on open (no version bump: a reader of schema 2 ignores them).
_COST_COLUMNS: tuple[tuple[str, str], ...] = (("steps_lost", "INTEGER"), ("gpu_hours_lost", "REAL"))
# Who the collective records blame (a JSON list of nodes) and why, added the same way: an older
# reader ignores them, and a row written by one keeps them empty.
_BLAME_COLUMNS: tuple[tuple[str, str], ...] = (("blamed", "TEXT NOT NULL DEFAULT '[]'"),
                                               ("blame_why", "TEXT NOT NULL DEFAULT ''"))

# The columns a version 1 file must have (what an older file is checked against) ...
_V1_INCIDENT_COLS = ("id, playbook, node, gpu, kind, severity, scope, summary, state, silenced_until, symptoms, "
                     "detected_at, acted_at, recovered_at, resolved_at, acknowledged_by")
# ... and the ones read.
INCIDENT_COLS = _V1_INCIDENT_COLS + ", " + ", ".join(name for name, _ in (*_V2_COLUMNS, *_COST_COLUMNS,
                                                                          *_BLAME_COLUMNS))
STEP_COLS = "id, incident, idx, step, target, decision, reason, state, started_at, finished_at, outcome, planned_json"
# The steps that change something, as an SQL list: their rows are the history's remediations.
ACTING_SQL = ", ".join(f"'{s}'" for s in sorted(ACTING_STEPS))
# What a schema 2 row must hold to be carried into the history.
_SANE_INCIDENT = "typeof(detected_at) IN ('real', 'integer') AND typeof(node) = 'text'"
_BACKFILL: tuple[Op, ...] = (
    # The XID code of an older incident is in its summary, which the engine writes as "xid N on NODE ...".
    ("INSERT OR IGNORE INTO history (at, kind, node, gpu, incident, playbook, what, code, severity, ref)"
     " SELECT detected_at, 'incident', node, gpu, id, playbook, kind, CASE WHEN kind = 'xid' AND summary GLOB"
     " 'xid [0-9]* *' THEN CAST(substr(summary, 5, instr(substr(summary, 5), ' ') - 1) AS INTEGER) END, severity,"
     f" 'incident:' || id FROM incidents WHERE {_SANE_INCIDENT}", ()),
    ("INSERT OR IGNORE INTO history (at, kind, node, gpu, incident, playbook, what, outcome, reason, step, ref)"
     " SELECT COALESCE(s.started_at, s.finished_at, i.detected_at), 'remediation', i.node, i.gpu, s.incident,"
     " i.playbook, s.step, s.state, s.outcome, s.id, 'step:' || s.id FROM steps s JOIN incidents i ON i.id = s.incident"
     f" WHERE s.decision = 'act' AND s.step IN ({ACTING_SQL}) AND typeof(i.detected_at) IN ('real', 'integer')"
     " AND typeof(i.node) = 'text'", ()),
    ("INSERT OR IGNORE INTO history (at, kind, node, incident, outcome, reason, who, ref)"
     " SELECT ts, 'return', substr(what, ?), incident, outcome, why, who, 'audit:' || id FROM audit"
     " WHERE what LIKE ? AND phase = 'after' AND typeof(ts) IN ('real', 'integer')",
     (len(RETURN_WHAT) + 2, f"{RETURN_WHAT} %")),
)


def open_schema(db: sqlite3.Connection, path: str, report_bad_row: Callable[[str, Any, str], None]) -> str:
    """Bring ``db`` to this schema, creating or upgrading it; why it is refused as an incident database ('' if not)."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        return (f"{path} was written by a newer gridwatch (schema {version}, this one reads "
                f"{SCHEMA_VERSION}); use that version or another --db")
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")} - {"sqlite_sequence"}
    if version == 0 and tables and not _TABLES <= tables:
        return (f"{path} is not an incident database (it holds tables "
                f"{', '.join(sorted(tables))}); give another --db")
    if version == 0 and tables:
        missing = _missing_columns(db)
        if missing:
            return (f"{path} is not an incident database of this shape "
                    f"(missing {', '.join(missing)}); give another --db")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    if tables and version < 2:
        _migrate_to_2(db, path)
    db.executescript(_SCHEMA)
    have = {r[1] for r in db.execute("PRAGMA table_info(incidents)")}
    for name, kind in (*_COST_COLUMNS, *_BLAME_COLUMNS):
        if name not in have:
            db.execute(f"ALTER TABLE incidents ADD COLUMN {name} {kind}")
    if tables and version < 3:
        _migrate_to_3(db, path, report_bad_row)
    if version != SCHEMA_VERSION:
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    return ""


def _migrate_to_2(db: sqlite3.Connection, path: str) -> None:
    """Version 1 -> 2: the fault's time and step on each incident; older rows keep them empty."""
    have = {r[1] for r in db.execute("PRAGMA table_info(incidents)")}
    db.execute("BEGIN")
    for name, kind in _V2_COLUMNS:
        if name not in have:
            db.execute(f"ALTER TABLE incidents ADD COLUMN {name} {kind}")
    db.execute("PRAGMA user_version=2")
    db.execute("COMMIT")
    logger.info("{}: incident database upgraded to schema 2", path)


def _migrate_to_3(db: sqlite3.Connection, path: str, report_bad_row: Callable[[str, Any, str], None]) -> None:
    """Version 2 -> 3: the history, filled from the incidents, acting steps and returns to service kept.

    A row whose time or node is not what it should be is left out of the
    history and named (``bad_rows``); the rest carries over. Run again on
    an open that failed half-way, it adds nothing twice (each row has a ref).
    """
    db.execute("BEGIN")
    try:
        for sql, params in _BACKFILL:
            db.execute(sql, params)
        db.execute("PRAGMA user_version=3")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    for (rowid,) in db.execute(f"SELECT rowid FROM incidents WHERE NOT ({_SANE_INCIDENT})").fetchall():
        report_bad_row("incidents", rowid, "left out of the history: its node or detection time is unreadable")
    logger.info("{}: incident database upgraded to schema 3 (history per node and GPU)", path)


def _missing_columns(db: sqlite3.Connection) -> list[str]:
    wanted = {"incidents": [c.strip() for c in _V1_INCIDENT_COLS.split(",")] + ["incident_json"],
              "steps": [c.strip() for c in STEP_COLS.split(",")]}
    missing = []
    for table, cols in wanted.items():
        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
        missing += [f"{table}.{c}" for c in cols if c not in have]
    return missing


def apply(db: sqlite3.Connection, ops: list[Op]) -> int:
    """Run ``ops`` in one transaction on ``db``; the last row id."""
    rowid = 0
    db.execute("BEGIN")
    try:
        for sql, params in ops:
            rowid = db.execute(sql, params).lastrowid or rowid
    except BaseException:
        if db.in_transaction:  # SQLite rolls back by itself on some errors (a full disk among them)
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    return int(rowid)


def create_private(path: str) -> None:
    """Create the database file 0600: SQLite gives its -wal and -journal the mode of the database."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return
    os.close(fd)


def file_refusal(path: str) -> str:
    """Why ``path`` (or its -wal, -shm, -journal) is not an incident database this user alone can change; '' if it is.

    SQLite follows a link and opens whatever file is there, so a link planted
    at the path, or a file another user owns or may write, is refused first.
    """
    for name in (path, f"{path}-wal", f"{path}-shm", f"{path}-journal"):
        try:
            st = os.lstat(name)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            return f"{name} is a symbolic link"
        if not stat.S_ISREG(st.st_mode):
            return f"{name} is not a regular file"
        if st.st_uid != os.geteuid():
            return f"{name} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
        if st.st_mode & 0o022:
            return f"{name} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def tighten(path: str) -> None:
    """An incident database of ours that others can read becomes 0600 (its -wal and -shm too)."""
    for name in (path, f"{path}-wal", f"{path}-shm", f"{path}-journal"):
        try:
            st = os.stat(name)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
            # Incidents name nodes, faults and who did what: not for every local user.
            os.chmod(name, 0o600)
            logger.warning("{} was readable by others; now 0600", name)
