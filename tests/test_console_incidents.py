"""The Incidents view over the real SQLite incident store and playbook engine: made, shown, kept, acknowledged."""

from __future__ import annotations

from dataclasses import dataclass

from gridwatch.console.fleet.state import ManualClock, StateStore
from gridwatch.console.runtime.core import ConsoleRuntime
from gridwatch.console.runtime.incidents import StoreIncidents
from gridwatch.console.tui.app import GridwatchApp
from gridwatch.console.tui.screens import ConfirmScreen, IncidentsScreen
from gridwatch.console.tui.widgets import TextTable
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.loader import load_builtin
from gridwatch.playbooks.store import IncidentStore
from gridwatch.sshlink.hostlist import Endpoint
from gridwatch.wire.protocol import Event, Text
from tests.support_app import screen_text, shown, wait_for
from tests.support_frames import T0, make_hello, make_sample


@dataclass
class Link:
    """What the fleet passes to ``on_frame``: the endpoint a frame came from."""

    endpoint: Endpoint


def runtime_with_engine(db: str, clock: ManualClock, read_only: bool) -> ConsoleRuntime:
    store = StateStore(clock)
    incidents = IncidentStore(db, clock)
    return ConsoleRuntime(store, incidents=StoreIncidents(incidents), engine=Engine(load_builtin(), clock),
                          plan_store=incidents, read_only=read_only, operator="alice")


async def test_an_xid_becomes_an_incident_that_survives_a_restart_and_is_acknowledged_with_audit(tmp_path) -> None:
    db = str(tmp_path / "incidents.db")
    clock = ManualClock(T0)
    runtime = runtime_with_engine(db, clock, read_only=True)
    link = Link(Endpoint("127.0.0.1", 9001))
    runtime.on_frame(link, make_hello("node-7"))
    runtime.on_frame(link, make_sample("node-7", 1))
    runtime.on_frame(link, Event(node=Text("node-7"), kind=Text("xid"), severity=Text("critical"), gpu=2, code=79,
                                 message=Text("GPU has fallen off the bus"), ts=T0))
    for _ in range(30):  # the engine plans after its settle window; time moves only when told
        clock.advance(1.0)
        runtime.tick_engine()
    (row,) = runtime.incidents.incidents()
    assert row.node == "node-7" and row.playbook == "xid-hardware" and row.state == "open"

    # A new console on the same database: the incident is still there, with its plan.
    clock2 = ManualClock(T0 + 60)
    app = GridwatchApp(runtime_with_engine(db, clock2, read_only=False), tick_seconds=3600, start_runtime=False)
    app.runtime.store.set_link("node-7", "connected", role="operator")
    async with app.run_test(size=(160, 50)) as pilot:
        app.show_view("incidents")
        await wait_for(pilot, lambda: shown(app, IncidentsScreen))
        table = app.screen.query_one("#incident-table", TextTable)
        assert table.keys == [row.id] and table.cells(0)[1][0] == "open"
        assert "isolate_node" in screen_text(app)  # the plan recorded for it
        await pilot.press("a")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press(*"replacing the GPU", "enter")
        await wait_for(pilot, lambda: shown(app, IncidentsScreen) and table.cells(0)[1][0] == "acknowledged")
        detail = app.runtime.incidents.detail(row.id)
        assert detail is not None and any(a.who == "alice" and a.what == "acknowledge" for a in detail.audit)
        assert any(a.why == "replacing the GPU" for a in detail.audit)
        await wait_for(pilot, lambda: "alice" in screen_text(app))  # the audit trail on screen


def test_the_executor_probe_reads_heartbeat_isolation_and_checkpoints_from_the_store() -> None:
    from gridwatch.console.runtime.incidents import StoreProbe
    from tests.support_frames import make_trainer

    clock = ManualClock(T0)
    store = StateStore(clock)
    store.apply(make_hello("n1"))
    store.apply(make_sample("n1", 1, trainer=make_trainer(10)))
    probe = StoreProbe(store)
    assert probe.holds("heartbeat", "n1") and probe.holds("training", "n1")
    assert not probe.holds("isolated", "n1") and not probe.holds("checkpoint", "n1")
    store.apply(make_sample("n1", 2, trainer=make_trainer(20), isolated=True))
    assert probe.holds("isolated", "n1") and probe.holds("checkpoint", "n1")
    clock.advance(10)
    assert not probe.holds("heartbeat", "n1")


def test_the_open_count_is_one_query_that_agrees_with_the_incidents_listed_one_by_one() -> None:
    from gridwatch.playbooks.plans import Incident

    clock = ManualClock(T0)
    store = IncidentStore(":memory:", clock)

    def incident(name: str, **extra: float) -> None:
        store.upsert_incident(Incident(id=name, playbook="", kind="xid", severity="critical", scope="node", node="n1",
                                       summary=name, opened_at=T0, last_seen_at=T0, **extra))

    for name in ("open", "acting", "recovered", "acknowledged", "silenced", "silence-ran-out", "resolved"):
        incident(name)
    store.mark_acted("acting", T0 + 1)
    store.mark_recovered("recovered", T0 + 2)
    store.acknowledge("acknowledged", "op", "seen")
    store.silence("silenced", "op", T0 + 600, "known")
    store.silence("silence-ran-out", "op", T0 + 5, "known")
    store.resolve("resolved", "op", "fixed")
    clock.set(T0 + 10)
    one_by_one = sum(1 for r in StoreIncidents(store).incidents() if r.state == "open" and r.phase in ("open", "acting"))
    assert store.open_count() == one_by_one == 3  # open, acting, and the silence that ran out
