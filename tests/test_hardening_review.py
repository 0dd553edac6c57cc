"""Holes a review found in the hardening, each tried as the attack: the run's config, a fake trainer, impostor names, greedy viewers, a planted database."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
from pathlib import Path

import asyncssh
import msgspec
import pytest

from gridwatch.agent.agent import Agent
from gridwatch.agent.clients import MAX_REPLY_BYTES
from gridwatch.agent.config import AgentConfig
from gridwatch.agent.logs import LogTailer
from gridwatch.agent.trainer_link import TrainerLink
from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine
from gridwatch.sshlink.client import Fleet, FleetOptions, LinkState, hello_name_refusal
from gridwatch.sshlink.hostlist import Endpoint
from gridwatch.sshlink.server import Caller
from gridwatch.trainer.checkpoint import write_checkpoint
from gridwatch.trainer.config import CONFIG_NAME, ConfigRefused, TrainConfig, read_config, release_tier0
from gridwatch.trainer.launch import LaunchError, prepare
from gridwatch.wire import protocol as p
from gridwatch.wire.control import ControlReply, encode_reply
from gridwatch.wire.controlsock import TrainerUnavailable, read_status
from gridwatch.wire.protocol import Event, Hello, Sample, Text, TrainerStatus
from tests.conftest import PYTHON, ROOT, start_agent, stop_agent, wait_until
from tests.support_hardening import NOBODY, as_nobody, as_root, finished, make_manifest, state
from tests.support_stream import make_fleet

VIEWER = Caller(username="v", role="viewer", key="SHA256:viewer")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ------------------------------------------------- 1: the run's config decides what is deleted


def test_the_run_dir_and_its_config_are_private_under_umask_002(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        cfg = prepare(TrainConfig(run_dir=str(tmp_path / "run")), resume=False)
    finally:
        os.umask(old)
    try:
        run = Path(cfg.run_dir)
        assert mode(run) == 0o700, f"run dir is {mode(run):o}"
        assert mode(run / CONFIG_NAME) == 0o600, f"config.json is {mode(run / CONFIG_NAME):o}"
        assert mode(run / "logs") == 0o700 and mode(run / "shared") == 0o700
        assert read_config(run).tier0_key == cfg.tier0_key
    finally:
        release_tier0(cfg)


@as_root
def test_with_a_control_group_the_run_dir_lets_the_group_through_to_its_sockets_and_no_further(tmp_path: Path) -> None:
    import grp

    old = os.umask(0o002)
    try:
        cfg = prepare(TrainConfig(run_dir=str(tmp_path / "run"), control_group=grp.getgrgid(NOBODY).gr_name), resume=False)
    finally:
        os.umask(old)
    try:
        st = os.stat(cfg.run_dir)
        assert stat.S_IMODE(st.st_mode) == 0o710 and st.st_gid == NOBODY
        assert mode(Path(cfg.run_dir) / CONFIG_NAME) == 0o600
    finally:
        release_tier0(cfg)


@as_root
def test_a_config_rewritten_by_another_user_is_refused_and_deletes_nothing(open_dir: Path) -> None:
    run = open_dir / "run"
    cfg = prepare(TrainConfig(run_dir=str(run)), resume=False)
    victim = open_dir / "home-trainer"  # one of this user's private directories
    victim.mkdir(mode=0o700)
    (victim / "thesis.tex").write_text("years of work")
    try:
        run.chmod(0o777)  # what umask 002 and a shared group used to give the run directory

        forged = msgspec.json.encode(TrainConfig(run_dir=str(run), tier0_dir=str(victim), control_group="nogroup",
                                                 fault_nan_step=3))

        def rewrite() -> None:
            (run / "config.new").write_bytes(forged)
            os.rename(run / "config.new", run / CONFIG_NAME)

        as_nobody(rewrite)  # type: ignore[arg-type]
        assert (run / CONFIG_NAME).stat().st_uid == NOBODY

        with pytest.raises(LaunchError, match=r"run directory .* is writable by group or others \(mode 0777\)"):
            prepare(TrainConfig(run_dir=str(run)), resume=False)  # the next run in that directory
        with pytest.raises(ConfigRefused, match="writable by group or others"):
            read_config(run)  # what every worker reads at start
        assert (victim / "thesis.tex").exists()

        run.chmod(0o700)  # the directory put right: the file in it is still the other user's
        with pytest.raises(ConfigRefused, match=f"owned by uid {NOBODY}") as refused:
            read_config(run)
        assert "\n" not in str(refused.value)
        for resume in (True, False):
            with pytest.raises(LaunchError, match=f"owned by uid {NOBODY}"):
                prepare(TrainConfig(run_dir=str(run)), resume=resume)
        assert (victim / "thesis.tex").read_text() == "years of work", "nothing of this user's was removed"
    finally:
        release_tier0(cfg)


def test_a_finished_run_removes_only_its_checkpoints_from_a_configured_tier0_dir(tmp_path: Path) -> None:
    home = tmp_path / "home"  # a configured tier0_dir that holds more than tier 0
    home.mkdir(mode=0o700)
    (home / "notes.txt").write_text("mine")
    (home / "projects").mkdir(mode=0o700)
    (home / "projects" / "plan.md").write_text("mine too")
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), tier0_dir=str(home), steps=20)
    Path(cfg.run_dir).mkdir(mode=0o700)
    for node in ("node-1", "node-2"):
        write_checkpoint(cfg.tier_root(0, node), state(1), make_manifest(10, tier=0))

    assert release_tier0(cfg, "node-2") == []  # what node-2's worker does when the run is done
    assert not (home / "node-2").exists() and (home / "node-1" / "step-00000010").is_dir()
    assert finished(cfg, 20).wait(30) == 0  # the launcher, at the end of the run
    assert not (home / "node-1").exists(), "the run's checkpoints are given back"
    assert (home / "notes.txt").read_text() == "mine" and (home / "projects" / "plan.md").read_text() == "mine too"


def test_a_tier0_key_that_climbs_out_of_its_base_is_not_a_valid_config(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    fd = os.open(run / CONFIG_NAME, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, json.dumps({"run_dir": str(run), "tier0_key": "../../../root"}).encode())
    os.close(fd)
    with pytest.raises(ValueError, match="not a valid run config"):
        read_config(run)


# --------------------------------------------------------- 2: a socket posing as the trainer


def _fake_trainer(path: Path, ready: int) -> None:  # pragma: no cover - runs in the forked child
    """As nobody: serve ``path`` and answer every request with a made-up status."""
    os.setgroups([NOBODY])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    os.write(ready, b"r")
    fake = encode_reply(ControlReply(ok=True, status=TrainerStatus(phase=Text("training"), step=999, node=Text("node-1"))))
    while True:
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.sendall(fake)
        conn.close()


@as_root
def test_a_socket_served_by_another_user_is_never_taken_for_the_trainer(open_dir: Path) -> None:
    control = open_dir / "control"
    control.mkdir()
    os.chown(control, NOBODY, NOBODY)
    path = control / "node-1.sock"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            _fake_trainer(path, w)
        finally:
            os._exit(1)
    os.close(w)
    try:
        assert os.read(r, 1) == b"r", "the fake trainer did not start"
        with pytest.raises(TrainerUnavailable, match=f"served by uid {NOBODY}, not by this user or root") as refused:
            asyncio.run(read_status(str(path)))
        assert "\n" not in str(refused.value)
        answer = asyncio.run(TrainerLink(str(path)).control("pause", {}))  # what the agent relays
        assert answer["ok"] is False and f"served by uid {NOBODY}" in answer["error"]
    finally:
        os.close(r)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


# ------------------------------------------------------------ 3: who may say hello as whom


def test_a_hello_name_is_plain_and_bound_to_a_host_name_endpoint() -> None:
    by_name = Endpoint("node001.cluster", 8022)
    assert hello_name_refusal(by_name, "node001") == ""
    assert hello_name_refusal(by_name, "node001.cluster") == ""
    assert hello_name_refusal(by_name, "NODE001") == ""
    assert "is the host node001.cluster" in hello_name_refusal(by_name, "node-1")
    assert hello_name_refusal(Endpoint("10.0.0.5", 8022), "node-1") == "", "by address: the first hello pins the name"
    assert hello_name_refusal(Endpoint("[fd00::5]", 8022), "node-1") == ""
    for bad in ("nöde-1", "node 1", "-node", "a/b", "x" * 254, ""):
        assert "not a plain node name" in hello_name_refusal(Endpoint("10.0.0.5", 8022), bad), bad


def _fleet(endpoints: list[Endpoint], keys: object) -> tuple[Fleet, list[tuple[Endpoint, p.Frame]]]:
    frames: list[tuple[Endpoint, p.Frame]] = []
    fleet = Fleet(endpoints, FleetOptions(key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts),  # type: ignore[attr-defined]
                                          backoff_min=0.05, backoff_max=0.3),
                  on_frame=lambda link, f: frames.append((link.endpoint, f)))
    return fleet, frames


async def test_an_agent_reached_by_host_name_cannot_say_hello_as_another_node(keys) -> None:
    impostor = await start_agent(keys, name="node-1")
    honest = await start_agent(keys, name="localhost")
    odd = await start_agent(keys, name="nöde-1")
    bad_ep, good_ep, odd_ep = Endpoint("localhost", impostor.port), Endpoint("localhost", honest.port), Endpoint("127.0.0.1", odd.port)
    fleet, frames = _fleet([bad_ep, good_ep, odd_ep], keys)
    await fleet.start()
    try:
        bad, good, strange = fleet.links[bad_ep], fleet.links[good_ep], fleet.links[odd_ep]
        await wait_until(lambda: bad.state == LinkState.REFUSED and strange.state == LinkState.REFUSED
                         and good.state == LinkState.CONNECTED, what="the impostors refused, the honest node linked")
        assert "says it is 'node-1', but this endpoint is the host localhost" in (bad.last_error or "")
        assert "not a plain node name" in (strange.last_error or "")
        assert fleet.find("node-1") is None and bad.hello is None and strange.hello is None
        assert {ep for ep, _ in frames} == {good_ep}
    finally:
        await fleet.stop()
        for ra in (impostor, honest, odd):
            await stop_agent(ra)


def _straggler(engine: Engine, reporter: str, slow: str, step: int) -> list:
    return engine.observe(reporter, Event(node=reporter, kind="straggler", severity="warning", source="trainer",
                                          message=f"rank 0 ({slow}) took 2.4 s for step {step}",
                                          details={"rank": "0", "node": slow, "step": str(step)}))


def _job(engine: Engine, clock: ManualClock, nodes: list[str], members: dict[str, list[str]] | None = None) -> None:
    for name in nodes:
        said = [Text(m) for m in (members or {}).get(name, [])]
        engine.observe(name, Hello(node=name, ts=clock.now(), interval=10.0))
        engine.observe(name, Sample(node=name, ts=clock.now(), trainer=TrainerStatus(job="llm", step=10, membership=said)))


def test_one_agent_alone_cannot_get_a_healthy_node_blamed_as_a_straggler() -> None:
    from gridwatch.playbooks.loader import load_builtin

    clock = ManualClock(0.0)
    engine = Engine(load_builtin(), clock)
    nodes = ["node1", "node2", "node3", "node4"]
    _job(engine, clock, nodes)
    plans = []
    for step in range(100, 130):  # every step for five minutes, from node3 alone
        clock.advance(10.0)
        for name in nodes:
            engine.observe(name, Sample(node=name))
        plans += _straggler(engine, "node3", "node1", step)
    assert plans == [] and engine.incidents() == []


def test_nodes_never_blame_a_node_outside_their_own_job_and_the_job_still_can() -> None:
    from gridwatch.playbooks.loader import load_builtin

    clock = ManualClock(0.0)
    engine = Engine(load_builtin(), clock)
    nodes = ["node1", "node2", "node3", "node4"]
    job = {"node2": ["node2", "node3"], "node3": ["node2", "node3"]}  # node1 is no member of their job
    _job(engine, clock, nodes, job)
    plans = []
    for step in range(100, 130):
        clock.advance(10.0)
        plans += _straggler(engine, "node2", "node1", step) + _straggler(engine, "node3", "node1", step)
    assert plans == [] and engine.incidents() == []

    everyone = {n: nodes for n in nodes}
    _job(engine, clock, nodes, everyone)
    for step in range(200, 220):  # the whole job reports node4 slow: that counts
        clock.advance(10.0)
        for name in nodes:
            plans += _straggler(engine, name, "node4", step)
    assert [(pl.incident.playbook, pl.incident.node) for pl in plans] == [("straggler-persistent", "node4")]


# ------------------------------------------------------------- 4: a viewer's greed


def test_replies_waiting_are_capped_in_bytes_and_the_session_is_closed_with_a_reason() -> None:
    agent = Agent(AgentConfig(node_name="node-1"))
    closed: list[bytes] = []
    client = agent.connect(VIEWER, close=closed.append)
    lines = [p.LogLine(source=p.Text("app"), line=p.Text("y" * 4000)) for _ in range(250)]
    big = agent.reply_frame(p.SearchResult(id=p.Text("s"), lines=lines))  # about 1 MB: a search answer
    accepted = sum(client.reply(big) for _ in range(40))  # 40 of them nobody reads
    assert accepted * len(big) <= MAX_REPLY_BYTES < 40 * len(big)
    assert len(closed) == 1 and client not in agent.clients
    last = p.decode_agent_frame(closed[0].splitlines()[-1])
    assert isinstance(last, p.Error) and last.code == "overloaded" and "not reading" in str(last.message)
    assert agent.dropped_replies >= 1 and client.dropped == 40 - accepted, "every reply not sent is counted"


async def _session(port: int, key: Path, known: Path) -> tuple[asyncssh.SSHClientConnection, asyncssh.SSHClientProcess]:
    conn = await asyncssh.connect("127.0.0.1", port, username="t", client_keys=[str(key)], known_hosts=str(known))
    proc = await conn.create_process(subsystem="gridwatch", encoding=None)
    assert isinstance(p.decode_agent_frame(await asyncio.wait_for(proc.stdout.readline(), 10)), p.Hello)
    return conn, proc


async def _result(proc: asyncssh.SSHClientProcess, req_id: str, timeout: float = 20.0) -> tuple[int, p.SearchResult]:
    while True:
        raw = await asyncio.wait_for(proc.stdout.readline(), timeout)
        assert raw, "the session ended first"
        frame = p.decode_agent_frame(raw)
        if isinstance(frame, p.SearchResult) and str(frame.id) == req_id:
            return len(raw), frame


def _search(req_id: str, pattern: str, limit: int = 500) -> bytes:
    return p.encode(p.Search(id=p.Text(req_id), pattern=p.Text(pattern), limit=limit))


async def test_a_search_answer_over_the_frame_limit_arrives_cut_and_says_so(keys, tmp_path: Path) -> None:
    log = tmp_path / "big.log"
    log.write_text("".join(f"{i:05d} " + "y" * 4000 + "\n" for i in range(5000)))  # 20 MB of matching lines
    tailer = LogTailer([str(log)], kernel=False, from_start=True, read_bytes=32 << 20)
    # 20 MB through a search worker twice: a generous deadline, so a loaded machine only makes it slower.
    ra = await start_agent(keys, interval=0.05, tailer=tailer, search_timeout=120.0)
    fleet, _ = make_fleet(ra, keys)
    try:
        await wait_until(lambda: len(tailer.entries()) == 5000, what="the log buffered")
        conn, proc = await _session(ra.port, keys.viewer_key, keys.known_hosts)
        async with conn:
            proc.stdin.write(_search("big", "y", limit=5000))
            size, res = await _result(proc, "big")
        assert size <= p.MAX_FRAME_BYTES and res.truncated and res.error is None
        assert 100 < len(res.lines) < 5000 and str(res.lines[-1].line).startswith("04999 "), "the newest lines are kept"
        await fleet.start()
        await wait_until(lambda: fleet.connected == 1, what="the console linked")
        # One search per key at a time: the first one's worker must be gone before the console asks.
        await wait_until(lambda: ra.agent.searches == 0, timeout=60, what="the first search's worker to end")
        found = await fleet.search("y", limit=5000, timeout=120.0)
        assert len(found) == len(res.lines), "the console takes the answer in (an oversized one it would drop)"
    finally:
        await fleet.stop()
        await stop_agent(ra)


async def test_one_search_at_a_time_per_key_so_others_still_get_a_worker(keys, tmp_path: Path) -> None:
    log = tmp_path / "spaces.log"
    log.write_text(("a" + " " * 3000 + "\n") * 200 + "needle\n")
    tailer = LogTailer([str(log)], kernel=False, from_start=True, read_bytes=32 << 20)
    ra = await start_agent(keys, interval=0.05, tailer=tailer, search_timeout=4.0)
    try:
        await wait_until(lambda: len(tailer.entries()) == 201, what="the log buffered")
        viewer, vproc = await _session(ra.port, keys.viewer_key, keys.known_hosts)
        operator, oproc = await _session(ra.port, keys.operator_key, keys.known_hosts)
        async with viewer, operator:
            slow = r"\s*\s*\s*x"  # allowed (three open repetitions), and slow on long runs of spaces
            vproc.stdin.write(_search("slow", slow))
            await wait_until(lambda: ra.agent.searches == 1, what="the slow search running")
            vproc.stdin.write(_search("again", slow))
            _, again = await _result(vproc, "again")
            assert again.error and "this key's previous search is still running" in str(again.error)
            oproc.stdin.write(_search("mine", "needle"))
            _, mine = await _result(oproc, "mine")
            assert mine.error is None and [str(line.line) for line in mine.lines] == ["needle"]
            _, first = await _result(vproc, "slow")
            assert first.error and "timed out" in str(first.error)
    finally:
        await stop_agent(ra)


def test_a_pattern_with_more_than_three_open_repetitions_is_refused() -> None:
    from gridwatch.agent.logsearch import SearchRefused, vet_pattern

    for pattern in (r"\s*" * 12 + "x", r"a+b+c+d+", r"\s{0,100}" * 4 + "x"):
        with pytest.raises(SearchRefused, match="at most 3 open repetitions"):
            vet_pattern(pattern)
    for fine in (r"\s*\s*\s*x", r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}", "NCCL.*timeout.*rank.*"):
        vet_pattern(fine)


# ------------------------------------------------------ 5: a planted incident database


def _console(keys: object, db: Path) -> tuple[int, str]:
    import subprocess

    out = subprocess.run([PYTHON, "-m", "gridwatch", "console", "--headless", "--nodes", "127.0.0.1:1",
                          "--key", str(keys.operator_key), "--known-hosts", str(keys.known_hosts),  # type: ignore[attr-defined]
                          "--db", str(db), "--duration", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    return out.returncode, out.stderr


def test_an_incident_database_behind_a_link_or_open_to_writers_is_refused(keys, tmp_path: Path) -> None:
    from gridwatch.playbooks.store import IncidentStore, StoreError

    link = tmp_path / "incidents.db"
    elsewhere = tmp_path / "elsewhere.db"
    link.symlink_to(elsewhere)
    with pytest.raises(StoreError, match="is a symbolic link") as refused:
        IncidentStore(link)
    assert "\n" not in str(refused.value) and not elsewhere.exists(), "nothing was made through the link"
    code, err = _console(keys, link)
    assert code == 2 and "is a symbolic link" in err and "Traceback" not in err and err.strip().count("\n") == 0, err

    loose = tmp_path / "loose.db"
    IncidentStore(loose).close()
    loose.chmod(0o666)
    with pytest.raises(StoreError, match=r"writable by group or others \(mode 0666\)"):
        IncidentStore(loose)


@as_root
def test_an_incident_database_of_another_user_is_refused(keys, tmp_path: Path) -> None:
    from gridwatch.playbooks.store import IncidentStore, StoreError

    db = tmp_path / "incidents.db"
    IncidentStore(db).close()
    os.chown(db, NOBODY, NOBODY)
    with pytest.raises(StoreError, match=f"owned by uid {NOBODY}"):
        IncidentStore(db)
    code, err = _console(keys, db)
    assert code == 2 and f"owned by uid {NOBODY}" in err and "Traceback" not in err, err
