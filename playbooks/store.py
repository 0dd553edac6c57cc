"""The incident store in SQLite: incidents, their planned steps, and the audit log.

The console shows and changes incidents through this API (acknowledge, silence
with an expiry, resolve); the executor records every step here before and after
it runs, which is what makes a resumed plan skip what already happened.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Iterable

import msgspec

from playbooks.clock import Clock, SystemClock
from playbooks.plans import Incident, Plan, PlannedStep

INCIDENT_STATES: tuple[str, ...] = ("open", "acknowledged", "silenced", "resolved")
# Step states: planned -> running -> done | failed; or skipped, escalated,
# awaiting_confirmation (-> running on confirm, declined), interrupted (the
# console stopped while it ran: not repeated, since we cannot know if it acted).
STEP_DONE_STATES: frozenset[str] = frozenset({"done", "failed", "skipped", "escalated", "declined", "interrupted"})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS incidents (
    id TEXT PRIMARY KEY, playbook TEXT NOT NULL, node TEXT NOT NULL, gpu INTEGER,
    kind TEXT NOT NULL, severity TEXT NOT NULL, scope TEXT NOT NULL, summary TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'open', silenced_until REAL, symptoms INTEGER NOT NULL DEFAULT 1,
    detected_at REAL NOT NULL, acted_at REAL, recovered_at REAL, resolved_at REAL,
    acknowledged_by TEXT, incident_json BLOB NOT NULL
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
"""


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


_INCIDENT_COLS = ("id, playbook, node, gpu, kind, severity, scope, summary, state, silenced_until, symptoms, "
                  "detected_at, acted_at, recovered_at, resolved_at, acknowledged_by")
_STEP_COLS = "id, incident, idx, step, target, decision, reason, state, started_at, finished_at, outcome, planned_json"


class IncidentStore:
    """One SQLite file; every write is committed at once so a crash loses nothing recorded."""

    def __init__(self, path: str | Path, clock: Clock | None = None) -> None:
        self.path = str(path)
        self.clock = clock or SystemClock()
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    # -------------------------------------------------------------- incidents

    def save_plan(self, plan: Plan) -> list[StepRecord]:
        """Record an incident and its plan; steps already recorded are left as they are."""
        self.upsert_incident(plan.incident)
        # One transaction: a plan is recorded whole or not at all.
        self._db.execute("BEGIN")
        try:
            for step in plan.steps:
                self._db.execute(
                    "INSERT OR IGNORE INTO steps (id, incident, idx, step, target, decision, reason, state, planned_json)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, 'planned', ?)",
                    (step.id, step.incident, step.index, step.step, step.target, step.decision, step.reason,
                     msgspec.json.encode(step)),
                )
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return self.steps(plan.incident.id)

    def upsert_incident(self, incident: Incident) -> None:
        """Insert an incident, or refresh what the engine learnt since (symptoms, recovery)."""
        blob = msgspec.json.encode(incident)
        self._db.execute(
            "INSERT INTO incidents (id, playbook, node, gpu, kind, severity, scope, summary, symptoms, detected_at,"
            " recovered_at, incident_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(id) DO UPDATE SET node=excluded.node, summary=excluded.summary,"
            " symptoms=excluded.symptoms, recovered_at=COALESCE(incidents.recovered_at, excluded.recovered_at),"
            " incident_json=excluded.incident_json",
            (incident.id, incident.playbook, incident.node, incident.gpu, incident.kind, incident.severity,
             incident.scope, incident.summary, incident.symptoms, incident.opened_at, incident.recovered_at, blob),
        )

    def incident(self, incident_id: str) -> IncidentRecord | None:
        row = self._db.execute(f"SELECT {_INCIDENT_COLS} FROM incidents WHERE id = ?", (incident_id,)).fetchone()
        return self._incident_row(row) if row else None

    def stored_incident(self, incident_id: str) -> Incident | None:
        """The engine's incident as it was last saved (for resuming its plan)."""
        row = self._db.execute("SELECT incident_json FROM incidents WHERE id = ?", (incident_id,)).fetchone()
        return msgspec.json.decode(row[0], type=Incident) if row else None

    def incidents(self, states: Iterable[str] | None = None, limit: int = 500) -> list[IncidentRecord]:
        """Newest first; ``states`` filters on the effective state (an expired silence is open)."""
        rows = self._db.execute(
            f"SELECT {_INCIDENT_COLS} FROM incidents ORDER BY detected_at DESC, id LIMIT ?", (limit,)
        ).fetchall()
        records = [self._incident_row(r) for r in rows]
        wanted = set(states) if states is not None else None
        return [r for r in records if wanted is None or r.state in wanted]

    def incidents_since(self, since: float) -> list[IncidentRecord]:
        """Every incident detected at or after ``since``, oldest first (what a restarted engine remembers)."""
        rows = self._db.execute(
            f"SELECT {_INCIDENT_COLS} FROM incidents WHERE detected_at >= ? ORDER BY detected_at, id", (since,)
        ).fetchall()
        return [self._incident_row(r) for r in rows]

    def acknowledge(self, incident_id: str, who: str, why: str = "") -> IncidentRecord:
        """Someone is on it: it stays listed but stops paging."""
        self._require(incident_id)
        self._db.execute("UPDATE incidents SET state='acknowledged', acknowledged_by=?, silenced_until=NULL"
                         " WHERE id=? AND state != 'resolved'", (who, incident_id))
        self.audit(who, "acknowledge", why, incident=incident_id, phase="operator")
        return self._require(incident_id)

    def silence(self, incident_id: str, who: str, until: float, why: str = "") -> IncidentRecord:
        """Quiet until ``until`` (epoch seconds); it is open again after that by itself."""
        self._require(incident_id)
        if until <= self.clock.now():
            raise ValueError("a silence must end in the future")
        self._db.execute("UPDATE incidents SET state='silenced', silenced_until=? WHERE id=? AND state != 'resolved'",
                         (until, incident_id))
        self.audit(who, "silence", why, incident=incident_id, phase="operator", outcome=f"until {until:.0f}")
        return self._require(incident_id)

    def resolve(self, incident_id: str, who: str, why: str = "") -> IncidentRecord:
        """Done with it. Tell the engine too (``Engine.resolve``) so a new symptom opens a new incident."""
        self._require(incident_id)
        self._db.execute("UPDATE incidents SET state='resolved', resolved_at=COALESCE(resolved_at, ?),"
                         " silenced_until=NULL WHERE id=?", (self.clock.now(), incident_id))
        self.audit(who, "resolve", why, incident=incident_id, phase="operator")
        return self._require(incident_id)

    def mark_acted(self, incident_id: str, when: float) -> None:
        self._db.execute("UPDATE incidents SET acted_at=COALESCE(acted_at, ?) WHERE id=?", (when, incident_id))

    def mark_recovered(self, incident_id: str, when: float) -> None:
        self._db.execute("UPDATE incidents SET recovered_at=COALESCE(recovered_at, ?) WHERE id=?", (when, incident_id))

    # ------------------------------------------------------------------ steps

    def steps(self, incident_id: str) -> list[StepRecord]:
        rows = self._db.execute(f"SELECT {_STEP_COLS} FROM steps WHERE incident=? ORDER BY idx", (incident_id,))
        return [self._step_row(r) for r in rows.fetchall()]

    def step(self, step_id: str) -> StepRecord | None:
        row = self._db.execute(f"SELECT {_STEP_COLS} FROM steps WHERE id=?", (step_id,)).fetchone()
        return self._step_row(row) if row else None

    def set_step(self, step_id: str, state: str, outcome: str = "", *, started: bool = False,
                 decision: str | None = None) -> None:
        now = self.clock.now()
        if started:
            self._db.execute("UPDATE steps SET state=?, started_at=?, outcome=? WHERE id=?", (state, now, outcome, step_id))
        elif state in STEP_DONE_STATES:
            self._db.execute("UPDATE steps SET state=?, finished_at=?, outcome=? WHERE id=?", (state, now, outcome, step_id))
        else:
            self._db.execute("UPDATE steps SET state=?, outcome=? WHERE id=?", (state, outcome, step_id))
        if decision is not None:
            self._db.execute("UPDATE steps SET decision=? WHERE id=?", (decision, step_id))

    def unfinished(self) -> list[str]:
        """Incidents whose plan has a step not yet run (a console restart resumes these)."""
        rows = self._db.execute("SELECT DISTINCT s.incident FROM steps s JOIN incidents i ON i.id = s.incident"
                                " WHERE s.state IN ('planned', 'running') AND i.state != 'resolved'"
                                " ORDER BY s.incident").fetchall()
        return [r[0] for r in rows]

    # ------------------------------------------------------------------ audit

    def audit(self, who: str, what: str, why: str, *, incident: str | None = None, step: str | None = None,
              phase: str = "operator", outcome: str = "") -> int:
        cur = self._db.execute(
            "INSERT INTO audit (ts, who, what, why, incident, step, phase, outcome) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (self.clock.now(), who, what, why, incident, step, phase, outcome),
        )
        return int(cur.lastrowid or 0)

    def audit_log(self, incident: str | None = None, limit: int = 1000) -> list[AuditEntry]:
        """Oldest first, for one incident or all."""
        cols = "id, ts, who, what, why, incident, step, phase, outcome"
        if incident is None:
            rows = self._db.execute(f"SELECT {cols} FROM audit ORDER BY id LIMIT ?", (limit,))
        else:
            rows = self._db.execute(f"SELECT {cols} FROM audit WHERE incident=? ORDER BY id LIMIT ?", (incident, limit))
        return [AuditEntry(id=r[0], ts=r[1], who=r[2], what=r[3], why=r[4], incident=r[5], step=r[6],
                           phase=r[7], outcome=r[8]) for r in rows.fetchall()]

    # -------------------------------------------------------------- internals

    def _require(self, incident_id: str) -> IncidentRecord:
        record = self.incident(incident_id)
        if record is None:
            raise UnknownIncident(f"no incident {incident_id!r} in {self.path}")
        return record

    def _incident_row(self, row: tuple) -> IncidentRecord:
        fields = dict(zip([c.strip() for c in _INCIDENT_COLS.split(",")], row))
        if fields["state"] == "silenced" and (fields["silenced_until"] or 0) <= self.clock.now():
            fields["state"] = "open"  # the silence ran out
        return IncidentRecord(**fields)

    def _step_row(self, row: tuple) -> StepRecord:
        return StepRecord(id=row[0], incident=row[1], index=row[2], step=row[3], target=row[4], decision=row[5],
                          reason=row[6], state=row[7], started_at=row[8], finished_at=row[9], outcome=row[10],
                          planned=msgspec.json.decode(row[11], type=PlannedStep))
