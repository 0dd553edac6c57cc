"""The incident store's ``history`` table: each node's and GPU's history (gridwatch.playbooks.history), written and read.

Every incident, every step that changed something with its outcome, every
return to service and every history rule's verdict is kept, queried by node
and by GPU (by UUID where the agent named it, so a GPU moved to another node
keeps its history).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from gridwatch.playbooks.clock import Clock
from gridwatch.playbooks.history import (
    LEMON_WINDOW,
    HistoryEntry,
    HistoryKind,
    TrackRecord,
    lemon_raw,
    return_refusal,
    summarize,
)
from gridwatch.playbooks.incident_times import time_to_recover
from gridwatch.playbooks.store_db import ACTING_SQL, Op

_HISTORY_FIELDS = ("at", "kind", "node", "gpu", "gpu_uuid", "gpu_serial", "incident", "playbook", "what", "code",
                   "severity", "outcome", "verdict", "shadow", "reason", "who", "step")
_HISTORY_COLS = "h.id, " + ", ".join(f"h.{c}" if c != "incident" else "COALESCE(h.incident, '')"
                                     for c in _HISTORY_FIELDS)
# A step that changes something, made a remediation row of the history (once: the step is its ref).
REMEDIATION_FROM_STEP = (
    "INSERT OR IGNORE INTO history (at, kind, node, gpu, incident, playbook, what, outcome, reason, step, ref)"
    " SELECT COALESCE(s.started_at, ?), 'remediation', i.node, i.gpu, s.incident, i.playbook, s.step, s.state,"
    " s.outcome, s.id, 'step:' || s.id FROM steps s JOIN incidents i ON i.id = s.incident"
    f" WHERE s.id = ? AND s.decision = 'act' AND s.step IN ({ACTING_SQL})"
)


class HistoryTable:
    """The history reads and writes of :class:`~gridwatch.playbooks.store.IncidentStore`, which owns the connection."""

    clock: Clock

    if TYPE_CHECKING:  # what the store gives: its connection, its writes, its audit rows and its bad-row report
        @property
        def _read(self) -> sqlite3.Connection: ...

        def _write(self, ops: list[Op]) -> int: ...

        def _audit_op(self, who: str, what: str, why: str, incident: str | None, step: str | None, phase: str,
                      outcome: str) -> Op: ...

        def report_bad_row(self, table: str, rowid: Any, why: str) -> None: ...

    def record_history(self, entries: Iterable[HistoryEntry]) -> None:
        """What the engine knows of an incident beyond its plan (GPU UUID, XID code, rule verdicts); verdicts audited."""
        ops: list[Op] = []
        for e in entries:
            ops.append(history_op(e))
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


def _history_ref(e: HistoryEntry) -> str | None:
    """What makes a row one of a kind, so recording it twice changes nothing (a return to service: its audit id)."""
    if e.kind == HistoryKind.INCIDENT:
        return f"incident:{e.incident}"
    if e.kind == HistoryKind.REMEDIATION:
        return f"step:{e.step}"
    if e.kind == HistoryKind.DECISION:
        return f"decision:{e.incident}:{e.what}"
    return None


def history_op(e: HistoryEntry) -> Op:
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
