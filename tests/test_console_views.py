"""What the console says matches what is so: the scheduler's jobs (a JOB column, a `:jobs` view), a node's health, what a
node read from Prometheus can do, a cell per GPU, and an incident's phase."""

from __future__ import annotations

import msgspec

from gridwatch.console.tui.screens import FleetScreen, JobsScreen, NodeScreen
from gridwatch.console.tui.widgets import TextTable
from gridwatch.wire.protocol import SchedulerJob
from tests.support_app import EVIL, SIZE, make_app, screen_text, shown, terminal_bytes, wait_for
from tests.support_frames import make_sample


def _with_job(app, node: str, job: SchedulerJob) -> None:  # noqa: ANN001
    sample = make_sample(node, 10)
    app.runtime.store.apply(msgspec.structs.replace(sample, jobs=[job]))


async def test_the_jobs_view_lists_each_job_once_with_the_nodes_it_runs_on_and_opens_one() -> None:
    app = make_app()
    pretrain = SchedulerJob(scheduler="slurm", id="4242", user="alice", name="pretrain-7b", nodes="node[01-03]",
                            pids=3)
    for node in ("node01", "node02", "node03"):
        _with_job(app, node, pretrain)
    _with_job(app, "node05", SchedulerJob(scheduler="slurm", id="77", user="bob", name=EVIL, pids=1))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        rows = {r[0][0]: r for r in app.screen.query_one("#node-table", TextTable).row_cells()}
        job_col = [c.key for c in app.screen.query_one("#node-table", TextTable).columns].index("job")
        assert rows["node02"][job_col][0] == "4242" and rows["node04"][job_col][0] == ""
        app.show_view("jobs")
        await wait_for(pilot, lambda: shown(app, JobsScreen))
        table = app.screen.query_one("#job-table", TextTable)
        cells = [[c[0] for c in row] for row in table.row_cells()]
        assert ["77", "slurm", "bob", EVIL] == cells[0][:4] or ["77", "slurm", "bob", EVIL] == cells[1][:4]
        (alice,) = [row for row in cells if row[0] == "4242"]
        assert alice[2:4] == ["alice", "pretrain-7b"] and alice[5] == "node[01-03]" and alice[6] == "node[01-03]"
        assert alice[7] == "9"  # processes, summed over its three nodes
        assert "click[/link]" in screen_text(app) and "\x1b]52" not in terminal_bytes(app)  # node text, literally
        table.cursor = [row[0] for row in cells].index("4242")
        await pilot.press("enter")
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        assert "node01" in screen_text(app)


async def test_the_jobs_view_says_so_when_no_agent_reports_a_job() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("jobs")
        await wait_for(pilot, lambda: shown(app, JobsScreen))
        assert "no scheduler job seen" in screen_text(app)


async def test_a_node_with_a_gpu_fallen_off_the_bus_is_degraded_not_ok() -> None:
    app = make_app()
    app.runtime.store.apply(make_sample("node02", 10, state="lost"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        rows = {r[0][0]: r for r in app.screen.query_one("#node-table", TextTable).row_cells()}
        assert rows["node02"][1][0] == "degraded" and rows["node01"][1][0] == "ok"
        assert str(app.runtime.store.status(app.runtime.store.by_name("node02"))) == "ok"  # its link is alive
        app.open_node("node02")
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        assert "node02  degraded" in screen_text(app)


async def test_a_node_read_from_prometheus_offers_nothing_that_needs_an_agent() -> None:
    from gridwatch.wire.protocol import HEARSAY_VERSION
    from tests.support_frames import make_hello

    app = make_app()
    store = app.runtime.store
    store.apply(msgspec.structs.replace(make_hello("node03"), agent_version=HEARSAY_VERSION))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.open_node("node03")
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        assert "read from Prometheus, no agent" in screen_text(app)
        assert app.screen.check_action("isolate", ()) is False and app.screen.check_action("checkpoint", ()) is False
        assert "Isolate" not in screen_text(app)  # the footer does not offer it
        app.open_node("node01")
        await wait_for(pilot, lambda: shown(app, NodeScreen) and app.screen.node_name == "node01")
        assert app.screen.check_action("isolate", ()) is True


async def test_the_heatmap_draws_a_cell_per_gpu_though_the_nodes_were_listed_before_their_hellos() -> None:
    from gridwatch.console.fleet.state import StateStore
    from gridwatch.console.runtime.core import ConsoleRuntime
    from gridwatch.console.tui.app import GridwatchApp
    from gridwatch.console.tui.widgets import GpuHeatmap
    from gridwatch.playbooks.clock import ManualClock
    from tests.support_frames import T0, make_hello

    store = StateStore(ManualClock(T0))
    for name in ("node-1", "node-2"):
        store.set_link(name, "connecting")  # listed from the cluster file: no hello yet, so no GPUs known
    app = GridwatchApp(ConsoleRuntime(store), tick_seconds=3600, start_runtime=False)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        for name in ("node-1", "node-2"):
            store.apply(make_hello(name, gpus=8))
            store.apply(make_sample(name, 1))
        app.tick()
        await pilot.pause()
        heatmap = app.screen.query_one(GpuHeatmap)
        assert heatmap._cells_per_node == 8
        line = next(ln for ln in screen_text(app).splitlines() if ln.startswith("node-2"))
        assert line.count("█") == 8


async def test_the_incidents_view_says_each_incident_s_phase() -> None:
    from gridwatch.console.runtime.incidents import IncidentRow
    from gridwatch.console.tui.screens import IncidentsScreen
    from tests.support_frames import T0

    app = make_app()
    rows = {"inc-act": dict(acted_at=T0 - 20), "inc-rec": dict(acted_at=T0 - 20, recovered_at=T0 - 10),
            "inc-ack": dict(state="acknowledged", acted_at=T0 - 20), "inc-done": dict(state="resolved")}
    for key, extra in rows.items():
        fields = {"state": "open", **extra}
        app.runtime.incidents.add(IncidentRow(id=key, severity="critical", node="node02", title=key,
                                              detected_at=T0 - 30, **fields))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("incidents")
        await wait_for(pilot, lambda: shown(app, IncidentsScreen))
        said = {r[3][0]: r[1][0] for r in app.screen.query_one(TextTable).row_cells()}
        assert said == {"XID 79: GPU fell off the bus": "open", "inc-act": "acting", "inc-rec": "recovered",
                        "inc-ack": "acknowledged", "inc-done": "resolved"}
        assert "2 open incidents" in screen_text(app)  # the fixture's and inc-act: recovered or acknowledged ones are not


def on_screen(widget) -> list[str]:  # noqa: ANN001 - a line-drawn widget
    """What the widget's lines hold now, from Textual's copy where it kept one (what the terminal shows)."""
    from textual.geometry import Region

    return [strip.text for strip in widget.render_lines(Region(0, 0, widget.size.width, widget.size.height))]


async def test_a_redraw_paints_again_only_the_rows_that_changed_and_shows_their_new_values() -> None:
    from gridwatch.console.tui.widgets import GpuHeatmap

    app = make_app()
    store = app.runtime.store
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        table = app.screen.query_one("#node-table", TextTable)
        heatmap = app.screen.query_one(GpuHeatmap)
        app.tick()
        await pilot.pause()
        painted: list[str] = []
        for widget in (table, heatmap):
            draw = widget.strip_of

            def counted(runs, y, draw=draw, widget=widget):  # noqa: ANN001, ANN202
                painted.append(f"{type(widget).__name__}:{y}")
                return draw(runs, y)

            widget.strip_of = counted
        before = on_screen(table)
        app.tick()  # nothing new: nothing painted again
        await pilot.pause()
        assert painted == [] and on_screen(table) == before
        store.apply(make_sample("node03", 50, util=7.0))  # one node's news: its row and its heatmap line
        app.tick()
        await pilot.pause()
        after = on_screen(table)
        row = next(i for i, line in enumerate(after) if line.startswith("node03"))
        util = after[0].index("UTIL %")
        assert after[row][util:util + 6].strip() == "7"  # UTIL % reads the new value
        assert [i for i, (a, b) in enumerate(zip(before, after)) if a != b] == [row]
        assert sorted(painted) == sorted([f"TextTable:{row}", f"GpuHeatmap:{heatmap.line_of('node03')}"])
        # No new reading, but the node is late now: its cells say so (a node's cells are kept only while unchanged).
        cells = heatmap.line_of("node03")
        assert "~" not in on_screen(heatmap)[cells]
        store.clock.advance(60)
        app.tick()
        await pilot.pause()
        assert on_screen(heatmap)[cells].lstrip().startswith("node03 ~▒")


async def test_a_cursor_moved_between_a_redraw_and_its_paint_is_drawn_where_it_went() -> None:
    # A redraw works out the lines that changed; a key that moves the cursor before they are painted must not
    # leave the cursor drawn on the row it left (a log view following new lines does this at every tick).
    from textual.geometry import Region

    app = make_app()
    store = app.runtime.store
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        table = app.screen.query_one("#node-table", TextTable)
        assert table.move_to("node03")
        await pilot.pause()
        store.apply(make_sample("node03", 51, util=9.0))  # news on the cursor's row
        app.tick()
        table.cursor += 1  # then the cursor moves on, before the paint
        await pilot.pause()
        cursor = table.get_component_rich_style("text-table--cursor").bgcolor
        lines = table.render_lines(Region(0, 0, table.size.width, table.size.height))
        marked = [strip.text.split()[0] for strip in lines if any(s.style and s.style.bgcolor == cursor for s in strip)]
        assert marked == ["node04"]


async def test_a_fleet_on_2_s_summaries_redraws_every_2_s_but_news_at_the_next_tick() -> None:
    # Readings wait for the cadence (each node's changes every 2 s); an XID, a link going down, do not wait.
    from types import SimpleNamespace

    from gridwatch.wire.protocol import Event, Text

    app = make_app()
    store = app.runtime.store
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.runtime.fleet = SimpleNamespace(options=SimpleNamespace(summary_every=2.0))  # type: ignore[assignment]
        app.tick_seconds = 1.0  # its timer stays off: the test ticks
        clock = [100.0]
        app.monotonic = lambda: clock[0]
        screen = app.screen
        drawn: list[int] = []
        draw = screen.tick
        screen.tick = lambda: (drawn.append(1), draw())  # type: ignore[method-assign]
        app.tick()
        assert len(drawn) == 1
        store.apply(make_sample("node03", 51, util=9.0))  # a reading: waits for the cadence
        app.tick()
        assert len(drawn) == 1
        store.apply(Event(kind=Text("xid"), code=79, gpu=1, node=Text("node03"), seq=52, ts=store.clock.now()))
        app.tick()  # news: drawn at once
        assert len(drawn) == 2
        store.set_link("node04", "down", error="connection lost")
        app.tick()
        assert len(drawn) == 3
        store.set_link("node04", "down", error="connection lost")  # the same state again is no news
        clock[0] += 1.0
        app.tick()
        assert len(drawn) == 3
        clock[0] += 1.0  # two seconds since the news: the cadence's redraw
        app.tick()
        assert len(drawn) == 4
        app.set_note("pre-flight: starting on 8 nodes")  # the operator's own feedback: at once
        assert len(drawn) == 5
        await pilot.pause()
        assert "node04 down" in " ".join(screen_text(app).split())
