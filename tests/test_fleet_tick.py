"""The fleet view's tick reads counts and orders kept from the nodes changed: they stay what a walk over every node would say."""

from __future__ import annotations

import random

from gridwatch.console.fleet.node import CheckVerdict, NodeStatus, PreflightResult
from gridwatch.console.fleet.rows import (
    FILTER_EVERY_S,
    VALUE_ORDER_EVERY_S,
    FleetSummary,
    sort_value,
)
from gridwatch.console.fleet.state import ManualClock, StateStore
from gridwatch.console.runtime.core import ConsoleRuntime
from gridwatch.console.runtime.incidents import StoreIncidents
from gridwatch.console.tui.app import GridwatchApp
from gridwatch.playbooks.store import IncidentStore
from gridwatch.wire.protocol import Event, Text
from tests.support_frames import T0, fill_fleet, make_hello, make_sample

NAMES = [f"node{i:02d}" for i in range(1, 9)]


def walked_summary(store: StateStore) -> FleetSummary:
    """The footer's counts the slow way: every node's status asked of the store, one by one."""
    now = store.clock.now()
    statuses = [store.status(n, now) for n in store.nodes.values()]
    connected = sum(s is NodeStatus.OK for s in statuses)
    ages = [now - n.last_frame_at for n in store.nodes.values() if n.last_frame_at is not None]
    gpus = sum(len(n.gpus) for n in store.nodes.values())
    return FleetSummary(connected, len(statuses), max(ages) if ages else None, gpus, len(statuses) - connected)


def walked_order(store: StateStore, sort: str, reverse: bool = False) -> list[str]:
    """The node table's order the slow way: a row for every node, sorted whole."""
    now = store.clock.now()
    rows = sorted((store.node_row(n, now) for n in store.nodes.values()), key=lambda r: sort_value(r, sort),
                  reverse=reverse)
    if reverse:
        rows.sort(key=lambda r: sort_value(r, sort)[0])
    return [r.name for r in rows]


def fleet() -> StateStore:
    store = StateStore(ManualClock(T0))
    fill_fleet(store, NAMES, gpus=2)
    return store


def test_the_footer_counts_a_node_that_went_quiet_and_one_that_came_back() -> None:
    store = fleet()
    assert store.summary() == FleetSummary(8, 8, 0.0, 16, 0)
    store.clock.advance(3.5)  # past three 1 s intervals: all quiet but the ones fed now
    for seq, name in enumerate(NAMES[1:], start=10):
        store.apply(make_sample(name, seq, gpus=2))
    summary = store.summary()
    assert (summary.connected, summary.problems, summary.oldest_age_s) == (7, 1, 3.5)
    assert store.status(store.nodes["node01"]) is NodeStatus.STALE
    store.apply(make_sample("node01", 20, gpus=2))
    assert store.summary() == FleetSummary(8, 8, 0.0, 16, 0)
    store.set_link("node03", "down", error="connection reset")
    store.set_link("node09", "connecting")  # a link not heard from yet: a problem, no GPUs
    assert store.summary() == FleetSummary(7, 9, 0.0, 16, 2)


def test_the_footer_and_the_status_order_match_a_walk_over_every_node_whatever_happens() -> None:
    # Written by us: a seeded run of what a fleet does (frames, link changes, silence, events, new nodes).
    rng = random.Random(15)
    store = fleet()
    names = list(NAMES)
    seq = 100
    for step in range(400):
        seq += 1
        name = rng.choice(names)
        what = rng.random()
        if what < 0.45:
            store.apply(make_sample(name, seq, gpus=rng.choice((2, 2, 2, 3)), state=rng.choice(["ok"] * 9 + ["lost"]),
                                    isolated=rng.random() < 0.05))
        elif what < 0.55:
            store.set_link(name, rng.choice(["down", "refused", "stale", "connected", "connecting"]))
        elif what < 0.65:
            store.clock.advance(rng.choice((0.5, 1.0, 2.5)))
        elif what < 0.7:
            store.apply(make_hello(name, gpus=2, stack=rng.choice(["stack-a", "stack-a", "stack-b"]),
                                   role=rng.choice(["operator", "viewer"])))
        elif what < 0.75:
            store.apply(Event(node=Text(name), kind=Text(rng.choice(["xid", "isolated", "unisolated", "patrol_failed",
                                                                      "patrol_recovered"])),
                              severity=Text("error"), gpu=0, code=79, ts=store.clock.now()))
        elif what < 0.78:
            names.append(f"node{len(names) + 1:02d}")
            store.set_link(names[-1], "connected", role="operator")
        if step % 7 == 0:
            assert store.summary() == walked_summary(store), f"step {step}"
            assert [r.name for r in store.node_rows("status")] == walked_order(store, "status"), f"step {step}"
            assert [r.name for r in store.node_rows("status", reverse=True)] == walked_order(store, "status", True)
            roles = [n.role for n in store.nodes.values() if n.role]
            assert store.role_counts() == {r: roles.count(r) for r in set(roles)}


def test_a_failed_preflight_moves_a_node_up_the_status_order_within_a_second() -> None:
    store = fleet()
    assert store.node_rows("status")[0].name == "node01"
    store.set_preflight("node05", PreflightResult(store.clock.now(), False, [CheckVerdict("gpus", False, "gpu 0: DBE")]))
    rows = store.node_rows("status")
    assert rows[store.node_rows("status").names.index("node05")].flags == "preflight"  # its row is fresh at once
    store.clock.advance(FILTER_EVERY_S)
    assert store.node_rows("status")[0].name == "node05"  # and the order has it first within a second


def test_a_value_sort_shows_a_new_hot_gpu_within_its_refresh_and_says_how_old_its_order_is() -> None:
    store = fleet()
    before = store.node_rows("temp", reverse=True)
    hottest = before[0].name
    assert before.names == walked_order(store, "temp", True) and before.as_of == store.clock.now()
    store.clock.advance(1.0)
    store.apply(make_sample("node06", 50, gpus=2, temp=95.0))
    rows = store.node_rows("temp", reverse=True)
    assert rows[0].name == hottest and rows.as_of == T0 + 2  # the order as of its making: fill_fleet took 2 s
    assert rows[rows.names.index("node06")].temp_max is not None and rows[rows.names.index("node06")].temp_max >= 95
    store.clock.advance(VALUE_ORDER_EVERY_S - 1.0)
    rows = store.node_rows("temp", reverse=True)
    assert rows[0].name == "node06" and rows.names == walked_order(store, "temp", True)
    assert rows.as_of == store.clock.now()


def test_a_filter_follows_the_fleet_within_a_second() -> None:
    store = fleet()
    assert store.node_rows(filter_text="down").names == []
    store.set_link("node04", "down")
    store.clock.advance(FILTER_EVERY_S)
    assert store.node_rows(filter_text="down").names == ["node04"]
    assert store.node_rows(filter_text="DOWN ").names == ["node04"]  # a new filter text matches at once


async def test_the_fleet_view_says_how_old_a_value_order_is() -> None:
    store = fleet()
    incidents = StoreIncidents(IncidentStore(":memory:", store.clock))
    app = GridwatchApp(ConsoleRuntime(store, incidents=incidents), tick_seconds=3600, start_runtime=False)
    async with app.run_test(size=(200, 40)) as pilot:
        await pilot.pause()
        await pilot.press("s", "s")  # name, status, util
        screen = app.screen
        assert screen.sort_key == "util"
        store.clock.advance(1.0)
        screen.tick()
        title = str(screen.query_one("#view-title").render())
        assert "util order as of 1.0s ago" in title
        await pilot.press("s")  # temp: a new order, made now
        assert "temp order as of 0.0s ago" in str(screen.query_one("#view-title").render())
