"""The console driven headless: navigation, filtering, drill-down, confirmations, read-only mode, hostile text."""

from __future__ import annotations

import re

import pytest
from textual import events

from gridwatch.console.fleet.state import ManualClock, StateStore
from gridwatch.console.runtime.core import ConsoleRuntime
from gridwatch.console.tui.app import GridwatchApp
from gridwatch.console.tui.screens import (
    CommandLine,
    ConfirmScreen,
    FleetScreen,
    IncidentsScreen,
    KeysScreen,
    LogsScreen,
    NodeScreen,
    TrainingScreen,
)
from gridwatch.console.tui.widgets import GpuHeatmap, TextTable
from gridwatch.wire.protocol import Event, LogLine, Text
from tests.support_app import EVIL, SIZE, RecordingFleet, make_app, screen_text, shown, terminal_bytes, wait_for
from tests.support_frames import T0, fill_fleet, make_hello, make_sample, make_trainer


def table_keys(app: GridwatchApp, selector: str) -> list[str]:
    return list(app.screen.query_one(selector, TextTable).keys)


async def test_home_shows_every_node_and_enter_opens_it_and_esc_goes_back() -> None:
    fleet = RecordingFleet()
    app = make_app(fleet=fleet)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        assert table_keys(app, "#node-table")[:3] == ["node01", "node02", "node03"]
        await pilot.press("down", "down", "enter")
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        assert app.screen.node_name == "node03"
        assert table_keys(app, "#gpu-table") == [str(i) for i in range(8)]
        assert fleet.subscriptions == [("node03", True)]
        await pilot.press("escape")
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        assert fleet.subscriptions[-1] == ("node03", False)


async def test_slash_filters_the_table_and_the_heatmap_and_escape_clears_it() -> None:
    app = make_app(["gpu-a1", "gpu-a2", "gpu-b1", "gpu-b2"])
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        await pilot.press("slash", "b")
        await wait_for(pilot, lambda: table_keys(app, "#node-table") == ["gpu-b1", "gpu-b2"])
        assert [n.name for n in app.screen.query_one(GpuHeatmap).nodes] == ["gpu-b1", "gpu-b2"]
        await pilot.press("enter", "escape")
        await wait_for(pilot, lambda: len(table_keys(app, "#node-table")) == 4)


async def test_sort_key_cycles_and_reverse_flips() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
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
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        for command, screen_type in (("logs", LogsScreen), ("incidents", IncidentsScreen),
                                     ("training", TrainingScreen), ("nodes", FleetScreen)):
            await pilot.press("colon")
            await wait_for(pilot, lambda: isinstance(app.screen, CommandLine))
            await pilot.press(*command, "enter")
            await wait_for(pilot, lambda t=screen_type: shown(app, t))
        assert len(app.screen_stack) == 1
        await pilot.press("colon", *"bogus", "enter")
        await wait_for(pilot, lambda: "unknown command" in app.note)


def _burst(app: GridwatchApp, *items: str | events.Paste) -> None:
    """Post keys all at once, as a terminal delivers a paste or ``tmux send-keys``: nothing waits in between."""
    chars = {"colon": ":", "enter": "\r", "ctrl+j": "\n"}
    for item in items:
        app.post_message(item if isinstance(item, events.Paste) else events.Key(item, chars.get(item, item)))


async def test_keys_typed_straight_after_colon_reach_the_command_line_in_order() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        _burst(app, "colon", *"logs", "enter")
        await wait_for(pilot, lambda: shown(app, LogsScreen))
        _burst(app, "colon", events.Paste("training"), "enter")
        await wait_for(pilot, lambda: shown(app, TrainingScreen))
        _burst(app, "colon", *"nodez", "enter")  # a typo arrives whole, in order, and is named
        await wait_for(pilot, lambda: "unknown command :nodez" in app.note)
        assert len(app.screen_stack) == 2 and isinstance(app.screen, TrainingScreen)
        _burst(app, "colon", *"incidents", "enter", "colon", *"logs", "enter")  # two commands in one burst
        await wait_for(pilot, lambda: shown(app, LogsScreen))
        assert [type(s) for s in app.screen_stack] == [FleetScreen, LogsScreen]


def test_one_command_table_drives_the_line_the_keys_screen_and_the_palette() -> None:
    from gridwatch.console.tui.screens.command_line import COMMANDS, Verb, parse_command

    assert [(c.verb, rest) for c, rest in [parse_command(t) for t in ("node", "node node02", "no", "lo", "pf n[1-2]")]] \
        == [(Verb.NODES, ""), (Verb.NODE, "node02"), (Verb.NODES, ""), (Verb.LOGS, ""), (Verb.PREFLIGHT, "n[1-2]")]
    assert parse_command("bogus") is None and parse_command("node") is not None
    assert len({c.verb for c in COMMANDS}) == len(COMMANDS)


async def test_question_mark_lists_the_keys_of_the_view() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, KeysScreen))
        listed = dict(app.screen.rows)
        assert listed["/"] == "Filter" and listed["m"] == "Metric" and listed["s"] == "Sort"
        assert {":logs", ":incidents", ":training", ":nodes", "Ctrl+P", "?"} <= set(listed)
        # Keys by the names on the keyboard, the keys of one action on one line; no internal names.
        assert listed["Enter"] == "Open" and listed["Esc"] == "Clear filter" and listed["Ctrl+P"] == "command palette"
        assert "q" in next(keys for keys, does in listed.items() if does == "Quit").split(", ")
        assert listed["Up, k"] == "Up" and listed["]"] == "Heatmap page" and listed["PgDn"] == "Page down"
        internal = {"enter", "escape", "question_mark", "slash", "colon", "right_square_bracket", "pagedown", "ctrl+p"}
        assert not internal & {key for keys in listed for key in keys.split(", ")}
        assert "Enter" in screen_text(app) and "Esc" in screen_text(app)
        await pilot.press("escape")
        await wait_for(pilot, lambda: shown(app, FleetScreen))


async def test_the_help_says_the_summaries_cadence_and_lists_no_takeover_without_etcd() -> None:
    from types import SimpleNamespace

    from gridwatch.console.tui.screens.command_line import usage_line

    app = make_app()
    links = {f"10.0.{i // 250}.{i % 250}:8022": None for i in range(2_500)}
    app.runtime.fleet = SimpleNamespace(options=SimpleNamespace(mode="summary", summary_every=5.0), links=links)  # type: ignore[assignment]
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, KeysScreen))
        listed = dict(app.screen.rows)
        assert listed["cadence"] == "summaries every 5 s from 2,500 nodes; full samples for nodes opened"
        assert ":takeover" not in listed
    # No etcd, no election: the prompt does not offer a take-over either.
    assert "takeover" not in usage_line(app.offers) and "takeover" in usage_line()


async def test_node_isolate_asks_first_and_cancel_sends_nothing() -> None:
    fleet = RecordingFleet()
    app = make_app(fleet=fleet)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.open_node("node02")
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        await pilot.press("i")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("escape")
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        assert fleet.actions == []
        await pilot.press("i")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press(*"bad gpu 3", "enter")
        await wait_for(pilot, lambda: fleet.actions == [("node02", "isolate", "bad gpu 3")])
        await wait_for(pilot, lambda: "isolate on node02: ok" in app.note)


async def test_incident_acknowledge_and_silence_go_through_a_confirmation_into_the_audit_trail() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("incidents")
        await wait_for(pilot, lambda: shown(app, IncidentsScreen))
        assert table_keys(app, "#incident-table") == ["inc-1"]
        assert "capture_scene" in screen_text(app)
        await pilot.press("a")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press(*"on it", "enter")
        incidents = app.runtime.incidents
        await wait_for(pilot, lambda: incidents.rows["inc-1"].state == "acknowledged")
        await pilot.press("s")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        duration = app.screen.query_one("#confirm-duration")
        duration.value = "2h"
        await pilot.press(*"maintenance", "enter")
        await wait_for(pilot, lambda: incidents.rows["inc-1"].state == "silenced")
        row = incidents.rows["inc-1"]
        assert row.silenced_until == pytest.approx(T0 + 7200)
        assert [(a.what.split()[0], a.why) for a in row.audit] == [("acknowledge", "on it"),
                                                                   ("silence", "maintenance")]
        app.runtime.store.clock.advance(7201)  # the silence expires by itself
        app.tick()
        assert incidents.rows["inc-1"].state == "open"


async def test_a_bad_silence_duration_is_explained_and_nothing_changes() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("incidents")
        await wait_for(pilot, lambda: shown(app, IncidentsScreen))
        await pilot.press("s")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        app.screen.query_one("#confirm-duration").value = "forever"
        await pilot.press("enter")
        await wait_for(pilot, lambda: "bad duration" in screen_text(app))
        assert app.runtime.incidents.rows["inc-1"].state == "open"


async def test_a_silence_takes_the_playbooks_duration_grammar() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("incidents")
        await wait_for(pilot, lambda: shown(app, IncidentsScreen))
        await pilot.press("s")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        app.screen.query_one("#confirm-duration").value = "500ms"  # as in a playbook: half a second
        await pilot.press(*"flapping", "enter")
        incidents = app.runtime.incidents
        await wait_for(pilot, lambda: incidents.rows["inc-1"].state == "silenced")
        assert incidents.rows["inc-1"].silenced_until == pytest.approx(T0 + 0.5)


@pytest.mark.parametrize("scheduler", ["none", "slurm"])
async def test_isolate_and_unisolate_from_the_node_view_say_what_happens_and_are_audited(tmp_path, scheduler) -> None:
    from gridwatch.console.runtime.incidents import StoreIncidents
    from gridwatch.playbooks.executor import Executor
    from gridwatch.playbooks.store import IncidentStore

    store = StateStore(ManualClock(T0))
    fill_fleet(store, ["node01", "node02"])
    for node in list(store.nodes.values()):
        store.set_link(node.key, node.link, role="operator")
    db = IncidentStore(tmp_path / "incidents.db", store.clock)
    fleet = RecordingFleet()
    runtime = ConsoleRuntime(store, fleet=fleet, incidents=StoreIncidents(db), plan_store=db, operator="alice",
                             scheduler=scheduler)
    runtime.executor = Executor(db, runtime, clock=store.clock, who="alice", scheduler=scheduler)
    app = GridwatchApp(runtime, tick_seconds=3600, start_runtime=False)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.open_node("node02")
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        await pilot.press("i")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        said = screen_text(app)
        # Isolation is gridwatch's own mark; the scheduler is named only where one is configured.
        assert "scheduler stops placing" not in said and "trainer is asked to leave" in said
        assert ("Slurm is not told" in said) == (scheduler == "slurm")
        await pilot.press(*"bad gpu 3", "enter")
        await wait_for(pilot, lambda: "isolate on node02: ok" in app.note)
        store.apply(make_sample("node02", 9, isolated=True))
        app.tick()
        await pilot.press("i")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert ("Slurm drain that gridwatch made is resumed" in screen_text(app)) == (scheduler == "slurm")
        await pilot.press(*"fixed", "enter")
        await wait_for(pilot, lambda: "unisolate on node02: ok" in app.note)
    assert [a[1] for a in fleet.actions] == ["isolate", "unisolate"]
    audit = [(a.who, a.what, a.why, a.phase) for a in db.audit_log()]
    assert audit[:4] == [("alice", "isolate on node02", "bad gpu 3", "before"),
                         ("alice", "isolate on node02", "bad gpu 3", "after"),
                         ("alice", "unisolate on node02", "fixed", "before"),
                         ("alice", "unisolate on node02", "fixed", "after")]
    assert db.audit_log()[1].outcome.startswith("done")
    assert any(what.startswith("return_to_service node02") for _, what, _, _ in audit)
    db.close()


@pytest.mark.parametrize("read_only, role", [(True, "operator"), (False, "viewer")])
async def test_read_only_has_no_changing_action_at_all(read_only: bool, role: str) -> None:
    fleet = RecordingFleet()
    app = make_app(read_only=read_only, role=role, fleet=fleet)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        assert app.runtime.read_only
        app.show_view("incidents")
        await wait_for(pilot, lambda: shown(app, IncidentsScreen))
        await pilot.press("a", "s", "x")
        await pilot.pause()
        assert isinstance(app.screen, IncidentsScreen)  # no dialog opened
        assert app.runtime.incidents.rows["inc-1"].state == "open"
        footer = screen_text(app).splitlines()[-1]
        assert "Acknowledge" not in footer and "Silence" not in footer
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, KeysScreen))
        assert not {"Acknowledge", "Silence", "Act (run plan)"} & set(dict(app.screen.rows).values())
        await pilot.press("escape")
        app.open_node("node01")
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        await pilot.press("i", "c")
        await pilot.pause()
        assert isinstance(app.screen, NodeScreen) and fleet.actions == []
        assert "READ-ONLY" in screen_text(app)
        with pytest.raises(PermissionError):
            app.runtime.acknowledge("inc-1", "sneaky")


async def test_logs_search_fans_out_shows_progress_and_merges_by_time() -> None:
    lines = [LogLine(node=Text(n), source=Text("trainer"), line=Text(f"NCCL timeout rank {i}"), line_ts=T0 - 10 + i)
             for i, n in enumerate(["node02", "node01"])]
    fleet = RecordingFleet(lines)
    app = make_app(fleet=fleet)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("logs")
        await wait_for(pilot, lambda: shown(app, LogsScreen))
        await pilot.press("slash", *"nccl since:1h", "ctrl+s")
        await wait_for(pilot, lambda: "1/2 agents answered" in screen_text(app))
        fleet.release.set()
        await wait_for(pilot, lambda: "2/2 agents answered" in screen_text(app))
        table = app.screen.query_one("#logs-table", TextTable)
        assert [row[1][0] for row in table.row_cells()] == ["node02", "node01"]


async def test_logs_view_filters_events_and_explains_a_bad_query() -> None:
    app = make_app()
    store = app.runtime.store
    store.apply(Event(node=Text("node04"), kind=Text("xid"), severity=Text("critical"), gpu=2, code=79,
                      message=Text("fell off the bus"), ts=T0))
    store.apply(Event(node=Text("node05"), kind=Text("thermal"), severity=Text("warning"), ts=T0))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("logs")
        await wait_for(pilot, lambda: shown(app, LogsScreen))
        assert len(app.screen.query_one("#logs-table", TextTable).rows) == 2
        await pilot.press("slash", *"sev:error", "enter")
        await wait_for(pilot, lambda: [r[1][0] for r in app.screen.query_one("#logs-table", TextTable).row_cells()]
                       == ["node04"])
        await pilot.press("slash", *" node:node[", "enter")
        await wait_for(pilot, lambda: "node set" in screen_text(app))


async def test_training_view_plots_loss_and_marks_the_straggler() -> None:
    app = make_app()
    store = app.runtime.store
    for step in range(1, 60):
        store.apply(make_sample("node01", step, trainer=make_trainer(step, ranks=4, straggler=2)))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("training")
        await wait_for(pilot, lambda: shown(app, TrainingScreen))
        text = screen_text(app)
        assert "llama-8b" in text and "straggler" in text and "tokens/s 123,456" in text
        assert any("\u2800" < ch <= "\u28ff" for ch in text)  # the loss curve is drawn in braille
        rows = app.screen.query_one("#rank-table", TextTable).row_cells()
        assert [r[3][0] for r in rows] == ["", "", "straggler", ""]


async def test_training_view_says_when_no_trainer_is_attached() -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("training")
        await wait_for(pilot, lambda: shown(app, TrainingScreen))
        assert "no trainer attached" in screen_text(app)


async def test_hostile_node_text_is_shown_literally_and_never_reaches_the_terminal_as_escapes() -> None:
    from gridwatch.wire.protocol import decode_agent_frame, encode

    evil_name = EVIL + "\x1b]52;c;aGk=\x07"
    app = make_app([])
    store = app.runtime.store
    frames = [
        make_hello(evil_name, gpus=2, gpu_name="[blink]GPU[/blink]\x1b[5m"),
        make_sample(evil_name, 1, gpus=2),
        Event(node=Text(evil_name), kind=Text("[red]xid"), severity=Text("[bold]critical"),
              message=Text("[link=file:///etc/passwd]x[/link]\x1b[2J"), ts=T0),
        LogLine(node=Text(evil_name), source=Text("[i]src"), line=Text("\x1b[31m[on red]boom[/on red]\x9b2J")),
    ]
    for frame in frames:
        store.apply(decode_agent_frame(encode(frame)))
    (name,) = [n.name for n in store.nodes.values()]
    assert name.startswith(EVIL) and "\x1b" not in name
    store.set_link(name, "down", error="[bold]refused[/bold] \x1b[?1049l")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        text = screen_text(app)
        assert EVIL[:14] in text  # clipped to the column, but literal
        (row,) = app.screen.query_one("#node-table", TextTable).row_cells()
        assert row[4][0] == "[bold]refused[/bold] [?1049l"
        raw = terminal_bytes(app)
        assert "\x1b]52" not in raw and "\x07" not in raw and "\x1b[2J" not in raw
        app.open_node(name)
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        text = screen_text(app)
        assert "[blink]GPU[/blin" in text and "[link=file:///etc/passwd]x[/link]" in text
        assert "[on red]boom[/on red]" in text
        assert "\x1b[5m" not in terminal_bytes(app)
        app.show_view("logs")
        await wait_for(pilot, lambda: shown(app, LogsScreen))
        assert "[link=file:///etc/passwd]x[/link]" in screen_text(app)


async def test_one_dead_node_keeps_its_last_values_with_age_and_error() -> None:
    app = make_app(["node01", "node02"])
    store = app.runtime.store
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        store.clock.advance(30)
        store.apply(make_sample("node02", 40))
        store.set_link("node01", "down", error="node01:8022: connection refused (is the agent running?)")
        app.tick()
        await pilot.pause()
        rows = {r[0][0]: r for r in app.screen.query_one("#node-table", TextTable).row_cells()}
        dead = rows["node01"]
        assert dead[1][0] == "down" and dead[7][0] != "N/A" and dead[3][0] == "30s"
        assert "connection refused" in dead[4][0]
        # The table clips the error; the highlighted node's line under it shows it whole.
        assert "node01  down  seen 30s ago  node01:8022: connection refused (is the agent running?)" in screen_text(app)
        assert "1/2 nodes connected" in screen_text(app)
        assert "oldest data 30s" in screen_text(app)


async def test_the_command_palette_opens_views() -> None:
    from textual.command import CommandPalette

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette))
        await pilot.press(*"Incidents")
        await wait_for(pilot, lambda: app.screen.query("CommandList").first().option_count > 0)
        await pilot.press("enter")
        await wait_for(pilot, lambda: shown(app, IncidentsScreen))


async def test_a_logs_query_for_a_few_nodes_streams_their_lines_until_the_view_closes() -> None:
    fleet = RecordingFleet()
    app = make_app(fleet=fleet)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("logs")
        await wait_for(pilot, lambda: shown(app, LogsScreen))
        await pilot.press("slash", *"node:node[02-03]", "enter")
        await wait_for(pilot, lambda: sorted(fleet.subscriptions) == [("node02", True), ("node03", True)])
        app.run_command("node node02")  # the node view wants node02 too: no second subscription
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        await pilot.press("escape")
        await wait_for(pilot, lambda: shown(app, LogsScreen))
        assert len(fleet.subscriptions) == 2  # the logs view still streams node02
        await pilot.press("escape")
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        assert sorted(fleet.subscriptions[2:]) == [("node02", False), ("node03", False)]


# ------------------------------------------------------------ at real sizes


def _contrast(fg: tuple[int, int, int], bg: tuple[int, int, int]) -> float:
    """WCAG contrast ratio of two colours."""
    def luminance(rgb: tuple[int, int, int]) -> float:
        def channel(v: int) -> float:
            c = v / 255
            return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
        r, g, b = (channel(v) for v in rgb)
        return 0.2126 * r + 0.7152 * g + 0.0722 * b
    hi, lo = sorted((luminance(fg), luminance(bg)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _is_red(rgb: tuple[int, int, int]) -> bool:
    import colorsys

    hue, saturation, value = colorsys.rgb_to_hsv(*(v / 255 for v in rgb))
    return (hue < 20 / 360 or hue > 340 / 360) and saturation > 0.5 and value > 0.4


def _line_with(app: GridwatchApp, text: str) -> str:
    return next(line for line in screen_text(app).splitlines() if text in line)


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_the_fleet_table_shows_why_a_node_is_bad_before_its_metrics(size: tuple[int, int]) -> None:
    app = make_app()
    store = app.runtime.store
    store.set_link("node02", "down", error="node02:8022: connection refused (is the agent running?)")
    store.apply(make_sample("node04", 9, isolated=True))
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        header = _line_with(app, "NODE")
        at = [header.find(title) for title in ("NODE", "STATE", "FLAGS", "SEEN", "ERROR")]
        assert -1 not in at and at == sorted(at), header  # all on screen, in that order
        assert all(header.find(metric) in (-1,) or header.find(metric) > at[-1] for metric in ("UTIL", "POWER", "GPUS"))
        down = _line_with(app, "node02 ")
        assert "down" in down and "node02:8022: co" in down  # the start of the error, on screen
        assert "isolated" in _line_with(app, "node04 ")


async def test_the_incident_title_takes_the_room_a_wide_terminal_has() -> None:
    from gridwatch.console.runtime.incidents import IncidentRow

    title = "NCCL watchdog: collective operation timeout on rank 37 after 600000 ms waiting for all-reduce of step 1200"

    def app_with_a_long_title() -> GridwatchApp:
        app = make_app()
        app.runtime.incidents.add(IncidentRow(id="inc-2", severity="error", node="node05", title=title, state="open",
                                              detected_at=T0 - 5, playbook="nccl-hang"))
        return app

    app = app_with_a_long_title()
    async with app.run_test(size=(220, 30)) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("incidents")
        await wait_for(pilot, lambda: shown(app, IncidentsScreen))
        row = _line_with(app, "nccl-hang")
        assert title in row and re.search(r" \d+\.\ds$", row.rstrip())  # whole, and the age column still on screen
    app = app_with_a_long_title()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("incidents")
        await wait_for(pilot, lambda: shown(app, IncidentsScreen))
        row = _line_with(app, "nccl-hang")
        assert title[:30] in row and title not in row and re.search(r" \d+\.\ds$", row.rstrip())  # narrowed, all shown


async def test_power_and_memory_carry_units_and_step_time_is_named_so() -> None:
    app = make_app(["node01", "node02"])
    store = app.runtime.store
    store.apply(make_sample("node01", 9, trainer=make_trainer(1200)))
    async with app.run_test(size=(320, 30)) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        header = _line_with(app, "NODE")
        assert "POWER W" in header and "MEM %" in header and "UTIL %" in header and "TEMP °C" in header
        assert "STEP TIME" in header and header.count("STEP") == 1
        assert _line_with(app, "node01 ").rstrip().endswith("0.52s")
        app.show_view("training")
        await wait_for(pilot, lambda: shown(app, TrainingScreen))
        text = screen_text(app)
        assert "step 1200" in text and "step time 0.520s" in text  # the step number, and the step time named so
        assert "STEP TIME" in _line_with(app, "RANK")


async def test_a_selected_row_is_readable() -> None:
    app = make_app()
    app.runtime.store.set_link("node01", "down", error="refused")  # red and yellow cells in the cursor's row
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        table = app.screen.query_one("#node-table", TextTable)

        def cursor_contrasts() -> list[float]:
            segments = [s for s in table.render_line(1 + table.cursor) if s.text.strip()]
            return [_contrast(s.style.color.get_truecolor(), s.style.bgcolor.get_truecolor()) for s in segments]

        assert min(cursor_contrasts()) >= 4.5  # focused
        await pilot.press("tab")  # the heatmap takes the focus; the table's cursor stays, dimmer
        await wait_for(pilot, lambda: not table.has_focus)
        assert min(cursor_contrasts()) >= 4.5


async def test_red_means_broken_not_busy() -> None:
    from gridwatch.console.tui.widgets.heatmap import cell_style

    app = make_app(["a-idle", "busy01", "broken01"])  # the cursor's node (drawn reversed) is neither
    store = app.runtime.store
    store.apply(make_sample("busy01", 9, util=100.0, temp=89.0))
    store.apply(make_sample("broken01", 9, state="lost"))
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        heatmap = app.screen.query_one(GpuHeatmap)

        def cell_colours(name: str) -> set[tuple[int, int, int]]:
            line = next(y for y in range(len(heatmap.nodes)) if heatmap.nodes[y].name == name)
            return {tuple(s.style.color.get_truecolor()) for s in heatmap.render_line(line) if "█" in s.text}

        assert cell_colours("busy01") and not any(_is_red(c) for c in cell_colours("busy01"))  # util 100 %
        await pilot.press("m")  # temperature: 89 °C is hot, and hot is not broken
        await wait_for(pilot, lambda: "colour: temp" in screen_text(app))
        assert not any(_is_red(c) for c in cell_colours("busy01"))
        row = next(r for r in app.screen.query_one("#node-table", TextTable).row_cells() if r[0][0] == "busy01")
        assert int(row[8][0]) >= 85 and not _is_red(tuple(row[8][1].color.get_truecolor()))  # the table's TEMP too
        await pilot.press("m", "m", "m")
        await wait_for(pilot, lambda: "colour: health" in screen_text(app))
        assert any(_is_red(c) for c in cell_colours("broken01"))  # a lost GPU is red
        assert not any(_is_red(c) for c in cell_colours("busy01"))
    assert all(not _is_red(tuple(cell_style(v / 10).color.get_truecolor())) for v in range(11))


async def test_the_node_view_scrolls_to_what_a_short_terminal_cuts_off() -> None:
    from gridwatch.console.fleet.node import CheckVerdict, PreflightResult
    from tests.support_frames import patrol_failed

    app = make_app()
    store = app.runtime.store
    store.apply(patrol_failed("node02", gpus="gpu 0: uncorrected ECC errors (1)", network="ib0 is down"))
    checks = [CheckVerdict(f"check{i}", i != 6, f"detail {i}") for i in range(7)]
    store.set_preflight("node02", PreflightResult(T0, False, checks))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.open_node("node02")
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        assert "patrol     FAILING" in screen_text(app) and "check6" not in screen_text(app)  # cut off at first
        for _ in range(4):  # tab goes round the panes: the GPUs, the host's, the events, the log
            if app.focused is not None and app.focused.id == "host-pane":
                break
            await pilot.press("tab")
        assert app.focused is not None and app.focused.id == "host-pane"
        await pilot.press("end")
        await wait_for(pilot, lambda: "check6   FAIL detail 6" in screen_text(app))


async def test_q_in_the_demo_asks_before_quitting() -> None:
    from gridwatch.console.tui.screens import QuitScreen

    for confirm in ("q", "y"):
        app = GridwatchApp(make_app().runtime, tick_seconds=3600, start_runtime=False, demo=True)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: shown(app, FleetScreen))
            await pilot.press("q")
            await wait_for(pilot, lambda: isinstance(app.screen, QuitScreen))
            assert "Quit the demo?" in screen_text(app) and app.return_code is None
            await pilot.press("n")  # anything else stays
            await wait_for(pilot, lambda: shown(app, FleetScreen))
            await pilot.press("q")
            await wait_for(pilot, lambda: isinstance(app.screen, QuitScreen))
            await pilot.press("escape")
            await wait_for(pilot, lambda: shown(app, FleetScreen))
            assert app.return_code is None
            await pilot.press("colon", *"quit", "enter")  # the command line asks too
            await wait_for(pilot, lambda: isinstance(app.screen, QuitScreen))
            await pilot.press(confirm)
            await wait_for(pilot, lambda: app.return_code == 0)


async def test_q_outside_the_demo_quits_at_once() -> None:
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        await pilot.press("q")
        await wait_for(pilot, lambda: app.return_code == 0)


async def test_keys_typed_while_the_console_starts_reach_it() -> None:
    """Typed before the screen took the terminal over, Enter arrives as a line feed (ctrl+j): still Enter."""
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        _burst(app, "colon", *"logs", "ctrl+j")  # at once, before the fleet view has drawn itself
        await wait_for(pilot, lambda: shown(app, LogsScreen))
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        _burst(app, "down", "down", "enter")  # keys for the fleet view before it is ready wait for it
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        assert app.screen.node_name == "node03"


async def test_logs_search_reads_the_console_store_first_and_marks_where_each_line_came_from(tmp_path) -> None:  # noqa: ANN001
    # node09 is gone (killed, re-imaged): only the console's store still has its lines.
    from gridwatch.console.runtime.logfeed import keep_logs
    from gridwatch.console.runtime.logstore import LogRow, LogStore
    from tests.conftest import wait_until

    live = [LogLine(node=Text("node01"), source=Text("trainer"), line=Text("NCCL timeout rank 3"), line_ts=T0 - 5)]
    fleet = RecordingFleet(live)
    fleet.release.set()
    app = make_app(fleet=fleet)
    store = LogStore(tmp_path / "incidents.logs" / "logs.db")
    keep_logs(app.runtime, store)
    store.write([LogRow(node="node09", ts=T0 - 60, source="log:/var/log/train.log",
                        line="NCCL WARN NET/IB : Got completion from peer with error 12")])
    await wait_until(lambda: store.counters.written == 1, 10, "the store's line written")
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: shown(app, FleetScreen))
            app.show_view("logs")
            await wait_for(pilot, lambda: shown(app, LogsScreen))
            await pilot.press("slash", *"nccl since:1h", "ctrl+s")
            table = app.screen.query_one("#logs-table", TextTable)
            await wait_for(pilot, lambda: len(table.rows) == 2)
            text = screen_text(app)
            assert "2 lines, 1 from the console's store, 1 from the agents" in text
            assert "store: log:/var/" in text and "agent: trainer" in text
            assert [row[1][0] for row in table.row_cells()] == ["node09", "node01"]  # merged by time
    finally:
        store.close()
