"""One typed cluster.toml for every command, the scheduler wired to the executor, shipped playbooks replaced only
when asked, and the incident database migrated to schema 2."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from gridwatch.console.runtime.config import ConfigError, load_cluster
from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
from gridwatch.playbooks.loader import BUILTIN_DIR, load_with_builtin
from gridwatch.playbooks.store import IncidentStore, StoreError
from gridwatch.playbooks.store_db import SCHEMA_VERSION
from tests.conftest import free_port
from tests.support_cli import cluster_toml, gridwatch


@pytest.mark.parametrize("extra, says", [
    ('scheduler = "slurn"\n', "scheduler: expected one of none, slurm, kubernetes, got 'slurn'"),
    ('schedular = "slurm"\n', "unknown key 'schedular'"),
    ('read_only = "yes"\n', "read_only: expected true or false, got 'yes'"),
    ('connect_timeout = nan\n', "connect_timeout: expected a number of seconds above 0"),
    ('playbooks = 3\n', "playbooks: expected a path or a list of paths"),
])
@pytest.mark.parametrize("command", [["console", "--headless"], ["tail"], ["preflight"]])
def test_a_bad_cluster_toml_is_one_line_naming_file_and_key_and_exit_2(keys, tmp_path, extra, says, command) -> None:
    path = cluster_toml(tmp_path, keys, extra)
    res = gridwatch(*command, "--cluster", str(path))
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
    assert str(path) in res.stderr and says in res.stderr


def test_the_scheduler_of_cluster_toml_reaches_the_executor_and_the_flag_wins(keys, tmp_path) -> None:
    path = cluster_toml(tmp_path, keys, 'scheduler = "slurm"\noperator = "alice"\netcd = ["http://10.0.0.1:2379"]\n')
    config = load_cluster(path)
    options = RuntimeOptions.from_cluster(config)
    assert (options.scheduler, options.operator, options.etcd) == ("slurm", "alice", ["http://10.0.0.1:2379"])
    assert options.db_path == str(tmp_path / "incidents.db")  # relative to the file
    runtime = build_runtime(options)
    try:
        assert runtime.executor.scheduler == "slurm" and runtime.scheduler == "slurm"
    finally:
        runtime.plan_store.close()
    res = gridwatch("console", "--headless", "--cluster", str(path), "--duration", "0.2")
    assert res.returncode == 0, res.stderr
    assert "scheduler slurm, acting as alice" in res.stdout
    res = gridwatch("console", "--headless", "--cluster", str(path), "--duration", "0.2", "--scheduler", "kubernetes")
    assert res.returncode == 0 and "scheduler kubernetes" in res.stdout


def test_a_missing_or_broken_cluster_toml_is_one_line(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_cluster(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("nodes = [")
    with pytest.raises(ConfigError, match=f"{bad}: not valid TOML"):
        load_cluster(bad)
    nodes = tmp_path / "nodes.toml"
    nodes.write_text('key = "k"\n')
    with pytest.raises(ConfigError, match="no 'nodes'"):
        load_cluster(nodes)


# ------------------------------------------------------------------- playbooks


def _shipped_copy(tmp_path: Path, name: str, header: str = "") -> Path:
    folder = tmp_path / "books"
    folder.mkdir(exist_ok=True)
    text = (BUILTIN_DIR / f"{name}.yaml").read_text().replace("description: ", "description: ours. ", 1)
    path = folder / f"{name}.yaml"
    path.write_text(header + text)
    return path


def test_a_user_playbook_named_like_a_shipped_one_is_an_error_unless_it_replaces_it(keys, tmp_path) -> None:
    mine = _shipped_copy(tmp_path, "xid-application")
    result = load_with_builtin([mine])
    assert not result.ok
    (error,) = result.errors
    assert error.path == str(mine) and "'xid-application'" in error.message and "replaces" in error.message
    # Through the product: one line naming the file and the name, exit 2.
    path = cluster_toml(tmp_path, keys, f'playbooks = ["{mine.parent}"]\n')
    res = gridwatch("console", "--headless", "--cluster", str(path), "--duration", "0.2")
    assert res.returncode == 2 and str(mine) in res.stderr and "xid-application" in res.stderr
    assert res.stderr.strip().count("\n") == 0

    mine.write_text("replaces: xid-application\n" + mine.read_text())
    result = load_with_builtin([mine])
    assert result.ok, result.errors
    (used,) = [pb for pb in result.playbooks if pb.name == "xid-application"]
    assert used.source == str(mine) and used.description.startswith("ours.")
    assert len(result.playbooks) == len(load_with_builtin([]).playbooks)


def test_replaces_must_name_a_shipped_playbook(tmp_path) -> None:
    mine = _shipped_copy(tmp_path, "xid-application")
    mine.write_text("replaces: xid-everything\n" + mine.read_text().replace("name: xid-application", "name: mine"))
    result = load_with_builtin([mine])
    assert not result.ok and "'xid-everything', which is not a shipped playbook" in str(result.errors[0])


# ------------------------------------------------------------------- database

# The incidents table as schema 1 wrote it.
_V1 = """
CREATE TABLE incidents (
    id TEXT PRIMARY KEY, playbook TEXT NOT NULL, node TEXT NOT NULL, gpu INTEGER,
    kind TEXT NOT NULL, severity TEXT NOT NULL, scope TEXT NOT NULL, summary TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'open', silenced_until REAL, symptoms INTEGER NOT NULL DEFAULT 1,
    detected_at REAL NOT NULL, acted_at REAL, recovered_at REAL, resolved_at REAL,
    acknowledged_by TEXT, incident_json BLOB NOT NULL
);
CREATE TABLE steps (
    id TEXT PRIMARY KEY, incident TEXT NOT NULL REFERENCES incidents(id), idx INTEGER NOT NULL,
    step TEXT NOT NULL, target TEXT NOT NULL, decision TEXT NOT NULL, reason TEXT NOT NULL,
    state TEXT NOT NULL, started_at REAL, finished_at REAL, outcome TEXT NOT NULL DEFAULT '',
    planned_json BLOB NOT NULL
);
CREATE TABLE audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, who TEXT NOT NULL, what TEXT NOT NULL,
    why TEXT NOT NULL, incident TEXT, step TEXT, phase TEXT NOT NULL, outcome TEXT NOT NULL DEFAULT ''
);
INSERT INTO incidents (id, playbook, node, kind, severity, scope, summary, detected_at, recovered_at, incident_json)
VALUES ('xid-hardware:node-1:1000', 'xid-hardware', 'node-1', 'xid', 'critical', 'node', 'xid 79', 1000.0, 1009.0,
        '{"id": "xid-hardware:node-1:1000", "playbook": "xid-hardware", "kind": "xid", "severity": "critical",
          "scope": "node", "node": "node-1", "opened_at": 1000.0, "last_seen_at": 1000.0}');
PRAGMA user_version = 1;
"""


def test_a_schema_1_database_is_migrated_to_the_current_schema_and_keeps_its_incidents(tmp_path) -> None:
    db = tmp_path / "incidents.db"
    raw = sqlite3.connect(db)
    raw.executescript(_V1)
    raw.close()
    store = IncidentStore(db)
    try:
        (rec,) = store.incidents()
        assert rec.id == "xid-hardware:node-1:1000" and rec.fault_at is None and rec.recover_s is None
        store.mark_fault(rec.id, 999.5, 40)
        store.mark_fault(rec.id, 990.0, 12)  # the first answer stays
        rec = store.incident(rec.id)
        assert (rec.fault_at, rec.fault_step, rec.detect_s, rec.recover_s) == (999.5, 40, 0.5, 9.5)
    finally:
        store.close()
    check = sqlite3.connect(db)
    assert check.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert check.execute("SELECT detect_s, recover_s FROM incident_times").fetchone() == (0.5, 9.5)
    check.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    check.commit()
    check.close()
    with pytest.raises(StoreError, match="newer gridwatch"):
        IncidentStore(db)


# ------------------------------------------------------------------- relays


def relay_toml(tmp_path: Path, keys, body: str) -> Path:  # noqa: ANN001
    """A cluster.toml with the deployment's key, known_hosts and db, then ``body`` (nodes and [[relay]] tables)."""
    path = tmp_path / "cluster.toml"
    path.write_text(f'key = "{keys.operator_key}"\nknown_hosts = "{keys.known_hosts}"\ndb = "incidents.db"\n{body}')
    return path


def _eps(spec: str) -> list:
    from gridwatch.sshlink.hostlist import parse_endpoints

    return parse_endpoints(spec)


def test_relay_tables_reach_the_runtime_and_auto_counts_every_node_direct_and_relayed(keys, tmp_path) -> None:
    from gridwatch.console.runtime.config import write_cluster
    from gridwatch.sshlink.hostlist import Endpoint

    path = relay_toml(tmp_path, keys, 'nodes = "node[001-016]:8022"\n'
                      '[[relay]]\naddress = "head1:8023"\nnodes = "node[017-1264]:8022"\n'
                      '[[relay]]\naddress = "head2:8023"\nnodes = ["node[1265-2500]:8022", "gpu7:9000"]\n')
    options = RuntimeOptions.from_cluster(load_cluster(path))
    assert options.endpoints == _eps("node[001-016]:8022")  # the console links to these itself
    assert options.relays == {Endpoint("head1", 8023): _eps("node[017-1264]:8022"),
                              Endpoint("head2", 8023): _eps("node[1265-2500]:8022,gpu7:9000")}
    runtime = build_runtime(options)
    try:
        fleet = runtime.fleet
        assert fleet is not None and len(fleet.links) == 2_501  # type: ignore[attr-defined]
        # 16 direct nodes alone would get a summary per sample; 2,501 nodes in all get one each 5 s.
        assert fleet.options.summary_every == 5.0  # type: ignore[attr-defined]
        assert runtime.store.by_name("node2000:8022") is not None  # the fleet view lists relayed nodes from the start
    finally:
        runtime.plan_store.close()
    # The file the demo writes for a second console keeps the tables.
    again = load_cluster(write_cluster(tmp_path / "again.toml", load_cluster(path)))
    assert again.relay == load_cluster(path).relay


def test_nodes_may_be_left_out_when_relays_carry_every_node(keys, tmp_path) -> None:
    from gridwatch.sshlink.hostlist import Endpoint

    path = relay_toml(tmp_path, keys, '[[relay]]\naddress = "head1:8023"\nnodes = "node[001-512]:8022"\n')
    options = RuntimeOptions.from_cluster(load_cluster(path))
    assert options.endpoints == [] and list(options.relays) == [Endpoint("head1", 8023)]
    assert len(options.relays[Endpoint("head1", 8023)]) == 512


RELAYS = '[[relay]]\naddress = "head1:8023"\nnodes = "node[017-256]:8022"\n'


@pytest.mark.parametrize("body, says", [
    ('nodes = "node[001-016]:8022"\n[[relay]]\naddress = "head1"\nnodes = "node[017-512]:8022"\n',
     "relay[1].address: expected HOST:PORT of a gridwatch relay, e.g. \"head1:8023\", got 'head1'"),
    (f'nodes = "node[001-016]:8022"\n{RELAYS}[[relay]]\naddress = "head2:8023"\nnodes = "node[257-51x]:8022"\n',
     "relay[2].nodes: bad range '257-51x'"),
    (f'nodes = "node[001-016]:8022"\n{RELAYS}[[relay]]\naddress = "head2:8023"\nnodes = "node[256-512]:8022"\n',
     "relay[2].nodes: node256:8022 is under relay head1:8023 and relay head2:8023"),
    (f'nodes = "node[001-017]:8022"\n{RELAYS}', "relay[1].nodes: node017:8022 is listed in nodes and under relay head1:8023"),
    (f'nodes = "node[001-016]:8022,head1:8023"\n{RELAYS}', "relay[1].address: relay head1:8023 is also listed in nodes"),
    (f'{RELAYS}[[relay]]\naddress = "head2:8023"\nnodes = "head1:8023,node[257-512]:8022"\n',
     "relay[2].nodes: relay head1:8023 is also under relay head2:8023"),
    (f'{RELAYS}[[relay]]\naddress = "head1:8023"\nnodes = "node[257-512]:8022"\n', "relay[2].address: relay head1:8023 is listed twice"),
    ('[[relay]]\naddress = "head1:8023"\nnodes = 17\n', "relay[1].nodes: expected a hostlist string or a list of them"),
    ('[[relay]]\naddress = "head1:8023"\nhosts = "node[017-512]:8022"\n', "relay[1]: unknown key 'hosts' (known keys: address, nodes)"),
    ('[[relay]]\nnodes = "node[017-512]:8022"\n', "relay[1]: no 'address': expected HOST:PORT"),
], ids=["bad-address", "bad-hostlist", "under-two-relays", "direct-and-relayed", "relay-is-a-node",
        "relay-under-a-relay", "relay-twice", "wrong-type", "unknown-key", "no-address"])
def test_a_bad_relay_table_is_one_line_naming_the_file_and_the_key_and_exit_2(keys, tmp_path, capsys, body, says) -> None:
    from gridwatch.console.cli import main

    path = relay_toml(tmp_path, keys, body)
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert str(err.value).startswith(f"{path}: {says}"), err.value
    # Through the command, as an operator meets it.
    assert main(["console", "--headless", "--cluster", str(path)]) == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and "Traceback" not in stderr and f"{path}: {says}" in stderr, stderr


def _console_args(*argv: str):  # noqa: ANN202
    from gridwatch.console.cli import build_parser

    return build_parser().parse_args(["console", "--headless", *argv])


def test_relay_on_the_command_line_means_a_relay_table_and_replaces_the_files(keys, tmp_path) -> None:
    from gridwatch.console.cli.ui import runtime_options
    from gridwatch.sshlink.hostlist import Endpoint

    db = str(tmp_path / "incidents.db")
    options = runtime_options(_console_args("--nodes", "node[001-016]:8022", "--key", str(keys.operator_key),
                                            "--known-hosts", str(keys.known_hosts), "--db", db,
                                            "--relay", "head1:8023=node[017-256]:8022",
                                            "--relay", " head2:8023 = node[257-512]:8022"))
    assert options.endpoints == _eps("node[001-016]:8022")
    assert options.relays == {Endpoint("head1", 8023): _eps("node[017-256]:8022"),
                              Endpoint("head2", 8023): _eps("node[257-512]:8022")}
    path = relay_toml(tmp_path, keys, f'nodes = "node[001-016]:8022"\n{RELAYS}')
    assert list(runtime_options(_console_args("--cluster", str(path))).relays) == [Endpoint("head1", 8023)]
    flag = runtime_options(_console_args("--cluster", str(path), "--relay", "head9:8023=node[017-512]:8022"))
    assert list(flag.relays) == [Endpoint("head9", 8023)] and len(flag.relays[Endpoint("head9", 8023)]) == 496


@pytest.mark.parametrize("argv, says", [
    (["--relay", "head1:8023"], "--relay: expected ADDRESS=HOSTLIST, e.g. head1:8023=node[017-512]:8022, got 'head1:8023'"),
    (["--relay", "head1=node[017-512]:8022"], "--relay head1=node[017-512]:8022: expected HOST:PORT of a gridwatch relay"),
    (["--relay", "head1:8023=node[017-5x]:8022"], "--relay head1:8023=node[017-5x]:8022: bad range '017-5x'"),
    (["--nodes", "node[001-017]:8022", "--relay", "head1:8023=node[017-512]:8022"],
     "--relay head1:8023=node[017-512]:8022: node017:8022 is listed in nodes and under relay head1:8023"),
    (["--relay", "head1:8023=node[017-256]:8022", "--relay", "head2:8023=node[256-512]:8022"],
     "--relay head2:8023=node[256-512]:8022: node256:8022 is under relay head1:8023 and relay head2:8023"),
], ids=["no-equals", "bad-address", "bad-hostlist", "direct-and-relayed", "under-two-relays"])
def test_a_bad_relay_flag_is_one_line_and_exit_2(keys, tmp_path, capsys, argv, says) -> None:
    from gridwatch.console.cli import main

    common = ["--key", str(keys.operator_key), "--known-hosts", str(keys.known_hosts), "--db", str(tmp_path / "i.db")]
    assert main(["console", "--headless", *argv, *common]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith(f"gridwatch console: {says}") and stderr.count("\n") == 1, stderr


def test_a_console_with_relays_counts_their_nodes_and_a_bad_relay_is_exit_2(keys, tmp_path) -> None:
    # Nothing listens at these ports: the console starts, lists every node and says the cadence of all of them.
    direct, relay = free_port(), free_port()
    common = ["--key", str(keys.operator_key), "--known-hosts", str(keys.known_hosts), "--db", str(tmp_path / "i.db")]
    res = gridwatch("console", "--headless", "--nodes", f"127.0.0.1:{direct}", *common, "--duration", "0.2",
                    "--relay", f"127.0.0.1:{relay}=10.0.[0-1].[1-250]:8022,10.0.2.[1-249]:8022")
    assert res.returncode == 0, res.stderr
    assert "console: 750 nodes" in res.stdout, res.stdout
    # "auto" by the whole fleet: 750 nodes / 250 a second; the direct node alone would get one per sample.
    assert "summaries every 3 s from 750 nodes" in res.stdout, res.stdout
    res = gridwatch("console", "--headless", *common, "--relay", "head1")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
    assert "--relay: expected ADDRESS=HOSTLIST" in res.stderr
