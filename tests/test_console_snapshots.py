"""The main screens pinned as SVG snapshots, drawn from fixed data and a frozen clock."""

from __future__ import annotations

import time

import pytest

from gridwatch.console.fleet.node import CheckVerdict, PreflightResult
from gridwatch.console.tui.app import GridwatchApp
from gridwatch.wire.protocol import Event, LogLine, Text
from tests.support_app import make_app, shown, wait_for
from tests.support_frames import T0, make_sample, make_trainer, patrol_failed

SIZE = (160, 50)


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> None:
    # Clock times on screen are local time: pin the zone so the snapshots match anywhere.
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()


def fleet_app() -> GridwatchApp:
    app = make_app([f"node{i:03d}" for i in range(1, 41)])
    store = app.runtime.store
    store.set_link("node007", "down", error="node007:8022: connection refused (is the agent running?)")
    store.apply(make_sample("node011", 9, isolated=True))
    store.apply(make_sample("node013", 9, state="lost"))
    store.apply(Event(node=Text("node021"), kind=Text("xid"), severity=Text("critical"), gpu=4, code=79,
                      message=Text("GPU has fallen off the bus"), ts=T0))
    store.apply(make_sample("node021", 9, temp=88.0))
    store.apply(patrol_failed("node021", gpus="GPU 4: fell off the bus (XID 79)"))
    store.set_preflight("node030", PreflightResult(T0, False, [CheckVerdict("gpus", True, "8 GPUs healthy"),
                                                               CheckVerdict("stack", False, "differs: torch 2.12.0 (baseline 2.13.0)")]))
    store.apply(LogLine(node=Text("node021"), source=Text("/var/log/trainer.log"), line=Text("step 1200 loss 2.31"),
                        line_ts=T0))
    for step in range(1, 80):
        store.apply(make_sample("node001", 3, trainer=make_trainer(step, ranks=8, straggler=5)))
    store.clock.advance(5)  # everything not fed since is stale
    for i in range(1, 41):
        if i not in (7, 9):
            store.apply(make_sample(f"node{i:03d}", 4, trainer=make_trainer(79, 8, 5) if i == 1 else None,
                                    isolated=i == 11, state="lost" if i == 13 else "ok",
                                    temp=88.0 if i == 21 else 60.0))
    return app


async def _view(pilot, name: str, screen_type: type) -> None:  # noqa: ANN001
    pilot.app.show_view(name)
    await wait_for(pilot, lambda: shown(pilot.app, screen_type))


def test_fleet_view(snap_compare) -> None:
    from gridwatch.console.tui.screens import FleetScreen

    async def ready(pilot) -> None:  # noqa: ANN001
        await wait_for(pilot, lambda: shown(pilot.app, FleetScreen))

    assert snap_compare(fleet_app(), terminal_size=SIZE, run_before=ready)


def test_fleet_view_sorted_by_status_with_temperature_colours(snap_compare) -> None:
    from gridwatch.console.tui.screens import FleetScreen

    async def ready(pilot) -> None:  # noqa: ANN001
        await wait_for(pilot, lambda: shown(pilot.app, FleetScreen))
        await pilot.press("s", "m", "m")

    assert snap_compare(fleet_app(), terminal_size=SIZE, run_before=ready)


def test_node_view(snap_compare) -> None:
    from gridwatch.console.tui.screens import NodeScreen

    async def ready(pilot) -> None:  # noqa: ANN001
        pilot.app.open_node("node021")
        await wait_for(pilot, lambda: shown(pilot.app, NodeScreen))

    assert snap_compare(fleet_app(), terminal_size=SIZE, run_before=ready)


def test_logs_view(snap_compare) -> None:
    from gridwatch.console.tui.screens import LogsScreen

    async def ready(pilot) -> None:  # noqa: ANN001
        await _view(pilot, "logs", LogsScreen)

    assert snap_compare(fleet_app(), terminal_size=SIZE, run_before=ready)


def test_training_view(snap_compare) -> None:
    from gridwatch.console.tui.screens import TrainingScreen

    async def ready(pilot) -> None:  # noqa: ANN001
        await _view(pilot, "training", TrainingScreen)

    assert snap_compare(fleet_app(), terminal_size=SIZE, run_before=ready)


def test_incidents_view(snap_compare) -> None:
    from gridwatch.console.runtime.incidents import IncidentRow
    from gridwatch.console.tui.screens import IncidentsScreen

    app = fleet_app()
    incidents = app.runtime.incidents
    incidents.rows["inc-1"].fault_at = T0 - 30.4  # detected 0.4 s after its fault, not recovered yet
    # One the job trained past: its time to detect and to recover in the table, their means in the title.
    incidents.add(IncidentRow(id="inc-0", severity="error", node="node05", title="XID 48: double-bit ECC error",
                              state="resolved", detected_at=T0 - 599.2, playbook="xid-hardware", fault_at=T0 - 600,
                              fault_step=1180, acted_at=T0 - 599, recovered_at=T0 - 593.5))

    async def ready(pilot) -> None:  # noqa: ANN001
        await _view(pilot, "incidents", IncidentsScreen)

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_keys_help(snap_compare) -> None:
    from gridwatch.console.tui.screens import FleetScreen, KeysScreen

    async def ready(pilot) -> None:  # noqa: ANN001
        await wait_for(pilot, lambda: shown(pilot.app, FleetScreen))
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, KeysScreen))

    assert snap_compare(fleet_app(), terminal_size=SIZE, run_before=ready)
