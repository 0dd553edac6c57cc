"""The console shows each node's patrol and pre-flight: a mark in the fleet view, the reasons in the node view."""

from __future__ import annotations

from pathlib import Path

from gridwatch.console.fleet.state import StateStore
from gridwatch.console.runtime.core import ConsoleRuntime
from gridwatch.console.tui.app import GridwatchApp
from gridwatch.console.tui.screens import FleetScreen, KeysScreen, NodeScreen
from gridwatch.console.tui.widgets import GpuHeatmap, TextTable
from gridwatch.sshlink.client import Fleet, FleetOptions
from gridwatch.sshlink.hostlist import parse_endpoints
from tests.conftest import start_agent, stop_agent
from tests.support_app import SIZE, make_app, screen_text, shown, wait_for
from tests.support_frames import patrol_failed, patrol_recovered


def flags(app: GridwatchApp) -> dict[str, str]:
    return {r[0][0]: r[2][0] for r in app.screen.query_one("#node-table", TextTable).row_cells()}


async def test_a_failing_patrol_is_marked_in_the_fleet_and_explained_in_the_node_view() -> None:
    app = make_app(["node01", "node02", "node03"])
    store = app.runtime.store
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        store.apply(patrol_failed("node02", gpus="gpu 0: uncorrected ECC errors (1)", network="ib0 is down"))
        app.tick()
        await pilot.pause()
        assert flags(app) == {"node01": "", "node02": "patrol", "node03": ""}
        text = screen_text(app)
        assert "node02 P" in text  # the heatmap's mark beside the node's cells
        assert "P patrol/pre-flight failing" in text
        store.clock.advance(120)
        app.open_node("node02")
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        text = screen_text(app)
        assert "PATROL FAILING" in text
        assert "patrol     FAILING for 2m: gpus, network" in text
        assert "gpus     FAIL gpu 0: uncorrected ECC errors (1)" in text
        assert "network  FAIL ib0 is down" in text
        assert "preflight  not run this session" in text
        store.apply(patrol_recovered("node02"))
        store.clock.advance(30)
        app.tick()
        await pilot.pause()
        text = screen_text(app)
        assert "patrol     ok for 30s (recovered)" in text and "PATROL FAILING" not in text
        await pilot.press("escape")
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        assert flags(app)["node02"] == ""


async def test_every_heatmap_block_is_labelled_with_its_own_node() -> None:
    names = [f"gpu-a{i:02d}-n{j}.cluster.local" for i in range(30) for j in range(4)]
    app = make_app(names)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        heatmap = app.screen.query_one(GpuHeatmap)
        # Too many nodes for one a line: blocks of cells, each under its own name.
        label = heatmap.render_line(0).text
        cells = heatmap.render_line(1).text
        per_line = heatmap._per_line
        assert per_line > 1
        for slot, name in enumerate(names[:per_line]):
            short = name.removesuffix(".cluster.local")
            block = label[slot * 9 : slot * 9 + 9]
            assert block == " …" + short[-7:] and heatmap.node_at(slot * 9 + 3, 1) == name
        assert cells.count("█") == 8 * per_line
    few = make_app(["node01", "a-much-longer-node-name"])
    async with few.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(few, FleetScreen))
        heatmap = few.screen.query_one(GpuHeatmap)
        assert heatmap.render_line(1).text.startswith("a-much-longer-node-name  ████████")
        assert heatmap.render_line(0).text.startswith("node01                   ████████")


async def test_preflight_from_the_console_shows_the_failing_check_in_the_node_view(keys, tmp_path: Path) -> None:
    agents = [await start_agent(keys, name=f"node-{i}", interval=0.2, nics=["lo"], kernel_log=False) for i in (1, 2)]
    agents[1].agent.gpus.inject("ecc-dbe", gpu=0)
    store = StateStore()
    # A viewer may run it: pre-flight changes nothing on a node.
    runtime = ConsoleRuntime(store, read_only=True)
    endpoints = parse_endpoints(",".join(ra.spec for ra in agents))
    runtime.fleet = Fleet(endpoints, FleetOptions(key_path=str(keys.viewer_key), known_hosts=str(keys.known_hosts)),
                          runtime.on_frame, runtime.on_status)
    app = GridwatchApp(runtime, tick_seconds=0.2)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: shown(app, FleetScreen))
            await wait_for(pilot, lambda: runtime.fleet.connected == 2, timeout=20)
            await wait_for(pilot, lambda: (s := store.by_name("node-2")) is not None and s.sample is not None
                           and (s.sample.gpus[0].ecc_dbe or 0) > 0, timeout=20)
            await pilot.press("question_mark")
            await wait_for(pilot, lambda: isinstance(app.screen, KeysScreen))
            assert dict(app.screen.rows)["p"] == "Pre-flight now"
            await pilot.press("escape")
            await wait_for(pilot, lambda: shown(app, FleetScreen))
            notes: list[str] = []
            original = app.set_note
            app.set_note = lambda note: (notes.append(note), original(note))[1]  # type: ignore[method-assign]
            await pilot.press("colon", *"preflight", "enter")
            await wait_for(pilot, lambda: "pre-flight: 1 passed, 1 failed (node-2)" in app.note, timeout=60)
            assert "pre-flight: 2/2 nodes answered" in notes
            await wait_for(pilot, lambda: flags(app) == {"node-1": "", "node-2": "preflight"})
            app.open_node("node-2")
            await wait_for(pilot, lambda: shown(app, NodeScreen))
            text = screen_text(app)
            assert "PRE-FLIGHT FAILED" in text and "preflight  FAILED" in text and "1 of 5 checks failed" in text
            assert "preflight failed" not in text  # a verdict, not an error of the link
            assert "gpus     FAIL" in text and "uncorrected ECC" in text
            assert "stack    ok" in text
            await pilot.press("colon", *"preflight node-[7-8]", "enter")
            await wait_for(pilot, lambda: app.note == "pre-flight: no connected node matches node-7, node-8")
    finally:
        for ra in agents:
            await stop_agent(ra)
