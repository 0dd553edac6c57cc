"""The console's runtime: the fleet feeding the state store, and the incidents it shows and acts on.

The Textual app and ``gridwatch console --headless`` both run one of these. The
fleet, the incident store and the playbook engine are optional so that the UI
can be driven by synthetic frames in tests.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from loguru import logger

from agents.protocol import ActionResult, Frame, LogLine, Text
from console.state import Clock, StateStore, SystemClock


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


class IncidentBackend(Protocol):
    """What the Incidents view needs from the incident store (SQLite in production)."""

    def incidents(self, limit: int = 200) -> list[IncidentRow]: ...

    def acknowledge(self, incident_id: str, who: str, why: str) -> None: ...

    def silence(self, incident_id: str, until: float, who: str, why: str) -> None: ...


class IncidentActor(Protocol):
    """Runs an incident's plan (the playbook executor)."""

    async def act(self, incident_id: str, who: str, why: str) -> str: ...


class MemoryIncidents:
    """An in-memory incident store with the same interface, for tests and a console without a database."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or SystemClock()
        self.rows: dict[str, IncidentRow] = {}

    def add(self, row: IncidentRow) -> None:
        self.rows[row.id] = row

    def incidents(self, limit: int = 200) -> list[IncidentRow]:
        now = self.clock.now()
        for row in self.rows.values():
            if row.state == "silenced" and row.silenced_until is not None and row.silenced_until <= now:
                row.state = "open"
        order = sorted(self.rows.values(), key=lambda r: (r.state == "resolved", -r.detected_at))
        return order[:limit]

    def acknowledge(self, incident_id: str, who: str, why: str) -> None:
        row = self.rows[incident_id]
        row.state = "acknowledged"
        row.audit.append(AuditEntry(self.clock.now(), who, "acknowledge", why, "ok"))

    def silence(self, incident_id: str, until: float, who: str, why: str) -> None:
        row = self.rows[incident_id]
        row.state = "silenced"
        row.silenced_until = until
        row.audit.append(AuditEntry(self.clock.now(), who, f"silence until {until:.0f}", why, "ok"))


# --------------------------------------------------------------------------- runtime


class FleetLike(Protocol):
    """The parts of ``console.fleet.Fleet`` the console uses."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def action(self, node: str, action: str, args: dict | None = None, reason: str = "",
                     timeout: float = 30.0) -> ActionResult: ...

    async def search(self, pattern: str, nodes: list[str] | None = None, since: float | None = None,
                     until: float | None = None, limit: int = 500,
                     on_progress: Callable[[int, int], None] | None = None) -> list[LogLine]: ...

    def subscribe_logs(self, node: str, on: bool) -> None: ...


class Engine(Protocol):
    """The playbook engine's intake: frames in (it makes incidents on its own)."""

    def feed(self, node: str, frame: Frame) -> None: ...


class ConsoleRuntime:
    """Fleet -> store (+ engine); the operator's actions out, each with who and why."""

    def __init__(
        self,
        store: StateStore | None = None,
        *,
        fleet: FleetLike | None = None,
        incidents: IncidentBackend | None = None,
        actor: IncidentActor | None = None,
        engine: Engine | None = None,
        read_only: bool = False,
        operator: str = "operator",
    ) -> None:
        self.store = store or StateStore()
        self.fleet = fleet
        self.incidents = incidents
        self.actor = actor
        self.engine = engine
        self.read_only_flag = read_only
        self.operator = operator

    # Callbacks the fleet calls; they must stay cheap (O(frame)): the UI reads on its own tick.
    def on_frame(self, link: Any, frame: Frame) -> None:
        key = str(link.endpoint)
        self.store.apply(frame, key)
        if self.engine is not None:
            try:
                self.engine.feed(self.store.nodes[key].name, frame)
            except Exception:  # noqa: BLE001 - one bad frame must not stop the stream
                logger.bind(node=key).exception("playbook engine failed on a frame")

    def on_status(self, link: Any) -> None:
        hello_name = str(link.hello.node) if getattr(link, "hello", None) is not None else None
        self.store.set_link(
            str(link.endpoint), str(link.state), name=hello_name or link.name, error=link.last_error, role=link.role
        )

    @property
    def read_only(self) -> bool:
        """Read-only when asked, or when no agent granted this console the operator role."""
        if self.read_only_flag:
            return True
        return not any(node.role == "operator" for node in self.store.nodes.values())

    async def start(self) -> None:
        if self.fleet is not None:
            await self.fleet.start()

    async def stop(self) -> None:
        if self.fleet is not None:
            await self.fleet.stop()

    def subscribe_logs(self, node: str, on: bool) -> None:
        state = self.store.by_name(node)
        if state is not None:
            state.logs_subscribed = on
        if self.fleet is not None:
            self.fleet.subscribe_logs(node, on)

    async def node_action(self, node: str, action: str, reason: str, args: dict | None = None) -> ActionResult:
        """Send an operator action to one node; refused here when read-only."""
        if self.read_only:
            return _refused(node, action, "this console is read-only")
        if self.fleet is None:
            return _refused(node, action, "no fleet connected")
        logger.bind(node=node).info("action {} by {}: {}", action, self.operator, reason)
        try:
            return await self.fleet.action(node, action, args or {}, reason=reason)
        except Exception as exc:  # noqa: BLE001 - the operator sees why, the screen keeps going
            return _refused(node, action, f"{type(exc).__name__}: {exc}")

    async def search(self, pattern: str, nodes: list[str] | None, since: float | None, until: float | None,
                     on_progress: Callable[[int, int], None] | None = None) -> list[LogLine]:
        if self.fleet is None:
            return []
        return await self.fleet.search(pattern, nodes, since, until, on_progress=on_progress)

    def acknowledge(self, incident_id: str, why: str) -> None:
        self._check_changes("acknowledge")
        assert self.incidents is not None
        self.incidents.acknowledge(incident_id, self.operator, why)

    def silence(self, incident_id: str, seconds: float, why: str) -> None:
        self._check_changes("silence")
        assert self.incidents is not None
        self.incidents.silence(incident_id, self.store.clock.now() + seconds, self.operator, why)

    async def act(self, incident_id: str, why: str) -> str:
        self._check_changes("act")
        if self.actor is None:
            return "no playbook executor is attached to this console"
        return await self.actor.act(incident_id, self.operator, why)

    def _check_changes(self, what: str) -> None:
        if self.read_only:
            raise PermissionError(f"cannot {what}: this console is read-only")
        if self.incidents is None and what != "act":
            raise PermissionError(f"cannot {what}: no incident store is attached")


def _refused(node: str, action: str, message: str) -> ActionResult:
    return ActionResult(id=Text(uuid.uuid4().hex[:8]), action=Text(action), ok=False, message=Text(message),
                        node=Text(node))


Runner = Callable[[], Awaitable[None]]
