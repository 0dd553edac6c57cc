"""The summary cadence as an operator setting: "auto" by the fleet's size, a number, and bad values refused."""

from __future__ import annotations

import pytest

from gridwatch.console.runtime.config import ConfigError, cadence_line, parse_cluster, parse_summary_every, summary_cadence
from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
from gridwatch.sshlink.hostlist import parse_endpoints
from tests.support_cli import cluster_toml, gridwatch  # one way to run the CLI on a cluster.toml


@pytest.mark.parametrize("nodes, every", [(10, 0.0), (250, 0.0), (500, 2.0), (1_000, 4.0), (1_250, 5.0), (2_500, 5.0),
                                          (12_500, 5.0), (100_000, 5.0)])
def test_auto_is_every_sample_up_to_250_nodes_then_a_second_per_250_at_most_five(nodes, every) -> None:
    assert summary_cadence("auto", nodes) == every
    # A number is taken as it is, whatever the fleet's size; 0 is one summary per sample.
    assert summary_cadence(3.0, nodes) == 3.0 and summary_cadence(0.0, nodes) == 0.0


def test_the_cadence_in_force_is_one_line_an_operator_reads() -> None:
    assert cadence_line(2.5, 2_500) == "summaries every 2.5 s from 2,500 nodes; full samples for nodes opened"
    assert cadence_line(0.0, 1) == "a summary per sample from 1 node; full samples for nodes opened"
    assert parse_summary_every(" Auto ") == "auto" and parse_summary_every("2.5") == 2.5


def test_a_fleet_built_from_auto_subscribes_with_the_cadence_of_its_size(keys, tmp_path) -> None:
    # 2,500 endpoints that are never connected to: the subscription is decided when the fleet is built.
    endpoints = parse_endpoints("10.0.[0-9].[1-250]:8022")
    assert len(endpoints) == 2_500
    runtime = build_runtime(RuntimeOptions(endpoints=endpoints, key_path=str(keys.operator_key),
                                           known_hosts=str(keys.known_hosts)))
    try:
        fleet = runtime.fleet
        assert fleet is not None and fleet.options.summary_every == 5.0  # type: ignore[attr-defined]
        link = next(iter(fleet.links.values()))  # type: ignore[attr-defined]
        assert fleet.subscription(link, None).every == 5.0  # type: ignore[attr-defined]
    finally:
        runtime.plan_store.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", ['"fast"', "-1", "61", "nan", "true", "[3]"])
def test_a_bad_summary_every_is_one_sentence_naming_the_file_and_the_key(value) -> None:
    with pytest.raises(ConfigError) as err:
        parse_cluster(f'nodes = "n[1-2]:8022"\nsummary_every = {value}\n', "/etc/gridwatch/cluster.toml")
    message = str(err.value)
    assert message.startswith("/etc/gridwatch/cluster.toml: summary_every: expected \"auto\" or the seconds"), message
    assert "\n" not in message


def test_the_console_says_its_cadence_once_and_refuses_a_bad_one_with_exit_2(keys, tmp_path) -> None:
    path = cluster_toml(tmp_path, keys, "summary_every = 2.5\n")
    res = gridwatch("console", "--headless", "--cluster", str(path), "--duration", "0.2")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("summaries every") == 1
    assert "summaries every 2.5 s from 1 node; full samples for nodes opened" in res.stdout
    # The flag wins over the file; "auto" for one node is a summary per sample.
    res = gridwatch("console", "--headless", "--cluster", str(path), "--duration", "0.2", "--summary-every", "auto")
    assert res.returncode == 0 and "a summary per sample from 1 node" in res.stdout, res.stderr
    bad = cluster_toml(tmp_path, keys, 'summary_every = "often"\n')
    res = gridwatch("console", "--headless", "--cluster", str(bad))
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
    assert f"{bad}: summary_every: expected \"auto\"" in res.stderr and "got 'often'" in res.stderr
    res = gridwatch("console", "--headless", "--cluster", str(path), "--summary-every", "soon")
    assert res.returncode == 2 and "--summary-every: expected \"auto\"" in res.stderr


def test_the_demo_takes_the_same_setting_and_refuses_a_bad_one() -> None:
    from gridwatch.console.cli import build_parser

    args = build_parser().parse_args(["demo", "--summary-every", "2.5"])
    assert args.summary_every == 2.5
    assert build_parser().parse_args(["demo"]).summary_every == "auto"
    res = gridwatch("demo", "--headless", "--summary-every", "-3")
    assert res.returncode == 2 and "--summary-every: expected \"auto\"" in res.stderr and "got '-3'" in res.stderr


def test_a_fleet_on_slow_summaries_is_redrawn_at_their_cadence_at_least_every_5_s_a_small_one_every_tick() -> None:
    from types import SimpleNamespace

    from gridwatch.console.fleet.state import StateStore
    from gridwatch.console.runtime.core import ConsoleRuntime
    from gridwatch.console.tui.app import GridwatchApp

    runtime = ConsoleRuntime(StateStore())
    app = GridwatchApp(runtime, tick_seconds=1.0, start_runtime=False)
    assert app.redraw_every() == 1.0  # no fleet (a replay, a test): every tick
    runtime.fleet = SimpleNamespace(options=SimpleNamespace(summary_every=0.0))  # type: ignore[assignment]
    assert app.redraw_every() == 1.0  # a summary per sample: every tick
    runtime.fleet.options.summary_every = 2.0  # type: ignore[union-attr]
    assert app.redraw_every() == 2.0  # 500 nodes: a node's reading changes every 2 s
    runtime.fleet.options.summary_every = 4.0  # type: ignore[union-attr]
    assert app.redraw_every() == 4.0  # 1,000 nodes: as often as a node's reading changes
    runtime.fleet.options.summary_every = 30.0  # type: ignore[union-attr]
    assert app.redraw_every() == 5.0  # a cadence set slower than auto's: never further behind than 5 s
