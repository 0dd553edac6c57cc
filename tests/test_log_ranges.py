"""Absolute ranges in the logs query: clock times, ISO dates, offsets, the console's zone said on screen."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from gridwatch.console.fleet.logquery import QueryError, parse_log_query
from gridwatch.console.fleet.logtime import TimeBound, console_zone, parse_time, zone_label
from gridwatch.console.tui.screens import FleetScreen, LogsScreen
from gridwatch.console.tui.widgets import TextTable
from gridwatch.wire.protocol import Event, Text
from tests.support_app import make_app, screen_text, shown, wait_for

PARIS = ZoneInfo("Europe/Paris")
# 2026-12-01 03:20:00 in Paris (UTC+01:00 in winter): the operator looks at an incident from 03:12.
NOW = datetime(2026, 12, 1, 3, 20, tzinfo=PARIS).timestamp()


def at(*fields: int, zone=PARIS) -> float:  # noqa: ANN001
    return datetime(*fields, tzinfo=zone).timestamp()


@pytest.mark.parametrize("text, expected", [
    ("03:10", at(2026, 12, 1, 3, 10)),
    ("03:10:30", at(2026, 12, 1, 3, 10, 30)),
    ("3:10", at(2026, 12, 1, 3, 10)),
    ("23:50", at(2026, 11, 30, 23, 50)),  # later than now today: last night
    ("2026-12-01", at(2026, 12, 1)),
    ("2026-12-01T03:10", at(2026, 12, 1, 3, 10)),
    ("2026-12-01 03:10:00", at(2026, 12, 1, 3, 10)),
    ("2026-12-01T02:10:00Z", at(2026, 12, 1, 3, 10)),
    ("2026-12-01T03:10:00+01:00", at(2026, 12, 1, 3, 10)),
    ("2026-12-01T07:10:00+05:00", at(2026, 12, 1, 3, 10)),
    ("2026-07-01T03:10", at(2026, 7, 1, 3, 10)),  # summer: the zone's own offset then (UTC+02:00)
])
def test_absolute_times_in_the_consoles_zone(text: str, expected: float) -> None:
    assert parse_time(text, NOW, PARIS) == TimeBound(at=expected)


def test_durations_stay_relative_and_use_the_playbooks_grammar() -> None:
    assert parse_time("10m", NOW, PARIS) == TimeBound(ago_s=600.0)
    assert parse_time("500ms", NOW, PARIS).resolve(NOW) == pytest.approx(NOW - 0.5)
    assert parse_time("90", NOW, PARIS).resolve(NOW + 10) == NOW - 80  # moves with the clock


@pytest.mark.parametrize("bad", ["25:00", "03:61", "2026-13-01T03:10", "yesterday", "5x", "03h10"])
def test_a_bad_time_is_one_line_saying_how_to_write_it(bad: str) -> None:
    with pytest.raises(QueryError) as exc:
        parse_log_query(f"since:{bad} nccl", NOW, PARIS)
    message = str(exc.value)
    assert message.startswith("since: ") and "\n" not in message and repr(bad) in message


def test_the_query_takes_quoted_and_absolute_ranges_and_keeps_its_regex() -> None:
    q = parse_log_query('node:node[01-02] since:"2026-12-01 03:10:00" until:03:15 NCCL WARN', NOW, PARIS)
    assert q.nodes == ["node01", "node02"] and q.regex == "NCCL WARN"
    assert q.window(NOW + 3600) == (at(2026, 12, 1, 3, 10), at(2026, 12, 1, 3, 15))
    mixed = parse_log_query("since:03:10 until:2m", NOW, PARIS)
    assert mixed.window(NOW) == (at(2026, 12, 1, 3, 10), NOW - 120)
    with pytest.raises(QueryError, match="until is before since"):
        parse_log_query("since:03:15 until:03:10", NOW, PARIS)


def test_the_zone_is_tz_and_is_named_by_its_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    assert zone_label(console_zone(), NOW) == "UTC+05:30"
    monkeypatch.setenv("TZ", "UTC")
    assert zone_label(console_zone(), NOW) == "UTC"
    assert zone_label(PARIS, NOW) == "UTC+01:00" and zone_label(timezone(timedelta(hours=-5)), NOW) == "UTC-05:00"


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


async def test_the_logs_view_filters_by_absolute_range_and_says_its_zone(utc: None) -> None:
    app = make_app()
    store = app.runtime.store
    now = store.clock.now()
    for minutes, node in ((30, "node01"), (10, "node02"), (2, "node03")):
        store.apply(Event(node=Text(node), kind=Text("xid"), severity=Text("critical"), gpu=0, code=79,
                          message=Text("fell off the bus"), ts=now - minutes * 60))
    clock = lambda ts: datetime.fromtimestamp(ts, UTC).strftime("%H:%M")  # noqa: E731
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("logs")
        await wait_for(pilot, lambda: shown(app, LogsScreen))
        assert "times in UTC" in screen_text(app)
        table = app.screen.query_one("#logs-table", TextTable)
        await pilot.press("slash", *f"since:{clock(now - 15 * 60)} until:{clock(now - 5 * 60)}", "enter")
        await wait_for(pilot, lambda: [r[1][0] for r in table.row_cells()] == ["node02"])
        # A bad time is one line in the view; the table keeps what the last good query showed.
        await pilot.press("slash", "ctrl+u", *"since:25:99", "enter")
        await wait_for(pilot, lambda: "since: '25:99' is not a time of day" in screen_text(app))
        assert [r[1][0] for r in table.row_cells()] == ["node02"]
