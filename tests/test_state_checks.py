"""Patrol and pre-flight results per node in the state store: what the fleet marks and the node view explains."""

from __future__ import annotations

import pytest

from gridwatch.console.fleet.metrics import Metric
from gridwatch.console.fleet.node import CheckVerdict, PatrolStatus, PreflightResult
from gridwatch.console.fleet.state import ManualClock, StateStore
from gridwatch.wire.protocol import Event, Text
from tests.support_frames import T0, fill_fleet, patrol_failed, patrol_recovered


@pytest.fixture
def store() -> StateStore:
    s = StateStore(ManualClock(T0))
    fill_fleet(s, ["node01", "node02", "node03"], gpus=2)
    return s


def test_a_failing_patrol_is_kept_with_each_reason_and_flags_the_node(store: StateStore) -> None:
    assert store.by_name("node02").patrol.status is PatrolStatus.UNKNOWN
    store.apply(patrol_failed("node02", gpus="gpu 0: uncorrected ECC errors (1)", network="ib0 is down"))
    node = store.by_name("node02")
    assert node.patrol.status is PatrolStatus.FAILING and node.patrol.changed_at == store.clock.now()
    assert node.patrol.failing == [CheckVerdict("gpus", False, "gpu 0: uncorrected ECC errors (1)"),
                                   CheckVerdict("network", False, "ib0 is down")]
    rows = {r.name: r for r in store.node_rows()}
    assert rows["node02"].flags == "patrol" and rows["node01"].flags == ""
    assert [r.name for r in store.node_rows(filter_text="patrol")] == ["node02"]
    assert [n.name for n in store.heatmap(Metric.UTIL) if n.checks_failing] == ["node02"]
    # Problems sort first among healthy links.
    assert store.node_rows("status")[0].name == "node02"


def test_a_recovered_patrol_clears_the_flag_and_says_when(store: StateStore) -> None:
    store.apply(patrol_failed("node02", gpus="gpu 1 throttled: HW slowdown"))
    store.clock.advance(90)
    store.apply(patrol_recovered("node02"))
    node = store.by_name("node02")
    assert node.patrol.status is PatrolStatus.OK and node.patrol.failing == []
    assert node.patrol.changed_at == T0 + 2 + 90
    assert store.node_rows()[1].flags == ""


def test_a_patrol_event_naming_no_checks_still_marks_the_node_with_its_message(store: StateStore) -> None:
    store.apply(Event(node=Text("node01"), kind=Text("patrol_failed"), severity=Text("error"),
                      message=Text("patrol: node sub-healthy"), ts=T0))
    assert store.by_name("node01").patrol.failing == [CheckVerdict("patrol", False, "patrol: node sub-healthy")]


def test_a_failed_preflight_is_kept_by_connection_key_and_flags_the_node(store: StateStore) -> None:
    result = PreflightResult(store.clock.now(), False, [CheckVerdict("gpus", False, "gpu 0: uncorrected ECC"),
                                                        CheckVerdict("stack", True, "same as the majority")])
    store.set_preflight("node03", result)
    store.set_preflight("nowhere:22", result)  # a node the store never saw is ignored, not created
    assert store.by_name("node03").preflight is result and "nowhere:22" not in store.nodes
    assert {r.name: r.flags for r in store.node_rows()} == {"node01": "", "node02": "", "node03": "preflight"}
    store.set_preflight("node03", PreflightResult(store.clock.now(), True, []))
    assert store.node_rows()[2].flags == ""


def test_samples_tell_a_passing_patrol_from_no_news():
    from gridwatch.console.fleet.node import PatrolStatus
    from gridwatch.console.fleet.state import ManualClock, StateStore
    from gridwatch.wire.protocol import Hello, Sample, Text

    store = StateStore(ManualClock(1_700_000_000.0))
    store.apply(Hello(node=Text("n1")), key="n1")
    store.apply(Sample(node=Text("n1"), seq=1), key="n1")
    assert store.by_name("n1").patrol.status is PatrolStatus.UNKNOWN  # no patrol runs there
    store.apply(Sample(node=Text("n1"), seq=2, patrol_failing=[]), key="n1")
    assert store.by_name("n1").patrol.status is PatrolStatus.OK
    store.apply(Sample(node=Text("n1"), seq=3, patrol_failing=[Text("storage")]), key="n1")
    node = store.by_name("n1")
    assert node.patrol.status is PatrolStatus.FAILING and [v.name for v in node.patrol.failing] == ["storage"]
