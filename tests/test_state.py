"""The state store: what the console shows, fed frames as the fleet would, with a clock tests move."""

from __future__ import annotations

import pytest

from gridwatch.console.fleet.history import GPU_UTIL
from gridwatch.console.fleet.logquery import QueryError, parse_log_query
from gridwatch.console.fleet.metrics import Metric
from gridwatch.console.fleet.node import NodeStatus
from gridwatch.console.fleet.state import ManualClock, StateStore
from gridwatch.wire.protocol import (
    Event,
    LogLine,
    Text,
    decode_agent_frame,
    encode,
)
from tests.support_frames import T0, fill_fleet, make_hello, make_sample, make_trainer

# ------------------------------------------------------------- fixtures


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def store(clock: ManualClock) -> StateStore:
    return StateStore(clock)


# ------------------------------------------------------------------------ tests


def test_a_node_without_frames_for_three_intervals_is_stale_and_keeps_its_values(store, clock) -> None:
    fill_fleet(store, ["node01", "node02"])
    clock.advance(2.5)
    store.apply(make_sample("node02", 10))
    clock.advance(1.0)
    rows = {r.name: r for r in store.node_rows()}
    assert rows["node01"].status is NodeStatus.STALE
    assert rows["node01"].util is not None  # last good values stay
    assert rows["node01"].age_s == pytest.approx(3.5)
    assert rows["node02"].status is NodeStatus.OK
    assert store.summary().connected == 1


def test_the_age_order_puts_late_nodes_first_and_keeps_on_time_ones_by_name(store, clock) -> None:
    fill_fleet(store, ["node01", "node02", "node03", "node04"])  # a sample a second each (interval 1 s)
    clock.advance(5.0)
    for seq, name in enumerate(("node01", "node04", "node02")):  # heard 0.9, 0.6 and 0.3 s ago: all on time
        store.apply(make_sample(name, 20 + seq))
        clock.advance(0.3)
    rows = [r.name for r in store.node_rows("age")]
    assert rows == ["node01", "node02", "node04", "node03"]  # on time by name (not by arrival), the late one last


def test_a_down_link_shows_its_error(store) -> None:
    fill_fleet(store, ["node01"])
    store.set_link("node01", "down", error="connection reset by peer")
    row = store.node_rows()[0]
    assert row.status is NodeStatus.DOWN
    assert row.error == "connection reset by peer"


def test_the_node_whose_stack_differs_from_the_majority_is_flagged(store) -> None:
    for name in ("a", "b", "c"):
        store.apply(make_hello(name, stack="good"))
    store.apply(make_hello("d", stack="other"))
    flagged = {r.name for r in store.node_rows() if r.mismatch}
    assert flagged == {"d"}


def test_an_even_split_of_stacks_flags_no_one_as_pre_flight_judges_it(store) -> None:
    from gridwatch.console.fleet.preflight import majority_hash

    for name, stack in (("a", "one"), ("b", "one"), ("c", "two"), ("d", "two")):
        store.apply(make_hello(name, stack=stack))
    assert majority_hash(["one", "one", "two", "two"]) == ("one", False)  # pre-flight: no clear majority
    assert not any(r.mismatch for r in store.node_rows())  # so the fleet view does not guess a side
    store.apply(make_hello("e", stack="one"))
    assert {r.name for r in store.node_rows() if r.mismatch} == {"c", "d"}


def test_log_queries_read_durations_as_playbooks_do() -> None:
    assert parse_log_query("since:500ms").since_s == pytest.approx(0.5)
    assert parse_log_query("since:10m until:90").until_s == 90.0
    with pytest.raises(QueryError, match="'5x' is not a duration"):
        parse_log_query("since:5x")


def test_one_manual_clock_serves_the_store_and_callable_clocks(clock: ManualClock) -> None:
    from gridwatch.agent.sources.simulated import SimulatedGpus

    gpus = SimulatedGpus(1, seed=1, clock=clock)  # the agent side asks clock(), the store clock.now()
    store = StateStore(clock)
    clock.advance(5.0)
    gpus.inject("xid", 0, 79)
    (event, *_) = gpus.poll_events()
    assert event.ts == store.clock.now() == T0 + 5.0


def test_sorting_by_temperature_puts_na_last_either_way(store) -> None:
    fill_fleet(store, ["n1", "n2", "n3"])
    store.apply(make_sample("n2", 9, temp=80.0))
    store.set_link("n4", "connecting")
    up = [r.name for r in store.node_rows("temp")]
    down = [r.name for r in store.node_rows("temp", reverse=True)]
    assert up[-1] == "n4" and down[-1] == "n4"
    assert down[0] == "n2"


def test_filter_matches_name_state_and_flags(store) -> None:
    fill_fleet(store, ["gpu-a1", "gpu-a2", "gpu-b1"])
    store.set_link("gpu-b1", "down", error="x")
    assert [r.name for r in store.node_rows(filter_text="a")] == ["gpu-a1", "gpu-a2"]
    assert [r.name for r in store.node_rows(filter_text="down")] == ["gpu-b1"]


def test_history_ring_keeps_the_newest_points_in_order(store) -> None:
    store.apply(make_hello("n1", gpus=1))
    for seq in range(200):
        store.apply(make_sample("n1", seq, gpus=1, util=float(seq % 100)))
    series = store.nodes["n1"].gpu_history[0].series(GPU_UTIL)
    assert len(series) == 120
    assert series[-1] == 99.0 and series[0] == float(80 % 100)


def test_heatmap_health_marks_a_gpu_that_fell_off_the_bus(store) -> None:
    store.apply(make_hello("n1", gpus=2))
    store.apply(make_sample("n1", 1, gpus=2, state="lost"))
    assert store.heatmap(Metric.HEALTH)[0].values == [1.0, 1.0]
    assert store.heatmap(Metric.UTIL)[0].values == [None, None]  # N/A, not zero


def test_xid_events_count_per_gpu_and_reach_the_fleet_log(store) -> None:
    fill_fleet(store, ["n1"])
    store.apply(Event(node=Text("n1"), kind=Text("xid"), severity=Text("error"), gpu=3, code=79,
                      message=Text("GPU has fallen off the bus"), ts=T0))
    assert store.nodes["n1"].xids[3] == 1
    assert store.node_rows()[0].gpu_bad == 1
    entries = store.log_entries(parse_log_query("sev:error fallen"))
    assert [e.node for e in entries] == ["n1"] and "code=79" in entries[0].text


def test_log_query_filters_by_node_set_severity_and_time(store, clock) -> None:
    for i, name in enumerate(["node01", "node02", "node03"]):
        store.apply(Event(node=Text(name), kind=Text("nccl_timeout"), severity=Text("warning" if i else "critical"),
                          message=Text("watchdog"), ts=clock.now() - 600 * i))
    store.add_log("node02", LogLine(node=Text("node02"), source=Text("trainer"), line=Text("loss=nan"),
                                    line_ts=clock.now()))
    q = parse_log_query("node:node[01-02] since:5m")
    assert {(e.node, e.is_event) for e in store.log_entries(q)} == {("node01", True), ("node02", False)}
    assert [e.node for e in store.log_entries(parse_log_query("sev:error"))] == ["node01"]
    assert [e.text for e in store.log_entries(parse_log_query("loss=NAN"))] == ["loss=nan"]


@pytest.mark.parametrize("bad, words", [("node:node[1-", "node set"), ("sev:loud", "severity"),
                                        ("since:yesterday", "duration"), ("(unclosed", "regular expression")])
def test_a_bad_log_query_says_which_part_is_wrong(bad: str, words: str) -> None:
    with pytest.raises(QueryError, match=words):
        parse_log_query(bad)


def test_training_summary_follows_the_most_advanced_trainer(store) -> None:
    assert store.training() is None
    store.apply(make_sample("n1", 1, trainer=make_trainer(10)))
    store.apply(make_sample("n2", 1, trainer=make_trainer(12, straggler=2)))
    store.apply(make_sample("n1", 2, trainer=make_trainer(11)))  # an older step does not rewind the curve
    summary = store.training()
    assert summary is not None and summary.node == "n2" and summary.nodes_reporting == 2
    assert [s for s, _ in summary.loss] == [10, 12]


def test_hostile_strings_from_a_node_arrive_cleaned_and_are_kept_verbatim_otherwise(store) -> None:
    evil = "[bold red]pwn[/]\x1b]52;c;aGk=\x07\x1b[2J"
    frame = decode_agent_frame(encode(make_hello(evil)))
    store.apply(frame)
    (node,) = store.nodes.values()
    assert "\x1b" not in node.name and "\x07" not in node.name
    assert node.name.startswith("[bold red]pwn[/]")  # markup stays literal text; rendering never parses it


def test_a_renamed_node_is_found_by_its_agent_name(store) -> None:
    store.set_link("10.0.0.5:8022", "connecting")
    store.apply(make_hello("gpu-17"), key="10.0.0.5:8022")
    assert store.by_name("gpu-17") is store.nodes["10.0.0.5:8022"]
    assert [r.name for r in store.node_rows()] == ["gpu-17"]


def test_a_nodes_one_cell_reads_the_same_from_its_gpus_as_from_its_aggregate() -> None:
    """The zoomed-out heatmap colours a node by its worst GPU without summing the rest: the same value either way."""
    import random
    from collections import Counter

    from gridwatch.console.fleet.metrics import Metric, aggregate, worst_gpu, worst_of
    from gridwatch.wire.protocol import GpuBrief, Summary, Text

    rng = random.Random(7)

    def maybe(value: int) -> int | None:
        return None if rng.random() < 0.15 else value

    for _ in range(400):
        gpus = [GpuBrief(index=i, util=maybe(rng.randrange(101)), temp_c=maybe(rng.randrange(20, 100)),
                         power_w=maybe(rng.randrange(50, 800)), mem_used_mb=maybe(rng.randrange(0, 81_920)),
                         mem_total_mb=rng.choice([81_920, 0, None]), state=rng.choice(["ok"] * 6 + ["lost", "hung"]),
                         ecc_dbe=rng.choice([0, 0, 0, 1, None]), ecc_sbe=rng.choice([0, 0, 3, None]),
                         throttle=rng.choice([(), (), ("hw_thermal",)]))
                for i in range(rng.randrange(0, 9))]
        xids = Counter({rng.randrange(8): 1}) if rng.random() < 0.2 else Counter()
        summary = Summary(node=Text("n1"), gpus=gpus)
        for metric in Metric:
            assert worst_gpu(gpus, metric, xids) == worst_of(aggregate(summary, xids), metric), (metric, gpus, xids)


def test_a_query_that_found_nothing_is_not_the_nodes_error() -> None:
    """RAS not configured on a node answers ras_status with ok=False: a healthy node shows no error for it."""
    from gridwatch.wire.protocol import ActionResult, Text

    store = StateStore(ManualClock(T0))
    fill_fleet(store, ["node01"])
    node = store.by_name("node01")
    store.apply(ActionResult(id=Text("1"), action=Text("ras_status"), ok=False, node=Text("node01"),
                             message=Text('asking NCCL\'s RAS service is turned off on this node (ras = "")')), node.key)
    assert node.last_error is None
    store.apply(ActionResult(id=Text("2"), action=Text("isolate"), ok=False, node=Text("node01"),
                             message=Text("not persisted")), node.key)
    assert node.last_error == "isolate failed: not persisted"
