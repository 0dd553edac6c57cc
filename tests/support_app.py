"""The console app driven headless: an app over a filled fleet, waiting on a view, reading the screen, canned runtimes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

from gridwatch.console.fleet.state import ManualClock, StateStore
from gridwatch.console.runtime.core import ConsoleRuntime
from gridwatch.console.runtime.incidents import AuditEntry, IncidentRow, StoreIncidents
from gridwatch.console.tui.app import GridwatchApp
from gridwatch.playbooks.clock import Clock, SystemClock
from gridwatch.playbooks.plans import Incident
from gridwatch.playbooks.store import IncidentStore
from gridwatch.wire.protocol import ActionResult, LogLine, Text, TrainerStatus
from tests.support_frames import T0, fill_fleet, make_hello, make_sample

SIZE = (160, 50)
EVIL = "[bold red]EVIL[/][link=http://x]click[/link]"


class MemoryIncidents:
    """An in-memory incident store with the Incidents view's interface, whose rows a test edits by hand: the view
    tests' double, kept out of the package (a console without a database uses the real store on ``:memory:``)."""

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

    def open_count(self) -> int:
        return sum(1 for row in self.incidents() if row.state == "open" and row.phase in ("open", "acting"))

    def detail(self, incident_id: str) -> IncidentRow | None:
        return self.rows.get(incident_id)

    def acknowledge(self, incident_id: str, who: str, why: str) -> None:
        row = self.rows[incident_id]
        row.state = "acknowledged"
        row.audit.append(AuditEntry(self.clock.now(), who, "acknowledge", why, "ok"))

    def silence(self, incident_id: str, until: float, who: str, why: str) -> None:
        row = self.rows[incident_id]
        row.state = "silenced"
        row.silenced_until = until
        row.audit.append(AuditEntry(self.clock.now(), who, f"silence until {until:.0f}", why, "ok"))



class RecordingFleet:
    """An in-memory fleet: records actions and log subscriptions, answers searches from a list."""

    def __init__(self, lines: list[LogLine] | None = None) -> None:
        self.actions: list[tuple[str, str, str]] = []
        self.subscriptions: list[tuple[str, bool]] = []
        self.lines = lines or []
        self.release = asyncio.Event()

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def action(self, node, action, args=None, reason="", timeout=30.0) -> ActionResult:  # noqa: ANN001
        self.actions.append((node, action, reason))
        return ActionResult(id=Text("1"), action=Text(action), ok=True, node=Text(node))

    async def search(self, pattern, nodes=None, since=None, until=None, limit=500, on_progress=None):  # noqa: ANN001
        if on_progress:
            on_progress(1, 2)
        await self.release.wait()
        if on_progress:
            on_progress(2, 2)
        return self.lines

    def subscribe_logs(self, node: str, on: bool) -> None:
        self.subscriptions.append((node, on))


async def wait_for(pilot, condition: Callable[[], bool], timeout: float = 5.0) -> None:  # noqa: ANN001
    """Let the app run until ``condition`` holds; fail after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.01)


def shown(app: GridwatchApp, screen_type: type) -> bool:
    """The view is on top and has drawn itself from the store."""
    return isinstance(app.screen, screen_type) and app.screen.ready


def make_app(names: list[str] | None = None, *, read_only: bool = False, role: str = "operator",
             fleet: RecordingFleet | None = None) -> GridwatchApp:
    store = StateStore(ManualClock(T0))
    fill_fleet(store, names if names is not None else [f"node{i:02d}" for i in range(1, 9)])
    for node in list(store.nodes.values()):
        store.set_link(node.key, node.link, role=role)  # the role the agent gave, as the fleet records it
    incidents = MemoryIncidents(store.clock)
    incidents.add(IncidentRow(id="inc-1", severity="critical", node="node03", title="XID 79: GPU fell off the bus",
                              state="open", detected_at=T0 - 30, playbook="gpu-lost",
                              plan=["capture_scene", "isolate", "restart_from_checkpoint"]))
    runtime = ConsoleRuntime(store, fleet=fleet, incidents=incidents, read_only=read_only)
    return GridwatchApp(runtime, tick_seconds=3600, start_runtime=False)


def screen_text(app: GridwatchApp) -> str:
    """What the terminal shows, as plain text lines."""
    update = app.screen._compositor.render_full_update()
    return "\n".join("".join(strip.text for strip in line) for line in update.strips)


def terminal_bytes(app: GridwatchApp) -> str:
    """What would be written to the terminal, escape sequences and all."""
    return app.screen._compositor.render_full_update().render_segments(app.console)


def _status(phase: str, step: int) -> TrainerStatus:
    return TrainerStatus(job=Text(EVIL), phase=Text(phase), step=step, loss=2.0, world_size=1,
                         membership=[Text("node01")], checkpoints={"0": 0})


def trained_runtime() -> ConsoleRuntime:
    """60 s of one-a-second steps, a 10 s hang (5 s of it before the incident), 10 s restoring, 20 s of steps."""
    clock = ManualClock(T0)
    store = StateStore(clock)
    incidents = IncidentStore(":memory:", clock)
    runtime = ConsoleRuntime(store, incidents=StoreIncidents(incidents))
    link = SimpleNamespace(endpoint="node01")
    runtime.on_frame(link, make_hello("node01", gpus=2))
    seq = 0

    def at(t: float, phase: str, step: int) -> None:
        nonlocal seq
        seq += 1
        clock.set(T0 + t)
        runtime.on_frame(link, make_sample("node01", seq, gpus=2, trainer=_status(phase, step)))

    for k in range(61):
        at(k, "training", k)
    at(70, "restarting", 60)
    for j in range(21):
        at(80 + j, "training", 60 + j)
    incidents.upsert_incident(Incident(id="inc-1", playbook="", kind="hang", severity="critical", scope="node",
                                       node="node01", summary="hang", opened_at=T0 + 65, last_seen_at=T0 + 65,
                                       recovered_at=T0 + 81))
    incidents.mark_fault("inc-1", T0 + 60, None)
    return runtime
