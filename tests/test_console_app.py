"""The console driven headless: navigation, filtering, drill-down, confirmations, read-only mode, hostile text."""

from __future__ import annotations

import asyncio
from typing import Callable

import pytest

from agents.protocol import ActionResult, Event, LogLine, Text
from console.app import GridwatchApp
from console.runtime import ConsoleRuntime, IncidentRow, MemoryIncidents
from console.screens import (
    CommandLine,
    ConfirmScreen,
    FleetScreen,
    IncidentsScreen,
    KeysScreen,
    LogsScreen,
    NodeScreen,
    TrainingScreen,
)
from console.state import ManualClock, StateStore
from console.widgets import GpuHeatmap, TextTable
from tests.test_state import T0, fill_fleet, make_hello, make_sample, make_trainer

SIZE = (160, 50)
EVIL = "[bold red]EVIL[/][link=http://x]click[/link]"


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


def make_app(names: list[str] | None = None, *, read_only: bool = False, role: str = "operator",
             fleet: RecordingFleet | None = None) -> GridwatchApp:
    store = StateStore(ManualClock(T0))
    fill_fleet(store, names or [f"node{i:02d}" for i in range(1, 9)])
    for node in store.nodes.values():
        node.role = role
    incidents = MemoryIncidents(store.clock)
    incidents.add(IncidentRow(id="inc-1", severity="critical", node="node03", title="XID 79: GPU fell off the bus",
                              state="open", detected_at=T0 - 30, playbook="gpu-lost",
                              plan=["capture_scene", "isolate", "restart_from_checkpoint"]))
    runtime = ConsoleRuntime(store, fleet=fleet, incidents=incidents, read_only=read_only)
    return GridwatchApp(runtime, tick_seconds=3600, start_runtime=False)


def table_keys(app: GridwatchApp, selector: str) -> list[str]:
    return list(app.screen.query_one(selector, TextTable).keys)


async def test_home_shows_every_node_and_enter_opens_it_and_esc_goes_back() -> None:
    fleet = RecordingFleet()
    app = make_app(fleet=fleet)
    async with app.run_test(size=SIZE) as pilot:
        assert isinstance(app.screen, FleetScreen)
        assert table_keys(app, "#node-table")[:3] == ["node01", "node02", "node03"]
        await pilot.press("down", "down", "enter")
        await wait_for(pilot, lambda: isinstance(app.screen, NodeScreen))
        assert app.screen.node_name == "node03"
        assert table_keys(app, "#gpu-table") == [str(i) for i in range(8)]
        assert fleet.subscriptions == [("node03", True)]
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, FleetScreen))
        assert fleet.subscriptions[-1] == ("node03", False)


async def test_slash_filters_the_table_and_the_heatmap_and_escape_clears_it() -> None:
    app = make_app(["gpu-a1", "gpu-a2", "gpu-b1", "gpu-b2"])
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("slash", "b")
        await wait_for(pilot, lambda: table_keys(app, "#node-table") == ["gpu-b1", "gpu-b2"])
        assert [n.name for n in app.screen.query_one(GpuHeatmap).nodes] == ["gpu-b1", "gpu-b2"]
        await pilot.press("enter", "escape")
        await wait_for(pilot, lambda: len(table_keys(app, "#node-table")) == 4)


async def test_sort_key_cycles_and_reverse_flips() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        await pilot.press("s")
        assert screen.sort_key == "status"
        await pilot.press("s", "r")
        assert screen.sort_key == "util" and screen.reverse
        rows = app.runtime.store.node_rows("util", True)
        assert table_keys(app, "#node-table") == [r.name for r in rows]


async def test_colon_commands_switch_views_like_k9s() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        for command, screen_type in (("logs", LogsScreen), ("incidents", IncidentsScreen),
                                     ("training", TrainingScreen), ("nodes", FleetScreen)):
            await pilot.press("colon")
            await wait_for(pilot, lambda: isinstance(app.screen, CommandLine))
            await pilot.press(*command, "enter")
            await wait_for(pilot, lambda t=screen_type: isinstance(app.screen, t))
        assert len(app.screen_stack) == 1
        await pilot.press("colon", *"bogus", "enter")
        await wait_for(pilot, lambda: "unknown command" in app.note)


async def test_question_mark_lists_the_keys_of_the_view() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, KeysScreen))
        shown = dict(app.screen.rows)
        assert shown["/"] == "Filter" and shown["m"] == "Metric" and shown["s"] == "Sort"
        assert {":logs", ":incidents", ":training", ":nodes", "ctrl+p", "?"} <= set(shown)
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, FleetScreen))
