"""``gridwatch logs``: the console's log store read after the node is gone; cluster.toml's retention and store_max."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gridwatch.agent.logs import LogTailer
from gridwatch.console.cli import main
from gridwatch.console.runtime.config import ConfigError, load_cluster, parse_size, write_cluster
from gridwatch.console.runtime.logfeed import log_store_of
from gridwatch.console.runtime.logstore import LogRow, LogStore, store_path_for
from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
from gridwatch.sshlink.hostlist import parse_endpoints
from tests.conftest import start_agent, stop_agent, wait_until
from tests.support_cli import cluster_toml, gridwatch

# Written by us in the format of a PyTorch worker's progress line.
BEFORE = "[rank0]: step 800 loss 2.31"


async def test_logs_finds_an_incidents_lines_after_the_node_is_gone(keys, tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text("")
    stamp = [time.time() - 120.0]  # two minutes before the fault: inside the incident's window
    tailer = LogTailer([str(log)], kernel=False, from_start=True, clock=lambda: stamp[0])
    ra = await start_agent(keys, name="node-1", gpus=2, tailer=tailer)
    with log.open("a") as f:
        f.write(BEFORE + "\n")
    await wait_until(lambda: any(e[1] == BEFORE for e in tailer.entries()), 10, "the agent to read the line")
    db = tmp_path / "incidents.db"
    runtime = build_runtime(RuntimeOptions(endpoints=parse_endpoints(ra.spec), key_path=str(keys.operator_key),
                                           known_hosts=str(keys.known_hosts), db_path=str(db), tick_interval=0.1))
    store = log_store_of(runtime)
    assert store is not None
    try:
        await runtime.start()
        await wait_until(lambda: runtime.store.by_name("node-1") is not None
                         and runtime.store.by_name("node-1").link == "connected", 15, "the agent connected")
        # XID 13 is the application's: the shipped xid-application playbook only notifies.
        result = await runtime.fleet.action("node-1", "inject_fault", {"kind": "xid", "code": 13, "gpu": 1})
        assert result.ok, result.message
        await wait_until(lambda: any(i.playbook == "xid-application" for i in runtime.plan_store.incidents()), 15,
                         "the incident")
        # The event's line comes with the frame; the line before it was asked of the agent when the incident opened.
        await wait_until(lambda: store.query(pattern="step 800") and store.query(pattern="xid", severity="warning"), 15,
                         "the event's line and the window's")
    finally:
        await runtime.stop()
        runtime.plan_store.close()
        await stop_agent(ra)  # the node is gone
    out = gridwatch("logs", "--db", str(db), "--nodes", "node-1", "--since", "1h", "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert {r["where"] for r in rows} == {"store"} and {r["node"] for r in rows} == {"node-1"}
    (before,) = [r for r in rows if r["line"] == BEFORE]
    assert before["kind"] == "line" and before["severity"] == "" and abs(before["ts"] - stamp[0]) < 1e-3
    assert before["source"] == str(log) and before["time"].endswith("Z")
    xid = [r for r in rows if r["kind"] == "event" and r["line"].startswith("xid gpu1 code=13")]
    assert xid and xid[0]["severity"] in ("warning", "error", "critical")
    assert [r["ts"] for r in rows] == sorted(r["ts"] for r in rows)
    # The Logs view's query, as the one argument; nothing found is 1.
    out = gridwatch("logs", "--db", str(db), "node:node-1 since:1h step 800")
    assert out.returncode == 0 and BEFORE in out.stdout and " node-1  -  " in out.stdout
    out = gridwatch("logs", "--db", str(db), "--grep", "no such line anywhere", "--json")
    assert out.returncode == 1 and out.stdout == ""


@pytest.fixture
def stored(tmp_path: Path) -> Path:
    """An incident database's path, with a log store beside it holding three lines."""
    db = tmp_path / "incidents.db"
    store = LogStore(store_path_for(db))
    now = time.time()
    store.write([LogRow(node="node-1", ts=now - 7200, source="log:/var/log/kern.log", line="old line"),
                 LogRow(node="node-2", ts=now - 60, source="nvml", line="xid gpu0 code=79 GPU has fallen off the bus",
                        severity="critical", kind="event"),
                 LogRow(node="node-3", ts=now - 30, source="log:/var/log/train.log", line='he said "NEAR(" twice')])
    store.close()
    return db


def test_logs_filters_and_prints_json_one_object_a_line(stored: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["logs", "--db", str(stored), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["node"] for r in rows] == ["node-1", "node-2", "node-3"]
    assert set(rows[0]) == {"node", "ts", "time", "severity", "source", "kind", "line", "where"}
    assert main(["logs", "--db", str(stored), "--json", "--since", "1h", "--nodes", "node-[1-2]"]) == 0
    assert [json.loads(line)["node"] for line in capsys.readouterr().out.splitlines()] == ["node-2"]
    assert main(["logs", "--db", str(stored), "--json", "--severity", "error"]) == 0
    assert [json.loads(line)["node"] for line in capsys.readouterr().out.splitlines()] == ["node-2"]
    assert main(["logs", "--db", str(stored), "--json", "--grep", 'said "NEAR']) == 0  # quotes and FTS words, as text
    assert [json.loads(line)["node"] for line in capsys.readouterr().out.splitlines()] == ["node-3"]
    assert main(["logs", "--db", str(stored), "--json", "--until", "45s", "--limit", "1"]) == 0
    assert [json.loads(line)["node"] for line in capsys.readouterr().out.splitlines()] == ["node-2"]
    assert main(["logs", "--db", str(stored), "sev:critical", "fallen"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "node-2  critical  nvml  xid gpu0 code=79 GPU has fallen off the bus" in out
    assert main(["logs", "--db", str(stored), "--since", "1m", "--grep", "old"]) == 1
    assert "no line matches" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "says"), [
    (["--since", "yesterdayish"], "--since: 'yesterdayish' is not a duration or a time"),
    (["--since", "1h", "--until", "2h"], "--until is before --since"),
    (["--severity", "fatal"], "--severity: 'fatal' is not one of info, warning, error, critical"),
    (["--limit", "lots"], "--limit: expected a whole number"),
    (["--limit", "0"], "--limit: expected a whole number"),
    (["--grep", "NEAR("], "--grep: bad regular expression: missing ), unterminated subpattern"),
    (["--grep", "*"], "--grep: bad regular expression: nothing to repeat"),
    (["--nodes", "node[1-"], "--nodes: "),
    (["sev:fatal"], "query: severity 'fatal' is not one of"),
])
def test_bad_input_is_one_line_and_exit_2(stored: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                          says: str) -> None:
    assert main(["logs", "--db", str(stored), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"gridwatch logs: {says}") and captured.err.count("\n") == 1


def test_no_store_is_exit_2_and_cluster_toml_finds_it(stored: Path, tmp_path: Path, keys,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["logs", "--db", str(tmp_path / "elsewhere.db")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no log store at {tmp_path / 'elsewhere.logs' / 'logs.db'}" in err
    assert main(["logs", "--cluster", str(cluster_toml(tmp_path, keys)), "--json"]) == 0  # db = "incidents.db"
    assert len(capsys.readouterr().out.splitlines()) == 3
    bad = cluster_toml(tmp_path, keys, 'retention = "a fortnight"\n')
    assert main(["logs", "--cluster", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "retention: expected how long the log store keeps lines" in err


# --------------------------------------------------------------------------- cluster.toml


def test_cluster_toml_takes_retention_and_store_max(tmp_path: Path, keys) -> None:
    config = load_cluster(cluster_toml(tmp_path, keys, 'retention = "3d"\nstore_max = "500MB"\n'))
    options = RuntimeOptions.from_cluster(config)
    assert options.log_retention_s == 3 * 86400 and options.log_store_max == 500 * 10**6
    again = load_cluster(write_cluster(tmp_path / "again.toml", config))
    assert (again.retention, again.store_max) == ("3d", "500MB")
    default = RuntimeOptions.from_cluster(load_cluster(cluster_toml(tmp_path, keys)))
    assert default.log_retention_s == 14 * 86400 and default.log_store_max == 20 * 10**9
    seconds = load_cluster(cluster_toml(tmp_path, keys, "retention = 3600\nstore_max = 1048576\n"))
    assert (seconds.retention_s, seconds.store_max_bytes) == (3600.0, 1048576)
    assert parse_size("1.5GiB") == 3 * 2**29 and parse_size("20gb") == 20 * 10**9 and parse_size("64 KiB") == 65536


@pytest.mark.parametrize(("extra", "says"), [
    ('retention = "fortnight"', "retention: expected how long the log store keeps lines, a duration above 0"),
    ("retention = 0", "retention: expected how long"),
    ('retention = "-1d"', "retention: expected how long"),
    ("retention = true", "retention: expected how long"),
    ('store_max = "20XB"', "store_max: expected the most the log store may hold, a size above 0"),
    ('store_max = "0GB"', "store_max: expected the most"),
    ("store_max = 1.5", "store_max: expected the most"),
])
def test_a_bad_retention_or_store_max_is_one_line_naming_the_key(tmp_path: Path, keys, extra: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_cluster(cluster_toml(tmp_path, keys, extra + "\n"))
    assert says in str(info.value) and "\n" not in str(info.value)


def test_the_console_refuses_a_bad_store_max_in_one_line(tmp_path: Path, keys) -> None:
    bad = cluster_toml(tmp_path, keys, 'store_max = "lots"\n')
    out = gridwatch("console", "--headless", "--cluster", str(bad), "--duration", "0.1")
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "store_max" in out.stderr
    assert "Traceback" not in out.stderr
