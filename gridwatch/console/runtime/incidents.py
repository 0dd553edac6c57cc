"""Incidents as the console shows them: the rows, the store behind the Incidents view, who runs a plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from gridwatch.console.fleet.state import StateStore
from gridwatch.playbooks.incident_times import Phase, incident_phase, time_to_detect, time_to_recover

# ------------------------------------------------------------------------ incidents


@dataclass(slots=True)
class AuditEntry:
    """One line of an incident's audit trail: who did what, why, and how it went."""

    at: float
    who: str
    what: str
    why: str = ""
    outcome: str = ""


@dataclass(slots=True)
class IncidentRow:
    """An incident as the Incidents view shows it."""

    id: str
    severity: str
    node: str
    title: str
    state: str  # open | acknowledged | silenced | resolved
    detected_at: float
    playbook: str | None = None
    plan: list[str] = field(default_factory=list)
    acted_at: float | None = None
    recovered_at: float | None = None
    silenced_until: float | None = None
    audit: list[AuditEntry] = field(default_factory=list)
    fault_at: float | None = None  # when the fault happened, as near as the console can tell
    fault_step: int | None = None  # the job's training step then
    blamed: list[str] = field(default_factory=list)  # the nodes the ranks' collective records name as the cause
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


class IncidentBackend(Protocol):
    """What the Incidents view needs from the incident store (SQLite in production)."""

    def incidents(self, limit: int = 200) -> list[IncidentRow]: ...

    def open_count(self) -> int:
        """How many incidents need the operator: open (or a silence that ran out), neither recovered nor resolved."""
        ...

    def detail(self, incident_id: str) -> IncidentRow | None:
        """One incident with its plan and audit trail filled in (the list leaves them empty)."""
        ...

    def acknowledge(self, incident_id: str, who: str, why: str) -> None: ...

    def silence(self, incident_id: str, until: float, who: str, why: str) -> None: ...


class IncidentActor(Protocol):
    """Runs an incident's plan (the playbook executor)."""

    async def act(self, incident_id: str, who: str, why: str) -> str: ...


class StoreIncidents:
    """The Incidents view's interface over the playbooks' SQLite store (``gridwatch.playbooks.store.IncidentStore``)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    @staticmethod
    def row(rec: Any) -> IncidentRow:
        """An ``IncidentRecord`` of the store as the view shows it."""
        return IncidentRow(id=rec.id, severity=rec.severity, node=rec.node, title=rec.summary, state=rec.state,
                           detected_at=rec.detected_at, playbook=rec.playbook, acted_at=rec.acted_at,
                           recovered_at=rec.recovered_at, silenced_until=rec.silenced_until, fault_at=rec.fault_at,
                           fault_step=rec.fault_step, blamed=list(rec.blamed), blame_why=rec.blame_why)

    def incidents(self, limit: int = 200) -> list[IncidentRow]:
        rows = [self.row(rec) for rec in self.store.incidents(limit=limit)]
        # Open first, then newest: what needs the operator is on top.
        order = {"open": 0, "acknowledged": 1, "silenced": 2, "resolved": 3}
        return sorted(rows, key=lambda r: (order.get(r.state, 0), -r.detected_at))

    def open_count(self) -> int:
        return int(self.store.open_count())

    def detail(self, incident_id: str) -> IncidentRow | None:
        rec = self.store.incident(incident_id)
        if rec is None:
            return None
        row = self.row(rec)
        row.plan = [f"{s.step} {s.target}: {s.state}" + (f" ({s.outcome})" if s.outcome else "")
                    for s in self.store.steps(incident_id)]
        row.audit = [AuditEntry(a.ts, a.who, a.what, a.why, a.outcome) for a in self.store.audit_log(incident_id)]
        return row

    def acknowledge(self, incident_id: str, who: str, why: str) -> None:
        self.store.acknowledge(incident_id, who, why)

    def silence(self, incident_id: str, until: float, who: str, why: str) -> None:
        self.store.silence(incident_id, who, until, why)


class ExecutorActor:
    """Acting on an incident = confirming the step of its plan that waits for an operator."""

    def __init__(self, executor: Any, store: Any) -> None:
        self.executor = executor
        self.store = store

    async def act(self, incident_id: str, who: str, why: str) -> str:
        waiting = [s for s in self.store.steps(incident_id) if s.state == "awaiting_confirmation"]
        if not waiting:
            return "nothing in its plan is waiting for confirmation"
        records = await self.executor.confirm(waiting[0].id, who)
        done = sum(1 for r in records if r.state == "done")
        return f"confirmed {waiting[0].step}; {done} of {len(records)} steps done"


class StoreProbe:
    """Answers the executor's ``wait_for`` conditions from the console's state store."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._checkpoint_base: dict[str, int] = {}

    def holds(self, condition: str, node: str) -> bool:
        state = self.store.by_name(node)
        if condition == "heartbeat":
            return state is not None and str(self.store.status(state)) == "ok"
        if condition == "isolated":
            return state is not None and state.isolated
        trainer = state.trainer if state is not None else None
        if trainer is None:
            summary = self.store.training()  # "job" or a node without a trainer: the run as a whole
            trainer = summary.status if summary else None
        if trainer is None:
            return False
        if condition == "training":
            return str(trainer.phase) == "training"
        if condition == "checkpoint":
            # A checkpoint newer than the one there was when the wait began.
            newest = max(trainer.checkpoints.values(), default=-1)
            base = self._checkpoint_base.setdefault(node, newest)
            return newest > base
        return False
