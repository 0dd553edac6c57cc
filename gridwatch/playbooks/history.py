"""What each node and GPU went through (incidents, remediations, returns to service) and the rules that read it.

A GPU is known by its UUID (NVML ``nvmlDeviceGetUUID``, ``nvidia-smi -L``) when its
node's agent named it in its hello, so a GPU moved to another node brings its
history along; by its serial when only that is known; else by node and index.

The rules (``guards.history`` in a playbook, see docs/playbooks.md) run on the
engine's clock over this history, so replay decides as the console did:

- ``same_gpu``: the same GPU failing ``times`` times within ``window`` is the
  hardware: the plan becomes ``then`` (the hardware inspection plan: keep the
  scene, isolate, drain, resume the job without it, notify) and the node stays
  out until an operator forces it back.
- ``same_xid``: the same XID on ``times`` different GPUs of one node within
  ``window`` is software or the application: no step takes the node out, and
  people are told.
- ``remediations``: the ``times``-th remediation of one node within ``window``
  (7 days by default) holds the node: return to service is refused, in one
  line, unless the operator forces it (audited).

With ``shadow: true`` a rule records what it would have decided (on the
incident, in the audit log and here) and changes nothing.

The lemon score of a node: each incident on it within the last 30 days weighs
its severity (info 0.25, warning 1, error 2, critical 4) halved for every 7 days
of age; the node's sum, divided by the median sum of the nodes that had an
incident in those 30 days (at least 1, one fresh warning). 1 is a typical
troubled node; :data:`LEMON_AT` and above is a lemon.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from enum import StrEnum
from typing import Protocol

import msgspec

from gridwatch.playbooks.durations import format_duration
from gridwatch.playbooks.model import ACTING_STEPS, REMOVING_STEPS, HistoryRule, HistoryRuleName, Playbook, Step
from gridwatch.playbooks.plans import Incident, PlannedStep

LEMON_WINDOW = 30 * 86400.0
LEMON_HALF_LIFE = 7 * 86400.0
LEMON_FLOOR = 1.0  # the median is at least one fresh warning: a quiet fleet does not make every incident a lemon
LEMON_AT = 3.0
SEVERITY_WEIGHTS: dict[str, float] = {"info": 0.25, "warning": 1.0, "error": 2.0, "critical": 4.0}
RETURN_WHAT = "return_to_service"  # the audit's ``what`` of a return to service starts with this


class HistoryKind(StrEnum):
    """What one history row records."""

    INCIDENT = "incident"
    REMEDIATION = "remediation"  # a step that changed something, let act by the guards, with its outcome
    RETURN = "return"  # the node put back in service
    DECISION = "decision"  # a history rule's verdict (or, in shadow mode, what it would have been)


class Verdict(StrEnum):
    """What a history rule concluded."""

    HARDWARE = "hardware"  # keep it out, ask for inspection
    SOFTWARE = "software"  # do not isolate, notify
    HOLD = "hold"  # no return to service unless an operator forces it


# Verdicts that keep a node out until an operator forces it back.
KEEPING_OUT: frozenset[str] = frozenset({Verdict.HARDWARE, Verdict.HOLD})


class GpuIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """Who a GPU is, wherever it sits: its UUID, or its serial; empty when its agent did not say."""

    uuid: str = ""
    serial: str = ""


class HistoryEntry(msgspec.Struct, kw_only=True):
    """One row of a node's history."""

    kind: HistoryKind
    at: float
    node: str
    gpu: int | None = None
    gpu_uuid: str = ""
    gpu_serial: str = ""
    incident: str = ""
    playbook: str = ""
    what: str = ""  # incident: its kind (xid, heartbeat_lost); remediation: the step; decision: the rule
    code: int | None = None  # the XID code of an XID incident
    severity: str = ""
    outcome: str = ""  # remediation: the step's state (planned, done, failed ...); return: what the scheduler said
    verdict: str = ""  # decision: a Verdict
    shadow: bool = False  # decision: recorded only, nothing changed
    reason: str = ""  # decision: why; remediation: the step's outcome text; return: the operator's reason
    who: str = ""
    step: str = ""  # remediation: the step's id
    ttr: float | None = None  # incident, as read from the store: time to recover, once known


class IncidentLine(msgspec.Struct, kw_only=True):
    """One incident as a node's history lists it."""

    id: str
    at: float
    node: str
    kind: str
    playbook: str
    severity: str
    gpu: int | None
    gpu_uuid: str
    code: int | None
    outcome: str  # what its remediations did, and any verdict
    ttr: float | None


class TrackRecord(msgspec.Struct, kw_only=True):
    """A node's (or one GPU's) history, newest incident first, with its figures."""

    node: str
    gpu: int | None = None
    gpu_uuid: str = ""
    incidents: list[IncidentLine] = []
    total_incidents: int = 0
    remediations: int = 0
    returns: int = 0
    mtbi_s: float | None = None  # mean time between incidents; None with fewer than two
    lemon: float = 0.0
    lemon_raw: float = 0.0
    fleet_median: float = 0.0
    kept_out: str | None = None  # why a return to service is refused now, or None
    decisions: list[HistoryEntry] = []


class GpuInfoLike(Protocol):
    index: int
    uuid: str
    serial: str | None


def same_gpu(entry: HistoryEntry, node: str, gpu: int, ident: GpuIdentity) -> bool:
    """Whether ``entry`` is about that GPU: by UUID, else serial, where both sides know it; else node and index."""
    if ident.uuid and entry.gpu_uuid:
        return entry.gpu_uuid == ident.uuid
    if ident.serial and entry.gpu_serial:
        return entry.gpu_serial == ident.serial
    return entry.node == node and entry.gpu == gpu


def mean_time_between(times: Iterable[float]) -> float | None:
    """The mean gap between consecutive incidents; None with fewer than two."""
    ordered = sorted(times)
    return (ordered[-1] - ordered[0]) / (len(ordered) - 1) if len(ordered) >= 2 else None


def lemon_raw(entries: Iterable[HistoryEntry], now: float) -> float:
    """A node's weighted, recency-decayed incident count over :data:`LEMON_WINDOW` (see the module's docstring)."""
    total = 0.0
    for e in entries:
        age = now - e.at
        if e.kind == HistoryKind.INCIDENT and 0.0 <= age <= LEMON_WINDOW:
            total += SEVERITY_WEIGHTS.get(e.severity, 1.0) * 0.5 ** (age / LEMON_HALF_LIFE)
    return total


def fleet_median(raws: Iterable[float]) -> float:
    """The median raw score of the nodes that had an incident, at least :data:`LEMON_FLOOR`."""
    troubled = [r for r in raws if r > 0]
    return max(statistics.median(troubled), LEMON_FLOOR) if troubled else LEMON_FLOOR


def return_refusal(entries: Iterable[HistoryEntry], node: str) -> str | None:
    """Why ``node`` may not go back into service by itself now (a rule kept it out since its last return); else None."""
    rows = [e for e in entries if e.node == node]
    last_return = max((e.at for e in rows if e.kind == HistoryKind.RETURN), default=float("-inf"))
    held = [e for e in rows if e.kind == HistoryKind.DECISION and not e.shadow and e.verdict in KEEPING_OUT
            and e.at > last_return]
    if not held:
        return None
    return f"{node} stays out of service: {held[-1].reason}; force the return once it has been looked at"


def summarize(node: str, entries: list[HistoryEntry], now: float, fleet: Iterable[float], limit: int = 20,
              gpu: int | None = None, gpu_uuid: str = "") -> TrackRecord:
    """The history of ``node`` (or of one GPU) from its rows, oldest first; ``fleet``: every node's raw lemon score."""
    incidents = [e for e in entries if e.kind == HistoryKind.INCIDENT]
    by_incident: dict[str, list[HistoryEntry]] = {}
    for e in entries:
        if e.kind in (HistoryKind.REMEDIATION, HistoryKind.DECISION) and e.incident:
            by_incident.setdefault(e.incident, []).append(e)
    lines = [IncidentLine(id=e.incident, at=e.at, node=e.node, kind=e.what, playbook=e.playbook, severity=e.severity,
                          gpu=e.gpu, gpu_uuid=e.gpu_uuid, code=e.code, outcome=_outcome(by_incident.get(e.incident, [])),
                          ttr=e.ttr)
             for e in incidents]
    lines.sort(key=lambda line: line.at, reverse=True)
    raw = lemon_raw(incidents, now)
    median = fleet_median(fleet)
    return TrackRecord(
        node=node, gpu=gpu, gpu_uuid=gpu_uuid, incidents=lines[:limit], total_incidents=len(lines),
        remediations=len({e.incident for e in entries if e.kind == HistoryKind.REMEDIATION}),
        returns=sum(1 for e in entries if e.kind == HistoryKind.RETURN),
        mtbi_s=mean_time_between(e.at for e in incidents), lemon=raw / median, lemon_raw=raw, fleet_median=median,
        kept_out=return_refusal(entries, node) if gpu is None else None,
        decisions=[e for e in entries if e.kind == HistoryKind.DECISION],
    )


def _outcome(rows: list[HistoryEntry]) -> str:
    parts = [f"{e.what} {e.outcome}" for e in rows if e.kind == HistoryKind.REMEDIATION]
    for e in rows:
        if e.kind == HistoryKind.DECISION:
            parts.append(f"{'would judge ' if e.shadow else ''}{e.verdict} ({e.what}{', shadow' if e.shadow else ''})")
    return "; ".join(parts) or "no action"


class FleetHistory:
    """The engine's memory of every node's history: what the rules read, on the engine's clock.

    The console seeds it from the incident store at start (gridwatch.playbooks.seed);
    what the engine adds here for an incident is handed to the store with
    :meth:`take` when its plan is recorded.
    """

    def __init__(self, keep: float = LEMON_WINDOW) -> None:
        self.keep = keep  # rows older than this are forgotten (no rule looks further back)
        self.entries: list[HistoryEntry] = []
        self.gpus: dict[tuple[str, int], GpuIdentity] = {}
        self._unsaved: dict[str, list[HistoryEntry]] = {}  # incident id -> rows the store has not got yet

    def saw_gpus(self, node: str, gpus: Iterable[GpuInfoLike]) -> None:
        """The GPUs a node's hello lists: their UUIDs and serials name them in the history."""
        for info in gpus:
            self.gpus[(node, int(info.index))] = GpuIdentity(uuid=str(info.uuid or ""), serial=str(info.serial or ""))

    def identity(self, node: str, gpu: int | None) -> GpuIdentity:
        return self.gpus.get((node, gpu), GpuIdentity()) if gpu is not None else GpuIdentity()

    def load(self, entries: Iterable[HistoryEntry]) -> None:
        """Rows from the store (oldest first), after a restart."""
        self.entries.extend(entries)
        self.entries.sort(key=lambda e: e.at)

    def add(self, entry: HistoryEntry) -> None:
        self.entries.append(entry)
        if self.entries and entry.at - self.entries[0].at > 2 * self.keep:
            self.entries = [e for e in self.entries if entry.at - e.at <= self.keep]

    def take(self, incident_id: str) -> list[HistoryEntry]:
        """The rows made for ``incident_id`` not yet in the store (once: the caller stores them)."""
        return self._unsaved.pop(incident_id, [])

    def _incidents(self, since: float) -> list[HistoryEntry]:
        return [e for e in self.entries if e.kind == HistoryKind.INCIDENT and e.at >= since]

    def before_plan(self, pb: Playbook, incident: Incident, code: int | None, spec: tuple[Step, ...],
                    now: float) -> tuple[tuple[Step, ...], list[HistoryEntry]]:
        """The ``same_xid`` and ``same_gpu`` rules: the plan to make (changed unless in shadow) and their decisions."""
        rules = {r.name: r for r in pb.guards.history}
        decisions: list[HistoryEntry] = []
        ident = self.identity(incident.node, incident.gpu)
        software = False
        xid = rules.get(HistoryRuleName.SAME_XID)
        if xid is not None and code is not None:
            gpus = {e.gpu for e in self._incidents(now - xid.window)
                    if e.node == incident.node and e.code == code and e.gpu is not None}
            if incident.gpu is not None:
                gpus.add(incident.gpu)
            if len(gpus) >= xid.times:
                listed = ", ".join(str(g) for g in sorted(g for g in gpus if g is not None))
                reason = (f"XID {code} on {len(gpus)} GPUs of {incident.node} ({listed}) within "
                          f"{format_duration(xid.window)}: software or the application, not the node; "
                          f"not isolated, people told")
                decisions.append(self._decision(xid, Verdict.SOFTWARE, incident, ident, reason, now))
                if not xid.shadow:
                    software = True
                    spec = tuple(s for s in spec if s.action not in REMOVING_STEPS)
                    if not any(s.action == "notify" for s in spec):
                        spec += (Step("notify", message=f"{incident.summary}; {reason}"),)
        gpu_rule = rules.get(HistoryRuleName.SAME_GPU)
        if gpu_rule is not None and incident.gpu is not None and not software:
            earlier = [e for e in self._incidents(now - gpu_rule.window)
                       if e.gpu is not None and same_gpu(e, incident.node, incident.gpu, ident)]
            if len(earlier) + 1 >= gpu_rule.times:
                where = f"{incident.node} gpu {incident.gpu}" + (f" ({ident.uuid})" if ident.uuid else "")
                elsewhere = sorted({e.node for e in earlier if e.node != incident.node})
                moved = f", earlier on {', '.join(elsewhere)}" if elsewhere else ""
                reason = (f"{where} failed {len(earlier) + 1} times within {format_duration(gpu_rule.window)}{moved}: "
                          f"the hardware; kept out, inspection asked")
                decisions.append(self._decision(gpu_rule, Verdict.HARDWARE, incident, ident, reason, now))
                if not gpu_rule.shadow:
                    spec = gpu_rule.then
        return spec, decisions

    def after_guards(self, pb: Playbook, incident: Incident, code: int | None, steps: list[PlannedStep],
                     decisions: list[HistoryEntry], now: float) -> None:
        """Record the incident and its remediations, and decide the ``remediations`` rule; notes say what was decided."""
        ident = self.identity(incident.node, incident.gpu)
        made = [HistoryEntry(kind=HistoryKind.INCIDENT, at=incident.opened_at, node=incident.node, gpu=incident.gpu,
                             gpu_uuid=ident.uuid, gpu_serial=ident.serial, incident=incident.id, playbook=pb.name,
                             what=incident.kind, code=code, severity=incident.severity)]
        acting = [s for s in steps if s.decision == "act" and s.step in ACTING_STEPS]
        made += [HistoryEntry(kind=HistoryKind.REMEDIATION, at=now, node=incident.node, gpu=incident.gpu,
                              gpu_uuid=ident.uuid, gpu_serial=ident.serial, incident=incident.id, playbook=pb.name,
                              what=s.step, outcome="planned", step=s.id) for s in acting]
        for entry in made:
            self.add(entry)
        rule = next((r for r in pb.guards.history if r.name == HistoryRuleName.REMEDIATIONS), None)
        if rule is not None and acting:
            count = len({e.incident for e in self.entries if e.kind == HistoryKind.REMEDIATION
                         and e.node == incident.node and now - e.at <= rule.window})
            if count >= rule.times:
                reason = (f"remediated {count} times within {format_duration(rule.window)}: not returned to "
                          f"service by itself")
                decisions.append(self._decision(rule, Verdict.HOLD, incident, ident, reason, now))
        for d in decisions:
            self.add(d)
        self._unsaved[incident.id] = made + decisions

    @staticmethod
    def _decision(rule: HistoryRule, verdict: Verdict, incident: Incident, ident: GpuIdentity, reason: str,
                  now: float) -> HistoryEntry:
        """A rule's verdict, noted on the incident (and, unless in shadow, in its summary: the page says why)."""
        if rule.shadow:
            incident.notes.append(f"{now:.3f} shadow {rule.name}: would have judged {verdict}: {reason}")
        else:
            incident.notes.append(f"{now:.3f} history {rule.name}: {verdict}: {reason}")
            incident.summary += f"; {verdict}: {reason}"
        return HistoryEntry(kind=HistoryKind.DECISION, at=now, node=incident.node, gpu=incident.gpu,
                            gpu_uuid=ident.uuid, gpu_serial=ident.serial, incident=incident.id,
                            playbook=incident.playbook, what=str(rule.name), verdict=str(verdict),
                            shadow=rule.shadow, reason=reason)
