"""The incident store in SQLite: incidents, their planned steps, and the audit log.

The console shows and changes incidents through this API (acknowledge, silence
with an expiry, resolve); the executor records every step here before and after
it runs, which is what makes a resumed plan skip what already happened.

Bad luck is survived, not obeyed: a write the disk refuses (full, I/O error,
read-only) is kept in memory, the store says so (``trouble``, ``on_trouble``)
and the writes land, in order, once the disk takes them again; a row that does
not decode is skipped and reported by file and row; a database of another
program or of a newer gridwatch is refused in one sentence (``StoreError``).

Each node's and GPU's history is kept in the same file, in the table
``history`` (read and written by gridwatch.playbooks.store_history); the file
itself, its schema and its upgrades are gridwatch.playbooks.store_db's.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
from loguru import logger

from gridwatch.playbooks.clock import Clock, SystemClock
from gridwatch.playbooks.history import RETURN_WHAT, HistoryEntry, HistoryKind
from gridwatch.playbooks.incident_times import Phase, incident_phase, time_to_detect, time_to_recover
from gridwatch.playbooks.model import ACTING_STEPS
from gridwatch.playbooks.plans import Incident, Plan, PlannedStep
from gridwatch.playbooks.store_db import (
    INCIDENT_COLS,
    STEP_COLS,
    Op,
    apply,
    create_private,
    file_refusal,
    open_schema,
    tighten,
)
from gridwatch.playbooks.store_history import REMEDIATION_FROM_STEP, HistoryTable, history_op

INCIDENT_STATES: tuple[str, ...] = ("open", "acknowledged", "silenced", "resolved")
# An incident not yet resolved: its pending steps are still worth trying and its evidence is kept.
OPEN_STATES: tuple[str, ...] = INCIDENT_STATES[:3]
# Step states: planned -> running -> done | failed; or skipped, escalated,
# awaiting_confirmation (-> running on confirm, declined), interrupted (the
# console stopped while it ran: not repeated, since we cannot know if it acted),
# pending (a drain waiting for an unreachable controller: retried, not finished).
STEP_DONE_STATES: frozenset[str] = frozenset({"done", "failed", "skipped", "escalated", "declined", "interrupted"})
# SQLite result codes meaning "the disk will not take it now", kept for a retry (sqlite3.h).
_RETRYABLE = frozenset({5, 6, 8, 10, 13, 14})  # BUSY, LOCKED, READONLY, IOERR, FULL, CANTOPEN


class StoreError(ValueError):
    """The incident database cannot be used (not ours, newer, not a database); the message says why."""


class UnknownIncident(KeyError):
    """No incident or step with that id: the message says which."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown incident"


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
    def phase(self) -> Phase:
        return incident_phase(self.state, self.acted_at, self.recovered_at)

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


class IncidentStore(HistoryTable):
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
            create_private(self.path)
            why = file_refusal(self.path)
            if why:
                raise StoreError(f"refusing the incident database: {why}, and its unfinished plans would be "
                                 "resumed as this console's own; give another --db")
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None)
            why = open_schema(self._db, self.path, self.report_bad_row)
            if why:
                raise StoreError(why)
            if self.path != ":memory:":
                tighten(self.path)
        except sqlite3.OperationalError as exc:
            raise StoreError(f"cannot open the incident database {self.path}: {exc}") from None
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path} is not an incident database: {exc}") from None

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
                return apply(self._db, ops)
            except sqlite3.OperationalError as exc:
                if getattr(exc, "sqlite_errorcode", 0) & 0xFF not in _RETRYABLE:
                    raise
                self._hold(exc)
        assert self._mem is not None
        self._pending.append(ops)
        return apply(self._mem, ops)

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
                apply(self._db, self._pending[0])
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
        ops.append(history_op(HistoryEntry(kind=HistoryKind.INCIDENT, at=incident.opened_at, node=incident.node,
                                            gpu=incident.gpu, incident=incident.id, playbook=incident.playbook,
                                            what=incident.kind, severity=incident.severity)))
        ops += [history_op(HistoryEntry(kind=HistoryKind.REMEDIATION, at=step.at, node=incident.node, gpu=incident.gpu,
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
        row = self._read.execute(f"SELECT rowid, {INCIDENT_COLS} FROM incidents WHERE id = ?",
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
            f"SELECT rowid, {INCIDENT_COLS} FROM incidents ORDER BY detected_at DESC, id LIMIT ?", (limit,)
        ).fetchall()
        records = [r for r in map(self._incident_row, rows) if r is not None]
        wanted = set(states) if states is not None else None
        return [r for r in records if wanted is None or r.state in wanted]

    def open_count(self) -> int:
        """How many incidents need the operator (open, a silence that ran out included; not yet recovered): one
        COUNT, not a row built per incident, since the status line asks it every redraw and the table grows for weeks.

        A row too damaged to list (reported once as a bad row, left out of :meth:`incidents`) is counted still:
        an incident the console cannot show is one to look at, not one to forget."""
        row = self._read.execute(
            "SELECT COUNT(*) FROM incidents WHERE recovered_at IS NULL"
            " AND (state = 'open' OR (state = 'silenced' AND COALESCE(silenced_until, 0) <= ?))",
            (self.clock.now(),)).fetchone()
        return int(row[0])

    def incidents_since(self, since: float) -> list[IncidentRecord]:
        """Every incident detected at or after ``since``, oldest first (what a restarted engine remembers)."""
        rows = self._read.execute(
            f"SELECT rowid, {INCIDENT_COLS} FROM incidents WHERE detected_at >= ? ORDER BY detected_at, id", (since,)
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
        rows = self._read.execute(f"SELECT rowid, {STEP_COLS} FROM steps WHERE incident=? ORDER BY idx",
                                  (incident_id,))
        return [r for r in map(self._step_row, rows.fetchall()) if r is not None]

    def step(self, step_id: str) -> StepRecord | None:
        row = self._read.execute(f"SELECT rowid, {STEP_COLS} FROM steps WHERE id=?", (step_id,)).fetchone()
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
        ops.append((REMEDIATION_FROM_STEP, (now, step_id)))
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
        fields = dict(zip([c.strip() for c in INCIDENT_COLS.split(",")], row[1:]))
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
