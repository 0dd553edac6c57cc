"""The incident store in SQLite: incidents, their planned steps, and the audit log.

The console shows and changes incidents through this API (acknowledge, silence
with an expiry, resolve); the executor records every step here before and after
it runs, which is what makes a resumed plan skip what already happened.

Bad luck is survived, not obeyed: a write the disk refuses (full, I/O error,
read-only) is kept in memory, the store says so (``trouble``, ``on_trouble``)
and the writes land, in order, once the disk takes them again; a row that does
not decode is skipped and reported by file and row; a database of another
program or of a newer gridwatch is refused in one sentence (``StoreError``).

Each node's and GPU's history (gridwatch.playbooks.history) is kept in the table
``history``: every incident, every step that changed something with its
outcome, every return to service and every history rule's verdict, queried by
node and by GPU (by UUID where the agent named it, so a GPU moved to another
node keeps its history).
"""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
from loguru import logger

from gridwatch.playbooks.clock import Clock, SystemClock
from gridwatch.playbooks.history import (
    LEMON_WINDOW,
    RETURN_WHAT,
    HistoryEntry,
    HistoryKind,
    TrackRecord,
    lemon_raw,
    return_refusal,
    summarize,
)
from gridwatch.playbooks.model import ACTING_STEPS
from gridwatch.playbooks.plans import Incident, Plan, PlannedStep

INCIDENT_STATES: tuple[str, ...] = ("open", "acknowledged", "silenced", "resolved")
# Step states: planned -> running -> done | failed; or skipped, escalated,
# awaiting_confirmation (-> running on confirm, declined), interrupted (the
# console stopped while it ran: not repeated, since we cannot know if it acted),
# pending (a drain waiting for an unreachable controller: retried, not finished).
STEP_DONE_STATES: frozenset[str] = frozenset({"done", "failed", "skipped", "escalated", "declined", "interrupted"})

# PRAGMA user_version of a database this code made; a newer one is refused, 0 is a file from before versions.
# 1 -> 2: incidents keep when their fault happened (fault_at) and the training step then (fault_step), so
# the time to detect and to recover of each is in the file (view incident_times).
# 2 -> 3: the history table (per node and per GPU), filled on upgrade from the incidents, steps and audit kept.
SCHEMA_VERSION = 3
_TABLES = frozenset({"incidents", "steps", "audit"})
# SQLite result codes meaning "the disk will not take it now", kept for a retry (sqlite3.h).
_RETRYABLE = frozenset({5, 6, 8, 10, 13, 14})  # BUSY, LOCKED, READONLY, IOERR, FULL, CANTOPEN

Op = tuple[str, tuple[Any, ...]]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS incidents (
    id TEXT PRIMARY KEY, playbook TEXT NOT NULL, node TEXT NOT NULL, gpu INTEGER,
    kind TEXT NOT NULL, severity TEXT NOT NULL, scope TEXT NOT NULL, summary TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'open', silenced_until REAL, symptoms INTEGER NOT NULL DEFAULT 1,
    detected_at REAL NOT NULL, acted_at REAL, recovered_at REAL, resolved_at REAL,
    acknowledged_by TEXT, incident_json BLOB NOT NULL, fault_at REAL, fault_step INTEGER
);
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


class StoreError(ValueError):
    """The incident database cannot be used (not ours, newer, not a database); the message says why."""


class UnknownIncident(KeyError):
    """No incident or step with that id: the message says which."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown incident"


def time_to_detect(fault_at: float | None, detected_at: float) -> float | None:
    """TTD: from the fault to the incident; None while the fault's time is unknown."""
    return None if fault_at is None else max(detected_at - fault_at, 0.0)


def time_to_recover(fault_at: float | None, recovered_at: float | None) -> float | None:
    """TTR: from the fault to the job training past the step it was at; None until both are known."""
    if fault_at is None or recovered_at is None:
        return None
    return max(recovered_at - fault_at, 0.0)


class IncidentRecord(msgspec.Struct, kw_only=True):
    """An incident as the console lists it. ``state`` is already corrected for expired silences."""

    id: str
    playbook: str
    node: str
    gpu: int | None
    kind: str
    severity: str
    scope: str
    summary: str
    state: str  # open | acknowledged | silenced | resolved
    silenced_until: float | None
    symptoms: int
    detected_at: float
    acted_at: float | None
    recovered_at: float | None
    resolved_at: float | None
    acknowledged_by: str | None
    fault_at: float | None = None  # when the fault happened, as near as the console can tell
    fault_step: int | None = None  # the job's training step then; recovered once the job trains past it
    steps_lost: int | None = None  # steps done again because of it (known once it recovered)
    gpu_hours_lost: float | None = None  # the job's GPUs times the training time it lost
    blamed: list[str] = []  # the nodes the collective records name as the cause
    blame_why: str = ""  # the records' sentence ("rank 2 on node-3 never entered all_reduce #4181; ...")

    @property
    def detect_s(self) -> float | None:
        return time_to_detect(self.fault_at, self.detected_at)

    @property
    def recover_s(self) -> float | None:
        return time_to_recover(self.fault_at, self.recovered_at)


class StepRecord(msgspec.Struct, kw_only=True):
    """A planned step and what became of it."""

    id: str
    incident: str
    index: int
    step: str
    target: str
    decision: str
    reason: str
    state: str
    started_at: float | None
    finished_at: float | None
    outcome: str
    planned: PlannedStep


class AuditEntry(msgspec.Struct, kw_only=True):
    """Who did what, why, and how it went; one row before and one after every action."""

    id: int
    ts: float
    who: str
    what: str
    why: str
    incident: str | None
    step: str | None
    phase: str  # before | after | operator | engine
    outcome: str


# The columns a version 1 file must have (what an older file is checked against) ...
_V1_INCIDENT_COLS = ("id, playbook, node, gpu, kind, severity, scope, summary, state, silenced_until, symptoms, "
                     "detected_at, acted_at, recovered_at, resolved_at, acknowledged_by")
# ... and the ones read.
_INCIDENT_COLS = _V1_INCIDENT_COLS + ", " + ", ".join(name for name, _ in (*_V2_COLUMNS, *_COST_COLUMNS,
                                                                          *_BLAME_COLUMNS))
_STEP_COLS = "id, incident, idx, step, target, decision, reason, state, started_at, finished_at, outcome, planned_json"


class IncidentStore:
    """One SQLite file; every write is committed at once so a crash loses nothing recorded.

    ``on_trouble`` is called with a sentence when writes start being held in
    memory and with None once they are all on disk again.
    """

    def __init__(self, path: str | Path, clock: Clock | None = None,
                 on_trouble: Callable[[str | None], None] | None = None) -> None:
        self.path = str(path)
        self.clock = clock or SystemClock()
        self.on_trouble = on_trouble
        self.trouble: str | None = None  # why writes are held in memory, or None
        self.bad_rows: list[str] = []  # "<file>: <table> row <rowid>: why", once each
        self._pending: list[list[Op]] = []  # writes the disk refused, oldest first
        self._mem: sqlite3.Connection | None = None  # the file's content plus the pending writes
        if self.path != ":memory:":
            _create_private(self.path)
            why = _refusal(self.path)
            if why:
                raise StoreError(f"refusing the incident database: {why}, and its unfinished plans would be "
                                 "resumed as this console's own; give another --db")
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None)
            self._open()
            if self.path != ":memory:":
                _tighten(self.path)
        except sqlite3.OperationalError as exc:
            raise StoreError(f"cannot open the incident database {self.path}: {exc}") from None
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path} is not an incident database: {exc}") from None

    def _open(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.path} was written by a newer gridwatch (schema {version}, this one reads "
                             f"{SCHEMA_VERSION}); use that version or another --db")
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")} - {"sqlite_sequence"}
        if version == 0 and tables and not _TABLES <= tables:
            raise StoreError(f"{self.path} is not an incident database (it holds tables "
                             f"{', '.join(sorted(tables))}); give another --db")
        if version == 0 and tables:
            missing = self._missing_columns()
            if missing:
                raise StoreError(f"{self.path} is not an incident database of this shape "
                                 f"(missing {', '.join(missing)}); give another --db")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        if tables and version < 2:
            self._migrate_to_2()
        self._db.executescript(_SCHEMA)
        have = {r[1] for r in self._db.execute("PRAGMA table_info(incidents)")}
        for name, kind in (*_COST_COLUMNS, *_BLAME_COLUMNS):
            if name not in have:
                self._db.execute(f"ALTER TABLE incidents ADD COLUMN {name} {kind}")
        if tables and version < 3:
            self._migrate_to_3()
        if version != SCHEMA_VERSION:
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _migrate_to_2(self) -> None:
        """Version 1 -> 2: the fault's time and step on each incident; older rows keep them empty."""
        have = {r[1] for r in self._db.execute("PRAGMA table_info(incidents)")}
        self._db.execute("BEGIN")
        for name, kind in _V2_COLUMNS:
            if name not in have:
                self._db.execute(f"ALTER TABLE incidents ADD COLUMN {name} {kind}")
        self._db.execute("PRAGMA user_version=2")
        self._db.execute("COMMIT")
        logger.info("{}: incident database upgraded to schema 2", self.path)

    def _migrate_to_3(self) -> None:
        """Version 2 -> 3: the history, filled from the incidents, acting steps and returns to service kept.

        A row whose time or node is not what it should be is left out of the
        history and named (``bad_rows``); the rest carries over. Run again on
        an open that failed half-way, it adds nothing twice (each row has a ref).
        """
        self._db.execute("BEGIN")
        try:
            for sql, params in _BACKFILL:
                self._db.execute(sql, params)
            self._db.execute("PRAGMA user_version=3")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        for (rowid,) in self._db.execute(f"SELECT rowid FROM incidents WHERE NOT ({_SANE_INCIDENT})").fetchall():
            self.report_bad_row("incidents", rowid, "left out of the history: its node or detection time is unreadable")
        logger.info("{}: incident database upgraded to schema 3 (history per node and GPU)", self.path)

    def _missing_columns(self) -> list[str]:
        wanted = {"incidents": [c.strip() for c in _V1_INCIDENT_COLS.split(",")] + ["incident_json"],
                  "steps": [c.strip() for c in _STEP_COLS.split(",")]}
        missing = []
        for table, cols in wanted.items():
            have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            missing += [f"{table}.{c}" for c in cols if c not in have]
        return missing

    def close(self) -> None:
        if self._pending:
            self.retry()
        if self._pending:
            logger.error("{}: {} writes could not be saved before closing ({})", self.path, len(self._pending),
                         self.trouble)
        self._db.close()
        if self._mem is not None:
            self._mem.close()

    # ----------------------------------------------------------- writing

    @property
    def _read(self) -> sqlite3.Connection:
        # While writes are held, the memory copy is the truth: it has them.
        return self._mem if self._mem is not None else self._db

    def _write(self, ops: list[Op]) -> int:
        """Run ``ops`` as one transaction; held in memory if the disk refuses. Returns the last row id."""
        if self._pending:
            self.retry()
        if not self._pending:
            try:
                return _apply(self._db, ops)
            except sqlite3.OperationalError as exc:
                if getattr(exc, "sqlite_errorcode", 0) & 0xFF not in _RETRYABLE:
                    raise
                self._hold(exc)
        assert self._mem is not None
        self._pending.append(ops)
        return _apply(self._mem, ops)

    def _hold(self, exc: sqlite3.Error) -> None:
        """The disk refused a write: from now on reads and writes go to a copy in memory."""
        mem = sqlite3.connect(":memory:", isolation_level=None)
        self._db.backup(mem)
        self._mem = mem
        self.trouble = (f"the incident database {self.path} cannot be written ({exc}); incidents are acted on "
                        f"and kept in memory until it can")
        logger.error(self.trouble)
        if self.on_trouble is not None:
            self.on_trouble(self.trouble)

    def retry(self) -> bool:
        """Try the held writes again, in order; True when nothing is held any more."""
        while self._pending:
            try:
                _apply(self._db, self._pending[0])
            except sqlite3.OperationalError as exc:
                if getattr(exc, "sqlite_errorcode", 0) & 0xFF not in _RETRYABLE:
                    raise
                return False
            self._pending.pop(0)
        if self._mem is not None:
            self._mem.close()
            self._mem = None
            logger.info("the incident database {} is written again; nothing was lost", self.path)
            self.trouble = None
            if self.on_trouble is not None:
                self.on_trouble(None)
        return True

    @property
    def held(self) -> int:
        """How many writes wait in memory for the disk."""
        return len(self._pending)

    # -------------------------------------------------------------- incidents

    def save_plan(self, plan: Plan) -> list[StepRecord]:
        """Record an incident and its plan, whole or not at all; steps already recorded are left as they are.

        The incident and each step let change something go into the history too.
        """
        incident = plan.incident
        ops = [self._upsert_op(incident)]
        for step in plan.steps:
            ops.append((
                "INSERT OR IGNORE INTO steps (id, incident, idx, step, target, decision, reason, state, planned_json)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, 'planned', ?)",
                (step.id, step.incident, step.index, step.step, step.target, step.decision, step.reason,
                 msgspec.json.encode(step)),
            ))
        ops.append(_history_op(HistoryEntry(kind=HistoryKind.INCIDENT, at=incident.opened_at, node=incident.node,
                                            gpu=incident.gpu, incident=incident.id, playbook=incident.playbook,
                                            what=incident.kind, severity=incident.severity)))
        ops += [_history_op(HistoryEntry(kind=HistoryKind.REMEDIATION, at=step.at, node=incident.node, gpu=incident.gpu,
                                         incident=incident.id, playbook=incident.playbook, what=step.step,
                                         outcome="planned", step=step.id))
                for step in plan.steps if step.decision == "act" and step.step in ACTING_STEPS]
        self._write(ops)
        return self.steps(plan.incident.id)

    def upsert_incident(self, incident: Incident) -> None:
        """Insert an incident, or refresh what the engine learnt since (symptoms, recovery)."""
        self._write([self._upsert_op(incident)])

    @staticmethod
    def _upsert_op(incident: Incident) -> Op:
        blob = msgspec.json.encode(incident)
        return (
            "INSERT INTO incidents (id, playbook, node, gpu, kind, severity, scope, summary, symptoms, detected_at,"
            " recovered_at, incident_json, blamed, blame_why) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(id) DO UPDATE SET node=excluded.node, summary=excluded.summary,"
            " symptoms=excluded.symptoms, recovered_at=COALESCE(incidents.recovered_at, excluded.recovered_at),"
            " incident_json=excluded.incident_json, blamed=excluded.blamed, blame_why=excluded.blame_why",
            (incident.id, incident.playbook, incident.node, incident.gpu, incident.kind, incident.severity,
             incident.scope, incident.summary, incident.symptoms, incident.opened_at, incident.recovered_at, blob,
             msgspec.json.encode(incident.blamed).decode(), incident.blame_why),
        )

    def incident(self, incident_id: str) -> IncidentRecord | None:
        row = self._read.execute(f"SELECT rowid, {_INCIDENT_COLS} FROM incidents WHERE id = ?",
                                 (incident_id,)).fetchone()
        return self._incident_row(row) if row else None

    def stored_incident(self, incident_id: str) -> Incident | None:
        """The engine's incident as it was last saved (for resuming its plan); None if missing or unreadable."""
        row = self._read.execute("SELECT rowid, incident_json FROM incidents WHERE id = ?", (incident_id,)).fetchone()
        if row is None:
            return None
        try:
            return msgspec.json.decode(row[1], type=Incident)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
            self.report_bad_row("incidents", row[0], f"incident_json: {exc}")
            return None

    def incidents(self, states: Iterable[str] | None = None, limit: int = 500) -> list[IncidentRecord]:
        """Newest first; ``states`` filters on the effective state (an expired silence is open)."""
        rows = self._read.execute(
            f"SELECT rowid, {_INCIDENT_COLS} FROM incidents ORDER BY detected_at DESC, id LIMIT ?", (limit,)
        ).fetchall()
        records = [r for r in map(self._incident_row, rows) if r is not None]
        wanted = set(states) if states is not None else None
        return [r for r in records if wanted is None or r.state in wanted]

    def incidents_since(self, since: float) -> list[IncidentRecord]:
        """Every incident detected at or after ``since``, oldest first (what a restarted engine remembers)."""
        rows = self._read.execute(
            f"SELECT rowid, {_INCIDENT_COLS} FROM incidents WHERE detected_at >= ? ORDER BY detected_at, id", (since,)
        ).fetchall()
        return [r for r in map(self._incident_row, rows) if r is not None]

    def acknowledge(self, incident_id: str, who: str, why: str = "") -> IncidentRecord:
        """Someone is on it: it stays listed but stops paging."""
        self._require(incident_id)
        self._write([("UPDATE incidents SET state='acknowledged', acknowledged_by=?, silenced_until=NULL"
                      " WHERE id=? AND state != 'resolved'", (who, incident_id)),
                     self._audit_op(who, "acknowledge", why, incident_id, None, "operator", "")])
        return self._require(incident_id)

    def silence(self, incident_id: str, who: str, until: float, why: str = "") -> IncidentRecord:
        """Quiet until ``until`` (epoch seconds); it is open again after that by itself."""
        self._require(incident_id)
        if until <= self.clock.now():
            raise ValueError("a silence must end in the future")
        self._write([("UPDATE incidents SET state='silenced', silenced_until=? WHERE id=? AND state != 'resolved'",
                      (until, incident_id)),
                     self._audit_op(who, "silence", why, incident_id, None, "operator", f"until {until:.0f}")])
        return self._require(incident_id)

    def resolve(self, incident_id: str, who: str, why: str = "") -> IncidentRecord:
        """Done with it. Tell the engine too (``Engine.resolve``) so a new symptom opens a new incident."""
        self._require(incident_id)
        self._write([("UPDATE incidents SET state='resolved', resolved_at=COALESCE(resolved_at, ?),"
                      " silenced_until=NULL WHERE id=?", (self.clock.now(), incident_id)),
                     self._audit_op(who, "resolve", why, incident_id, None, "operator", "")])
        return self._require(incident_id)

    def mark_acted(self, incident_id: str, when: float) -> None:
        self._write([("UPDATE incidents SET acted_at=COALESCE(acted_at, ?) WHERE id=?", (when, incident_id))])

    def mark_recovered(self, incident_id: str, when: float) -> None:
        self._write([("UPDATE incidents SET recovered_at=COALESCE(recovered_at, ?) WHERE id=?", (when, incident_id))])

    def mark_cost(self, incident_id: str, steps_lost: int, gpu_hours_lost: float) -> None:
        """What the incident cost the job (gridwatch.console.fleet.goodput); the latest answer stays."""
        self._write([("UPDATE incidents SET steps_lost=?, gpu_hours_lost=? WHERE id=?",
                      (steps_lost, gpu_hours_lost, incident_id))])

    def mark_fault(self, incident_id: str, at: float, step: int | None) -> None:
        """When the fault behind an incident happened and the job's step then; the first answer stays."""
        self._write([("UPDATE incidents SET fault_at=COALESCE(fault_at, ?), fault_step=COALESCE(fault_step, ?)"
                      " WHERE id=?", (at, step, incident_id))])

    # ------------------------------------------------------------------ steps

    def steps(self, incident_id: str) -> list[StepRecord]:
        rows = self._read.execute(f"SELECT rowid, {_STEP_COLS} FROM steps WHERE incident=? ORDER BY idx",
                                  (incident_id,))
        return [r for r in map(self._step_row, rows.fetchall()) if r is not None]

    def step(self, step_id: str) -> StepRecord | None:
        row = self._read.execute(f"SELECT rowid, {_STEP_COLS} FROM steps WHERE id=?", (step_id,)).fetchone()
        return self._step_row(row) if row else None

    def set_step(self, step_id: str, state: str, outcome: str = "", *, started: bool = False,
                 decision: str | None = None) -> None:
        now = self.clock.now()
        ops: list[Op]
        if started:
            ops = [("UPDATE steps SET state=?, started_at=?, outcome=? WHERE id=?", (state, now, outcome, step_id))]
        elif state in STEP_DONE_STATES:
            ops = [("UPDATE steps SET state=?, finished_at=?, outcome=? WHERE id=?", (state, now, outcome, step_id))]
        else:
            ops = [("UPDATE steps SET state=?, outcome=? WHERE id=?", (state, outcome, step_id))]
        if decision is not None:
            ops.append(("UPDATE steps SET decision=? WHERE id=?", (decision, step_id)))
        # A step that changes something is a remediation in the history, with how it went.
        ops.append((_REMEDIATION_FROM_STEP, (now, step_id)))
        ops.append(("UPDATE history SET outcome=?, reason=? WHERE ref=?", (state, outcome, f"step:{step_id}")))
        self._write(ops)

    def unfinished(self) -> list[str]:
        """Incidents whose plan has a step not yet run (a console restart resumes these)."""
        rows = self._read.execute("SELECT DISTINCT s.incident FROM steps s JOIN incidents i ON i.id = s.incident"
                                  " WHERE s.state IN ('planned', 'running', 'pending') AND i.state != 'resolved'"
                                  " ORDER BY s.incident").fetchall()
        return [r[0] for r in rows if isinstance(r[0], str)]

    # ------------------------------------------------------------------ audit

    def _audit_op(self, who: str, what: str, why: str, incident: str | None, step: str | None, phase: str,
                  outcome: str) -> Op:
        return ("INSERT INTO audit (ts, who, what, why, incident, step, phase, outcome) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (self.clock.now(), who, what, why, incident, step, phase, outcome))

    def audit(self, who: str, what: str, why: str, *, incident: str | None = None, step: str | None = None,
              phase: str = "operator", outcome: str = "") -> None:
        ops = [self._audit_op(who, what, why, incident, step, phase, outcome)]
        if what.startswith(f"{RETURN_WHAT} ") and phase == "after":
            # The record of a return to service is its audit row; the history keeps it per node.
            ops.append(("INSERT INTO history (at, kind, node, incident, outcome, reason, who, ref)"
                        " VALUES (?, 'return', ?, ?, ?, ?, ?, 'audit:' || last_insert_rowid())",
                        (self.clock.now(), what[len(RETURN_WHAT) + 1:], incident, outcome, why, who)))
        self._write(ops)

    def audit_log(self, incident: str | None = None, limit: int = 1000) -> list[AuditEntry]:
        """Oldest first, for one incident or all."""
        cols = "id, ts, who, what, why, incident, step, phase, outcome"
        if incident is None:
            rows = self._read.execute(f"SELECT {cols} FROM audit ORDER BY id LIMIT ?", (limit,))
        else:
            rows = self._read.execute(f"SELECT {cols} FROM audit WHERE incident=? ORDER BY id LIMIT ?",
                                      (incident, limit))
        entries = []
        for r in rows.fetchall():
            fields = dict(zip(("id", "ts", "who", "what", "why", "incident", "step", "phase", "outcome"), r))
            try:
                entries.append(msgspec.convert(fields, AuditEntry))
            except msgspec.ValidationError as exc:
                self.report_bad_row("audit", r[0], str(exc))
        return entries

    # ---------------------------------------------------------------- history

    def record_history(self, entries: Iterable[HistoryEntry]) -> None:
        """What the engine knows of an incident beyond its plan (GPU UUID, XID code, rule verdicts); verdicts audited."""
        ops: list[Op] = []
        for e in entries:
            ops.append(_history_op(e))
            if e.kind == HistoryKind.DECISION:
                what = f"history {e.what}: {e.verdict}" + (" (shadow: nothing changed)" if e.shadow else "")
                ops.append(self._audit_op("engine", what, e.reason, e.incident or None, None, "engine",
                                          "recorded only" if e.shadow else "decided"))
        if ops:
            self._write(ops)

    def history(self, node: str | None = None, *, gpu: int | None = None, gpu_uuid: str = "",
                since: float | None = None) -> list[HistoryEntry]:
        """History rows, oldest first: of a node; of one of its GPUs (followed by UUID, where known, across
        nodes); of the GPU with ``gpu_uuid``; or of every node."""
        where: list[str] = []
        params: list[Any] = []
        if gpu is not None and node is not None and not gpu_uuid:
            gpu_uuid = self.gpu_uuid(node, gpu)
        if gpu_uuid and gpu is not None and node is not None:
            where.append("(h.gpu_uuid = ? OR (h.node = ? AND h.gpu = ? AND h.gpu_uuid = ''))")
            params += [gpu_uuid, node, gpu]
        elif gpu_uuid:
            where.append("h.gpu_uuid = ?")
            params.append(gpu_uuid)
        elif node is not None:
            where.append("h.node = ?")
            params.append(node)
            if gpu is not None:
                where.append("h.gpu = ?")
                params.append(gpu)
        if since is not None:
            where.append("h.at >= ?")
            params.append(since)
        sql = (f"SELECT {_HISTORY_COLS}, i.fault_at, i.recovered_at FROM history h"
               " LEFT JOIN incidents i ON h.kind = 'incident' AND i.id = h.incident"
               + (f" WHERE {' AND '.join(where)}" if where else "") + " ORDER BY h.at, h.id")
        return [e for e in map(self._history_row, self._read.execute(sql, params).fetchall()) if e is not None]

    def gpu_uuid(self, node: str, gpu: int) -> str:
        """The UUID last recorded for GPU ``gpu`` of ``node``; '' when its agent never said."""
        row = self._read.execute("SELECT gpu_uuid FROM history WHERE node = ? AND gpu = ? AND gpu_uuid != ''"
                                 " ORDER BY at DESC, id DESC LIMIT 1", (node, gpu)).fetchone()
        return str(row[0]) if row else ""

    def history_nodes(self) -> list[str]:
        """Every node with a history here."""
        return [str(r[0]) for r in self._read.execute("SELECT DISTINCT node FROM history ORDER BY node").fetchall()]

    def fleet_lemon(self, now: float | None = None) -> dict[str, float]:
        """Every node's raw lemon score (gridwatch.playbooks.history.lemon_raw) over the last 30 days."""
        now = self.clock.now() if now is None else now
        by_node: dict[str, list[HistoryEntry]] = {}
        for e in self.history(since=now - LEMON_WINDOW):
            by_node.setdefault(e.node, []).append(e)
        return {node: lemon_raw(rows, now) for node, rows in by_node.items()}

    def node_history(self, node: str, *, gpu: int | None = None, now: float | None = None,
                     limit: int = 20) -> TrackRecord:
        """A node's (or one of its GPUs') history with its mean time between incidents and lemon score."""
        now = self.clock.now() if now is None else now
        uuid = self.gpu_uuid(node, gpu) if gpu is not None else ""
        rows = self.history(node, gpu=gpu, gpu_uuid=uuid)
        return summarize(node, rows, now, self.fleet_lemon(now).values(), limit, gpu, uuid)

    def return_refusal(self, node: str) -> str | None:
        """Why a history rule keeps ``node`` out of service now (one line), or None."""
        return return_refusal(self.history(node), node)

    def _history_row(self, row: tuple) -> HistoryEntry | None:
        fields = dict(zip(_HISTORY_FIELDS, row[1:len(_HISTORY_FIELDS) + 1]))
        if isinstance(fields["shadow"], int):
            fields["shadow"] = bool(fields["shadow"])
        try:
            entry = msgspec.convert(fields, HistoryEntry)
        except msgspec.ValidationError as exc:
            self.report_bad_row("history", row[0], str(exc))
            return None
        fault_at, recovered_at = row[-2:]
        if entry.kind == HistoryKind.INCIDENT and isinstance(fault_at, (int, float)) \
                and isinstance(recovered_at, (int, float)):
            entry.ttr = time_to_recover(fault_at, recovered_at)
        return entry

    # -------------------------------------------------------------- internals

    def _require(self, incident_id: str) -> IncidentRecord:
        record = self.incident(incident_id)
        if record is None:
            raise UnknownIncident(f"no incident {incident_id!r} in {self.path}")
        return record

    def report_bad_row(self, table: str, rowid: Any, why: str) -> None:
        """Report a row that does not decode, once; the rest of the database stays usable."""
        note = f"{self.path}: {table} row {rowid}: {why}"
        if note not in self.bad_rows:
            self.bad_rows.append(note)
            logger.warning("skipped a bad row: {}", note)

    def _incident_row(self, row: tuple) -> IncidentRecord | None:
        fields = dict(zip([c.strip() for c in _INCIDENT_COLS.split(",")], row[1:]))
        try:
            fields["blamed"] = msgspec.json.decode(fields.get("blamed") or "[]")
            record = msgspec.convert(fields, IncidentRecord)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self.report_bad_row("incidents", row[0], str(exc))
            return None
        if record.state == "silenced" and (record.silenced_until or 0) <= self.clock.now():
            record.state = "open"  # the silence ran out
        return record

    def _step_row(self, row: tuple) -> StepRecord | None:
        fields = dict(zip(("id", "incident", "index", "step", "target", "decision", "reason", "state", "started_at",
                           "finished_at", "outcome"), row[1:12]))
        try:
            fields["planned"] = msgspec.json.decode(row[12], type=PlannedStep)
            return msgspec.convert(fields, StepRecord)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
            self.report_bad_row("steps", row[0], str(exc))
            return None


_HISTORY_FIELDS = ("at", "kind", "node", "gpu", "gpu_uuid", "gpu_serial", "incident", "playbook", "what", "code",
                   "severity", "outcome", "verdict", "shadow", "reason", "who", "step")
_HISTORY_COLS = "h.id, " + ", ".join(f"h.{c}" if c != "incident" else "COALESCE(h.incident, '')"
                                     for c in _HISTORY_FIELDS)
_ACTING_SQL = ", ".join(f"'{s}'" for s in sorted(ACTING_STEPS))
_REMEDIATION_FROM_STEP = (
    "INSERT OR IGNORE INTO history (at, kind, node, gpu, incident, playbook, what, outcome, reason, step, ref)"
    " SELECT COALESCE(s.started_at, ?), 'remediation', i.node, i.gpu, s.incident, i.playbook, s.step, s.state,"
    " s.outcome, s.id, 'step:' || s.id FROM steps s JOIN incidents i ON i.id = s.incident"
    f" WHERE s.id = ? AND s.decision = 'act' AND s.step IN ({_ACTING_SQL})"
)
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
     f" WHERE s.decision = 'act' AND s.step IN ({_ACTING_SQL}) AND typeof(i.detected_at) IN ('real', 'integer')"
     " AND typeof(i.node) = 'text'", ()),
    ("INSERT OR IGNORE INTO history (at, kind, node, incident, outcome, reason, who, ref)"
     " SELECT ts, 'return', substr(what, ?), incident, outcome, why, who, 'audit:' || id FROM audit"
     " WHERE what LIKE ? AND phase = 'after' AND typeof(ts) IN ('real', 'integer')",
     (len(RETURN_WHAT) + 2, f"{RETURN_WHAT} %")),
)


def _history_ref(e: HistoryEntry) -> str | None:
    """What makes a row one of a kind, so recording it twice changes nothing (a return to service: its audit id)."""
    if e.kind == HistoryKind.INCIDENT:
        return f"incident:{e.incident}"
    if e.kind == HistoryKind.REMEDIATION:
        return f"step:{e.step}"
    if e.kind == HistoryKind.DECISION:
        return f"decision:{e.incident}:{e.what}"
    return None


def _history_op(e: HistoryEntry) -> Op:
    # Recorded again (by the executor, or with what the engine knows), a row only gains the GPU's identity and code.
    return (
        "INSERT INTO history (at, kind, node, gpu, gpu_uuid, gpu_serial, incident, playbook, what, code, severity,"
        " outcome, verdict, shadow, reason, who, step, ref) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT(ref) DO UPDATE SET"
        " gpu_uuid = CASE WHEN excluded.gpu_uuid != '' THEN excluded.gpu_uuid ELSE history.gpu_uuid END,"
        " gpu_serial = CASE WHEN excluded.gpu_serial != '' THEN excluded.gpu_serial ELSE history.gpu_serial END,"
        " code = COALESCE(history.code, excluded.code)",
        (e.at, str(e.kind), e.node, e.gpu, e.gpu_uuid, e.gpu_serial, e.incident or None, e.playbook, e.what, e.code,
         e.severity, e.outcome, e.verdict, int(e.shadow), e.reason, e.who, e.step, _history_ref(e)),
    )


def _apply(db: sqlite3.Connection, ops: list[Op]) -> int:
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


def _create_private(path: str) -> None:
    """Create the database file 0600: SQLite gives its -wal and -journal the mode of the database."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return
    os.close(fd)


def _refusal(path: str) -> str:
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


def _tighten(path: str) -> None:
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
