"""The fleet view at thousands of nodes: zoomed-out heatmap grouped by rack, paging, and a hot GPU found in a far page."""

from __future__ import annotations

from gridwatch.console.fleet.metrics import Metric
from gridwatch.console.fleet.state import ManualClock, StateStore
from gridwatch.console.runtime.core import ConsoleRuntime
from gridwatch.console.runtime.incidents import StoreIncidents
from gridwatch.console.tui.app import GridwatchApp
from gridwatch.console.tui.widgets import GpuHeatmap, TextTable
from gridwatch.console.tui.widgets.heatmap import group_runs
from gridwatch.playbooks.store import IncidentStore
from gridwatch.wire import protocol as p

NODES = 3000
HOT = "rack090-node17"  # far down the fleet: page 1 never shows it


def _name(i: int) -> str:
    return f"rack{i // 32:03d}-node{i % 32:02d}"


def _fleet() -> StateStore:
    # Written by us: cool, busy GPUs everywhere, one at 97 C on GPU 5 of HOT.
    clock = ManualClock(1_700_000_000.0)
    store = StateStore(clock)
    infos = [p.GpuInfo(index=g, uuid=p.Text(f"GPU-{g}"), name=p.Text("NVIDIA H100 80GB HBM3")) for g in range(8)]
    for i in range(NODES):
        name = _name(i)
        store.set_link(name, "connected", role="viewer")
        store.apply(p.Hello(node=p.Text(name), role=p.Text("viewer"), interval=1.0, gpus=infos))
        gpus = [p.GpuBrief(index=g, util=60 + (i + g) % 30, temp_c=97 if (name, g) == (HOT, 5) else 55 + (i + g) % 10,
                           power_w=400, mem_used_mb=40_000, mem_total_mb=81_920) for g in range(8)]
        store.apply(p.Summary(node=p.Text(name), seq=2, ts=clock.now(), gpus=gpus, every=1.0))
    return store


def test_racks_make_the_lines_of_the_zoomed_out_heatmap():
    names = [_name(i) for i in range(70)] + [f"node{i:05d}" for i in range(1, 8)]
    runs = group_runs(names, per_line=20)
    # rack000 (32 nodes) in two lines of 20 and 12, rack001 likewise, rack002's 6, then the plain names in one block.
    assert runs == [(0, 20), (20, 32), (32, 52), (52, 64), (64, 70), (70, 77)]
    assert group_runs([f"n{i}.cluster.local" for i in range(5)], per_line=3) == [(0, 3), (3, 5)]


async def test_zoom_pages_and_the_worst_key_find_a_hot_gpu_in_a_far_page():
    store = _fleet()
    incidents = StoreIncidents(IncidentStore(":memory:", store.clock))
    app = GridwatchApp(ConsoleRuntime(store, incidents=incidents), tick_seconds=3600, start_runtime=False)
    async with app.run_test(size=(200, 60)) as pilot:
        await pilot.pause()
        screen = app.screen
        heatmap = screen.query_one(GpuHeatmap)
        table = screen.query_one(TextTable)
        page, pages = heatmap.page
        assert page == 1 and pages > 10  # a cell per GPU: many pages
        legend = str(screen.query_one("#heatmap-legend").render())
        assert f"page 1/{pages}" in legend
        # Zoomed out: a node a cell, a line per rack (32 nodes fit a line), far fewer pages.
        await pilot.press("z")
        assert heatmap.zoomed
        zoomed_pages = heatmap.page[1]
        assert zoomed_pages < pages
        assert heatmap.virtual_size.height == NODES // 32 + (1 if NODES % 32 else 0)
        line = heatmap.render_line(0).text
        assert "rack000-node[00-31]"[-10:] in line and line.count("█") == 32
        # Paging moves a screen at a time and says where it is.
        await pilot.press("right_square_bracket")
        assert heatmap.page[0] == 2
        assert f"page 2/{zoomed_pages}" in str(screen.query_one("#heatmap-legend").render())
        # The worst key, on temperature: the table and the heatmap go to the hot node, wherever it is.
        await pilot.press("m")
        assert screen.metric is Metric.TEMP
        await pilot.press("w")
        assert table.cursor_key == HOT
        assert heatmap.highlight == HOT
        hot_line = heatmap.line_of(HOT)
        assert hot_line is not None and int(heatmap.scroll_y) <= hot_line < int(heatmap.scroll_y) + heatmap.size.height
        # Its cell is drawn hottest (the ramp's top), and a click on it names that node.
        y = hot_line - int(heatmap.scroll_y)
        start = heatmap._runs[hot_line][0]
        x = 19 + store.heatmap(Metric.TEMP).names.index(HOT) - start
        assert heatmap.node_at(x, y) == HOT
        # Zooming back in keeps the hot node on screen, with its GPU 5 the hot cell.
        await pilot.press("z")
        assert not heatmap.zoomed
        gpu_line = heatmap.line_of(HOT)
        assert gpu_line is not None and int(heatmap.scroll_y) <= gpu_line < int(heatmap.scroll_y) + heatmap.size.height
        node = next(n for n in store.heatmap(Metric.TEMP) if n.name == HOT)
        assert max(range(8), key=lambda g: node.values[g] or 0.0) == 5
