"""Bad luck and hostile peers around the console's runtime: restarts, clocks, full and corrupted databases, keys."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import asyncssh
import pytest

from tests.conftest import PYTHON, ROOT, start_agent, stop_agent, wait_until
from tests.hostile_peer import hostile_peer

ESC = "\x1b"


def run_cli(*args: str, umask: int | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "gridwatch", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)


async def run_cli_async(*args: str, stdin: int | None = subprocess.DEVNULL) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(PYTHON, "-m", "gridwatch", *args, cwd=ROOT, stdin=stdin,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _runtime(ra, keys, db: Path, **extra):
    from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
    from gridwatch.sshlink.hostlist import Endpoint

    return build_runtime(RuntimeOptions(endpoints=[Endpoint("127.0.0.1", ra.port)], key_path=str(keys.operator_key),
                                        known_hosts=str(keys.known_hosts), db_path=str(db), **extra))


def _plan(node: str, steps: list[str], at: float = 1000.0, iid: str = "test-isolate:node-1:1000"):
    from gridwatch.playbooks.plans import Incident, Plan, PlannedStep

    incident = Incident(id=iid, playbook=iid.split(":")[0], kind="xid", severity="critical", scope="node",
                        node=node, opened_at=at, last_seen_at=at, summary="xid 79 on node-1")
    return Plan(incident=incident, steps=[
        PlannedStep(id=f"{iid}/{i}", incident=iid, playbook=incident.playbook, index=i, step=step, target=node,
                    nodes=[node], at=at, timeout=10.0) for i, step in enumerate(steps)])


# ------------------------------------------------------------------ item 8: resume after a restart


async def test_a_restarted_console_finishes_the_plan_it_left_once_its_links_are_up(keys, tmp_path):
    from gridwatch.playbooks.store import IncidentStore

    db = tmp_path / "incidents.db"
    store = IncidentStore(db)
    plan = _plan("node-1", ["isolate_node"])
    store.save_plan(plan)
    store.close()
    ra = await start_agent(keys)
    runtime = _runtime(ra, keys, db)
    # Configured to act, with no agent heard yet: that is not read-only.
    assert runtime.read_only is False
    try:
        await runtime.start()
        await wait_until(lambda: runtime.plan_store.steps(plan.incident.id)[0].state in ("done", "failed"),
                         timeout=20, what="the resumed step to run")
        step = runtime.plan_store.steps(plan.incident.id)[0]
        assert step.state == "done", step.outcome
        assert "read-only" not in step.outcome
        assert ra.agent.isolated
    finally:
        await runtime.stop()
        await stop_agent(ra)


async def test_a_console_configured_read_only_resumes_nothing(keys, tmp_path):
    from gridwatch.playbooks.store import IncidentStore

    db = tmp_path / "incidents.db"
    store = IncidentStore(db)
    plan = _plan("node-1", ["isolate_node"])
    store.save_plan(plan)
    store.close()
    ra = await start_agent(keys)
    runtime = _runtime(ra, keys, db, read_only=True)
    assert runtime.read_only is True
    try:
        await runtime.start()
        await wait_until(lambda: runtime.store.nodes and any(n.role for n in runtime.store.nodes.values()),
                         what="the agent's hello")
        assert runtime.plan_store.steps(plan.incident.id)[0].state == "planned"
        assert not ra.agent.isolated
    finally:
        await runtime.stop()
        await stop_agent(ra)


# ------------------------------------------------------------------ item 9: ids from the event


def _frames(boot: str = "b00t1d") -> list:
    from gridwatch.wire.protocol import Event, Hello, Sample, Text, TrainerStatus

    out = []
    for i, name in enumerate(("node-1", "node-2", "node-3", "node-4"), start=1):
        out.append((f"10.0.0.{i}:8022", Hello(node=Text(name), ts=5000.0, seq=1, boot_id=Text(f"{boot}{i}"))))
        out.append((f"10.0.0.{i}:8022", Sample(node=Text(name), ts=5000.5, seq=2,
                                               trainer=TrainerStatus(job=Text("llm"), step=10))))
    out.append(("10.0.0.3:8022", Event(node=Text("node-3"), kind=Text("xid"), code=79, gpu=2, ts=5001.25, seq=3,
                                      severity=Text("critical"), message=Text("GPU has fallen off the bus"))))
    return out


def _ids(clock_start: float, stall_after: int | None = None, boot: str = "b00t1d") -> list[str]:
    from gridwatch.playbooks.clock import ManualClock
    from gridwatch.playbooks.engine import Engine
    from gridwatch.playbooks.loader import load_builtin

    clock = ManualClock(clock_start)
    engine = Engine(load_builtin(), clock)
    for n, (source, frame) in enumerate(_frames(boot)):
        if stall_after is not None and n == stall_after:
            clock.advance(3.0)  # the console stalled; the frames still carry their own times
        engine.observe(source, frame)
        clock.advance(0.1)
    # node-4 then goes quiet: its heartbeat is lost, seen by each console at its own time.
    for source, frame in _frames(boot)[:6]:
        engine.observe(source, frame)
    clock.advance(30.0)
    engine.tick()
    return sorted(i.id for i in engine.incidents(include_closed=True))


def test_two_consoles_on_different_clocks_name_one_fault_alike():
    first = _ids(1_700_000_000.0)
    other = _ids(1_700_000_437.6)
    stalled = _ids(1_700_000_000.0, stall_after=4)
    assert any(i.startswith("xid-hardware:node-3:") for i in first)
    assert first == other == stalled
    assert all("1700000" not in i for i in first)  # nothing of the consoles' clocks is in them
    # A new agent run (a new boot id) sending the same times is a different frame, so a different incident.
    assert _ids(1_700_000_000.0, boot="other") != first


# ------------------------------------------------------------------ item 13: a full disk


@contextlib.contextmanager
def _tiny_filesystem(tmp_path: Path) -> Iterator[Path | None]:
    """A 512 KB tmpfs (CI runs as root), or None where mounting is not allowed."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


async def test_a_full_disk_under_the_incident_database_still_acts_tells_the_operator_and_writes_later(keys, tmp_path):
    from loguru import logger

    from gridwatch.playbooks.engine import Engine
    from gridwatch.playbooks.schema import check_text

    books, errors = check_text("name: bus\nseverity: critical\ntrigger: {event: xid, match: {code: [79]}}\n"
                               "plan: [isolate_node, notify]\n", "t.yaml")
    assert not errors
    heard: list[str] = []
    sink = logger.add(lambda m: heard.append(str(m)), level="WARNING")
    ra = await start_agent(keys)
    with _tiny_filesystem(tmp_path) as tiny:
        db = (tiny or tmp_path) / "incidents.db"
        runtime = _runtime(ra, keys, db)
        runtime.engine = Engine(books, runtime.store.clock)
        store = runtime.plan_store
        try:
            await runtime.start()
            await wait_until(lambda: any(n.role == "operator" for n in runtime.store.nodes.values()), what="hello")
            if tiny is not None:
                filler = _fill(tiny)
            else:
                # No tmpfs here: SQLite's own page limit makes the same SQLITE_FULL on the real file.
                pages = store._db.execute("PRAGMA page_count").fetchone()[0]
                store._db.execute(f"PRAGMA max_page_count={pages}")
            ra.agent.event("xid", "GPU has fallen off the bus", severity="critical", gpu=0, code=79)
            await wait_until(lambda: ra.agent.isolated, timeout=20, what="the plan to act on the node")
            assert runtime.alert and "cannot be written" in runtime.alert
            await wait_until(lambda: any("not yet recorded" in line for line in heard), what="the notifier told")
            (iid,) = [r.id for r in store.incidents()]
            await wait_until(lambda: [s.state for s in store.steps(iid)] == ["done", "done"], what="the plan done")
            assert store.held > 0
            # Space comes back: the held records land, in order, and the alert clears.
            if tiny is not None:
                filler.unlink()
            else:
                store._db.execute("PRAGMA max_page_count=1073741823")
            runtime.retry_store(force=True)
            assert store.held == 0 and runtime.alert is None
            check = sqlite3.connect(db)
            try:
                assert check.execute("SELECT id FROM incidents").fetchall() == [(iid,)]
                assert [r[0] for r in check.execute("SELECT state FROM steps ORDER BY idx")] == ["done", "done"]
                assert check.execute("SELECT count(*) FROM audit WHERE incident=?", (iid,)).fetchone()[0] >= 4
            finally:
                check.close()
        finally:
            logger.remove(sink)
            await runtime.stop()
            store.close()
            await stop_agent(ra)


# ------------------------------------------------------------------ item 14: a corrupted database


def _seeded_db(path: Path) -> list[str]:
    from gridwatch.playbooks.store import IncidentStore

    store = IncidentStore(path)
    ids = []
    for n in range(3):
        plan = _plan("node-1", ["notify"], at=2_000_000_000.0 + n, iid=f"xid-hardware:node-1:{n}")
        store.save_plan(plan)
        ids.append(plan.incident.id)
    store.close()
    return ids


def test_bad_rows_are_skipped_and_named_and_the_console_still_starts(keys, tmp_path):
    from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
    from gridwatch.sshlink.hostlist import Endpoint

    db = tmp_path / "incidents.db"
    good, bad_json, bad_type = _seeded_db(db)
    raw = sqlite3.connect(db)
    raw.execute("UPDATE incidents SET incident_json = 'not json' WHERE id = ?", (bad_json,))
    raw.execute("UPDATE incidents SET detected_at = 'yesterday', symptoms = 'many' WHERE id = ?", (bad_type,))
    raw.execute("UPDATE steps SET planned_json = '{\"id\": 5}' WHERE incident = ?", (good,))
    raw.commit()
    raw.close()
    runtime = build_runtime(RuntimeOptions(endpoints=[Endpoint("127.0.0.1", 1)], key_path=str(keys.operator_key),
                                           known_hosts=str(keys.known_hosts), db_path=str(db)))
    store = runtime.plan_store
    listed = [row.id for row in runtime.incidents.incidents()]
    assert good in listed and bad_type not in listed
    assert store.steps(good) == []  # its one step is unreadable: skipped, not a crash
    notes = "\n".join(store.bad_rows)
    assert str(db) in notes and "incidents row" in notes and "steps row" in notes
    assert runtime.alert and "unreadable rows" in runtime.alert
    store.close()


def test_a_foreign_or_newer_database_is_one_line_and_exit_2(keys, tmp_path):
    foreign = tmp_path / "foreign.db"
    raw = sqlite3.connect(foreign)
    raw.execute("CREATE TABLE photos (id INTEGER, jpeg BLOB)")
    raw.commit()
    raw.close()
    newer = tmp_path / "newer.db"
    _seeded_db(newer)
    raw = sqlite3.connect(newer)
    raw.execute("PRAGMA user_version = 99")
    raw.close()
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not sqlite at all" * 100)
    for db, words in ((foreign, "not an incident database"), (newer, "newer gridwatch"),
                      (garbage, "not an incident database")):
        out = run_cli("console", "--headless", "--nodes", "127.0.0.1:1", "--key", str(keys.operator_key),
                      "--known-hosts", str(keys.known_hosts), "--db", str(db), "--duration", "1")
        assert out.returncode == 2, out.stderr
        assert words in out.stderr and str(db) in out.stderr
        assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr


def test_the_incident_database_is_private_even_under_umask_000(tmp_path):
    from gridwatch.playbooks.store import IncidentStore

    old = os.umask(0)
    try:
        store = IncidentStore(tmp_path / "incidents.db")
        store.audit("alice", "acknowledge", "testing")
        files = sorted(tmp_path.glob("incidents.db*"))
        assert {f.name for f in files} >= {"incidents.db", "incidents.db-wal"}
        assert all(_mode(f) == 0o600 for f in files), [(f.name, oct(_mode(f))) for f in files]
        store.close()
    finally:
        os.umask(old)
    loose = tmp_path / "loose.db"
    _seeded_db(loose)
    os.chmod(loose, 0o644)
    IncidentStore(loose).close()
    assert _mode(loose) == 0o600


# ------------------------------------------------------------------ items 16, 18, 19: keys


def test_keys_init_force_under_umask_000_sets_every_mode(tmp_path):
    k = tmp_path / "k"
    k.mkdir(mode=0o777)
    os.chmod(k, 0o777)
    (k / "viewer_key").write_text("old")
    os.chmod(k / "viewer_key", 0o666)
    out = run_cli("keys", "init", "--force", str(k), umask=0)
    assert out.returncode == 0, out.stderr
    assert _mode(k) & 0o022 == 0
    for name in ("viewer_key", "operator_key"):
        assert _mode(k / name) == 0o600, name
        assert _mode(k / f"{name}.pub") == 0o644, name
    for name in ("authorized_viewers", "authorized_operators", "known_hosts"):
        assert _mode(k / name) == 0o644, name
    assert not list(k.glob(".*")), "no temp file left behind"


def test_keys_init_makes_no_shared_host_key_unless_asked(tmp_path):
    out = run_cli("keys", "init", str(tmp_path / "k"))
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "k" / "agent_host_key").exists()
    assert not [line for line in (tmp_path / "k" / "known_hosts").read_text().splitlines()
                if line and not line.startswith("#")]
    assert "keys trust" in out.stdout
    shared = run_cli("keys", "init", "--shared-host-key", str(tmp_path / "s"))
    assert shared.returncode == 0, shared.stderr
    assert (tmp_path / "s" / "known_hosts").read_text().splitlines()[-1].startswith("* ssh-ed25519 ")
    assert _mode(tmp_path / "s" / "agent_host_key") == 0o600
    assert "pose as" in shared.stderr
    help_text = run_cli("keys", "init", "--help").stdout
    assert "--shared-host-key" in help_text and "pose as every node" in " ".join(help_text.split())


async def _own_key_agent(keys, host_key: Path, name: str):
    from gridwatch.agent.agent import Agent
    from gridwatch.agent.config import AgentConfig
    from gridwatch.agent.server import serve

    config = AgentConfig(node_name=name, listen="127.0.0.1:0", host_key=str(host_key),
                         authorized_viewers=str(keys.authorized_viewers),
                         authorized_operators=str(keys.authorized_operators), interval=0.1)
    agent = Agent(config, gpus=None)
    acceptor = await serve(agent, "127.0.0.1", 0)
    return agent, acceptor, acceptor.sockets[0].getsockname()[1]


async def test_each_agent_makes_its_own_host_key_and_keys_trust_pins_it(keys, tmp_path):
    from loguru import logger

    logs: list[str] = []
    sink = logger.add(lambda m: logs.append(str(m)), level="INFO")
    one_key, two_key = tmp_path / "n1" / "host_key", tmp_path / "n2" / "host_key"
    a1, acc1, port1 = await _own_key_agent(keys, one_key, "node-1")
    a2, acc2, port2 = await _own_key_agent(keys, two_key, "node-2")
    try:
        assert _mode(one_key) == 0o600 and _mode(one_key.parent) == 0o700
        fp1 = asyncssh.read_private_key(str(one_key)).get_fingerprint()
        fp2 = asyncssh.read_private_key(str(two_key)).get_fingerprint()
        assert fp1 != fp2
        assert any(fp1 in line for line in logs), "the new key's fingerprint is logged"
        known = tmp_path / "known_hosts"
        rc, out, err = await run_cli_async("keys", "trust", f"127.0.0.1:{port1},127.0.0.1:{port2}",
                                           "--known-hosts", str(known), "--yes")
        assert rc == 0, err
        assert fp1 in out and fp2 in out
        lines = known.read_text().splitlines()
        assert f"[127.0.0.1]:{port1} ssh-ed25519" in "\n".join(lines) and not any(l.startswith("*") for l in lines)
        assert _mode(known) == 0o644
    finally:
        logger.remove(sink)
        acc1.close()
        acc2.close()


async def test_keys_trust_says_loudly_when_a_host_key_changed_and_replaces_it_only_when_told(keys, tmp_path):
    from gridwatch.sshlink.keys import known_hosts_entry

    a, acc, port = await _own_key_agent(keys, tmp_path / "n1" / "host_key", "node-1")
    try:
        known = tmp_path / "known_hosts"
        old = asyncssh.generate_private_key("ssh-ed25519")
        known.write_text(known_hosts_entry("127.0.0.1", port, old))
        new_fp = asyncssh.read_private_key(str(tmp_path / "n1" / "host_key")).get_fingerprint()
        rc, out, err = await run_cli_async("keys", "trust", f"127.0.0.1:{port}", "--known-hosts", str(known))
        assert rc == 1
        assert "DIFFERENT HOST KEY" in err and old.get_fingerprint() in err and new_fp in err
        assert known.read_text() == known_hosts_entry("127.0.0.1", port, old)  # unchanged without a yes
        rc, out, err = await run_cli_async("keys", "trust", f"127.0.0.1:{port}", "--known-hosts", str(known), "--yes")
        assert rc == 0, err
        assert "DIFFERENT HOST KEY" in err and "replaced" in out
        text = known.read_text()
        assert old.export_public_key("openssh").decode().split()[1] not in text
        assert text.count(f"[127.0.0.1]:{port} ") == 1
    finally:
        acc.close()


async def test_keys_trust_refuses_a_weak_or_sha1_only_host_key(tmp_path):
    weak = asyncssh.generate_private_key("ssh-rsa", key_size=1024)
    servers = [
        await asyncssh.create_server(asyncssh.SSHServer, "127.0.0.1", 0, server_host_keys=[weak]),
        await asyncssh.create_server(asyncssh.SSHServer, "127.0.0.1", 0,
                                     server_host_keys=[asyncssh.generate_private_key("ssh-ed25519")],
                                     kex_algs=["diffie-hellman-group14-sha1"]),
    ]
    try:
        ports = [s.sockets[0].getsockname()[1] for s in servers]
        known = tmp_path / "known_hosts"
        rc, out, err = await run_cli_async("keys", "trust", f"127.0.0.1:{ports[0]}", "--known-hosts", str(known),
                                           "--yes")
        assert rc == 1 and "1024-bit RSA" in err and "not trusted" in err, err
        rc, out, err = await run_cli_async("keys", "trust", f"127.0.0.1:{ports[1]}", "--known-hosts", str(known),
                                           "--yes")
        assert rc == 1 and "cannot fetch host key" in err, err
        assert not known.exists() or known.read_text() == ""
    finally:
        for s in servers:
            s.close()


# ------------------------------------------------------------------ item 5: escapes in SSH error reasons


async def test_a_hostile_peers_disconnect_reason_reaches_no_terminal_raw(keys, tmp_path):
    with hostile_peer() as peer:
        outputs = []
        rc, out, err = await run_cli_async("keys", "trust", peer.spec, "--known-hosts", str(tmp_path / "kh"), "--yes")
        assert rc == 1 and "cannot fetch host key" in err
        outputs.append(out + err)
        rc, out, err = await run_cli_async("tail", "--nodes", peer.spec, "--key", str(keys.viewer_key),
                                           "--known-hosts", str(keys.known_hosts), "--duration", "2")
        outputs.append(out + err)
        rc, out, err = await run_cli_async("console", "--headless", "--nodes", peer.spec, "--key",
                                           str(keys.operator_key), "--known-hosts", str(keys.known_hosts),
                                           "--db", str(tmp_path / "i.db"), "--duration", "3")
        outputs.append(out + err)
        assert peer.connections >= 3
    for text in outputs:
        assert "go away" in text  # the reason is shown ...
        assert ESC not in text and "\x07" not in text  # ... without its escapes


# ------------------------------------------------------------------ Low: the demo's pointer file


def test_the_demo_pointer_never_follows_a_planted_link_nor_reads_anothers(tmp_path, monkeypatch):
    from gridwatch.console.demo import state as demo_state

    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime_dir))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    pointer = demo_state.pointer_path()
    assert pointer.parent == runtime_dir
    pointer.symlink_to(victim)
    demo_dir = tmp_path / "demo"
    demo_dir.mkdir()
    st = demo_state.DemoState(dir=str(demo_dir), pid=os.getpid(), operator_key="k", viewer_key="v", known_hosts="h")
    demo_state.write_state(st)
    assert victim.read_text() == "precious"
    assert not pointer.is_symlink() and pointer.read_text() == str(demo_dir.resolve())
    assert demo_state.read_state().dir == str(demo_dir)
    if os.geteuid() != 0:
        pytest.skip("reading a pointer another user owns needs root to make one")
    import pwd

    os.chown(pointer, pwd.getpwnam("nobody").pw_uid, -1)
    with pytest.raises(demo_state.DemoNotFound, match="not a file of this user"):
        demo_state.read_state()


def test_the_demo_pointer_folder_in_tmp_must_be_ours(tmp_path, monkeypatch):
    from gridwatch.console.demo import state as demo_state

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(demo_state.tempfile, "gettempdir", lambda: str(tmp_path))
    planted = tmp_path / f"gridwatch-{os.getuid()}"
    planted.symlink_to(tmp_path)  # someone else's link where our folder should be
    with pytest.raises(OSError, match="not a private directory"):
        demo_state.pointer_path()


async def test_a_headless_console_prints_its_alert_on_stderr(capsys):
    from gridwatch.console.cli.ui import _headless
    from gridwatch.console.runtime.core import ConsoleRuntime

    runtime = ConsoleRuntime()
    runtime.set_alert("the incident database /x cannot be written (database or disk is full)")
    assert await _headless(runtime, 1.2) == 0
    err = capsys.readouterr().err
    assert "ALERT: the incident database /x cannot be written" in err
