"""What a hostile viewer, a careless operator and bad luck can do to an agent, each tried for real."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import time
from pathlib import Path

import asyncssh
import psutil
import pytest
from loguru import logger

from gridwatch.agent.agent import Agent
from gridwatch.agent.config import AgentConfig
from gridwatch.sshlink.client import LinkState
from gridwatch.sshlink.ratelimit import KeyedBuckets, TokenBucket
from gridwatch.sshlink.server import Caller
from gridwatch.wire import protocol as p
from tests.conftest import free_port, spawn_agent, start_agent, stop_agent, wait_until, wait_until_async
from tests.support_stream import make_fleet, of_type

OPERATOR = Caller(username="op", role="operator", key="SHA256:op")


@pytest.fixture
def logs():
    """Every log message the agent writes during the test."""
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), level="DEBUG")
    yield messages
    logger.remove(sink)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def _open(ra_or_port, key: Path, known: Path):
    port = ra_or_port if isinstance(ra_or_port, int) else ra_or_port.port
    conn = await asyncssh.connect("127.0.0.1", port, username="t", client_keys=[str(key)], known_hosts=str(known))
    proc = await conn.create_process(subsystem="gridwatch", encoding=None)
    hello = p.decode_agent_frame(await asyncio.wait_for(proc.stdout.readline(), 10))
    assert isinstance(hello, p.Hello)
    return conn, proc, hello


async def _read_until(proc, cond, timeout: float = 10.0, seen: list | None = None):
    """Frames until ``cond(frame)``; every frame read is kept in ``seen``."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError("timed out waiting for a frame")
        raw = await asyncio.wait_for(proc.stdout.readline(), left)
        if not raw:
            raise AssertionError("the session ended first")
        frame = p.decode_agent_frame(raw)
        if seen is not None:
            seen.append((time.monotonic(), frame))
        if cond(frame):
            return frame


def _search(pattern: str, id: str = "s") -> bytes:
    return p.encode(p.Search(id=p.Text(id), pattern=p.Text(pattern)))


def _action(name: str, id: str = "a", **args: object) -> bytes:
    return p.encode(p.Action(id=p.Text(id), action=p.Text(name), args=args))


# ------------------------------------------------------------------ 2: log search


@pytest.mark.slow
async def test_a_catastrophic_search_neither_freezes_the_agent_nor_outlives_sigterm(keys, tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text("")
    config = tmp_path / "agent.toml"
    config.write_text("search_timeout = 1.5\naction_burst = 1000\n")
    port = free_port()
    agent = spawn_agent(keys, port, "node-s", "--log", str(log), "--config", str(config), log=tmp_path / "agent.out")
    try:
        await wait_until(lambda: _listening(port), timeout=20, what="the agent to listen")
        conn, proc, _ = await _open(port, keys.viewer_key, keys.known_hosts)
        async with conn:
            with log.open("a") as f:
                f.write(("a" * 4000 + "!\n") * 40)
            proc.stdin.write(p.encode(p.Subscribe()))

            async def lines_found() -> int:
                proc.stdin.write(_search("!$", "probe"))
                res = await _read_until(proc, lambda f: isinstance(f, p.SearchResult))
                return len(res.lines)

            async def all_found() -> bool:
                return await lines_found() >= 40

            await wait_until_async(all_found, what="the agent to buffer the log lines")

            # Nested quantifiers: refused before anything runs.
            proc.stdin.write(_search("(a+)+$", "evil"))
            res = await _read_until(proc, lambda f: isinstance(f, p.SearchResult))
            assert str(res.error).startswith("refused pattern: a repetition inside a repetition"), res.error

            # Allowed (three open repetitions) but hopelessly slow: a worker runs it, stopped at its deadline.
            seen: list = []
            proc.stdin.write(_search("a*a*a*$", "slow"))
            started = time.monotonic()
            res = await _read_until(proc, lambda f: isinstance(f, p.SearchResult), seen=seen)
            took = time.monotonic() - started
            assert str(res.error).startswith("search timed out"), res.error
            assert took >= 1.4
            stamps = [t for t, f in seen if isinstance(f, p.Sample)]
            # At 0.2 s a tick, about 7 samples; a search on the loop would let none through.
            assert len(stamps) >= 3, f"{len(stamps)} samples in {took:.1f} s at 0.2 s interval"
            assert max(b - a for a, b in zip([started, *stamps], [*stamps, time.monotonic()])) < 1.0

            # SIGTERM while a search worker runs: the agent stops and takes its worker along.
            proc.stdin.write(_search("a*a*a*$", "slow2"))
            workers = await wait_until(lambda: _children(agent.pid, "gridwatch.agent.logsearch"), what="a search worker")
            agent.send_signal(signal.SIGTERM)
            await wait_until(lambda: agent.poll() is not None, timeout=10, what="the agent to stop on SIGTERM")
            await wait_until(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers), what="the worker gone")
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _children(pid: int, marker: str) -> list[psutil.Process]:
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for kid in kids:
        try:
            if any(marker in part for part in kid.cmdline()):
                found.append(kid)
        except psutil.Error:
            pass
    return found


# --------------------------------------------------------------- 3: pre-flight


async def test_a_viewer_gets_capped_preflight_and_no_all_reduce(keys, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    ra = await start_agent(keys, checkpoint_paths=[str(ckpt)])
    fleet, _ = make_fleet(ra, keys, key=keys.viewer_key)
    await fleet.start()
    try:
        await wait_until(lambda: fleet.connected, what="connected")
        comm = {"master_addr": "203.0.113.9", "master_port": 1, "rank": 0, "world": 2, "size_bytes": 1 << 33, "timeout_s": 1e6}
        res = await fleet.action("node-1", "preflight", {"checks": ["comm"], "comm": comm})
        assert not res.ok and "needs the operator role; this key is a viewer" in res.message
        assert not _children(os.getpid(), "gridwatch.trainer.allreduce")
        res = await fleet.action("node-1", "preflight", {"checks": ["storage"], "write_test_mb": 1e6, "net_sample_s": 1e6}, timeout=30)
        assert res.ok, res.message
        assert res.data["storage"]["paths"][str(ckpt)]["write_test_mb"] == 16.0
    finally:
        await fleet.stop()
        await stop_agent(ra)


async def test_an_operator_all_reduce_is_bounded_exclusive_and_dies_with_its_session(keys) -> None:
    ra = await start_agent(keys)
    try:
        conn, proc, _ = await _open(ra, keys.operator_key, keys.known_hosts)
        async with conn:
            bad = {"master_addr": "--help", "master_port": 29500, "rank": 1, "world": 2}
            proc.stdin.write(_action("preflight", "bad", checks=["comm"], comm=bad))
            res = await _read_until(proc, lambda f: isinstance(f, p.ActionResult))
            assert not res.ok and "master_addr must be an IP address or a host name" in res.message
            huge = {"master_addr": "127.0.0.1", "master_port": 29500, "rank": 1, "world": 2, "size_bytes": 1 << 31}
            proc.stdin.write(_action("preflight", "huge", checks=["comm"], comm=huge))
            res = await _read_until(proc, lambda f: isinstance(f, p.ActionResult))
            assert not res.ok and "size_bytes must be between 4 and" in res.message

            # Rank 1 of 2 waits for a master nobody runs: the child hangs until something kills it.
            comm = {"master_addr": "127.0.0.1", "master_port": free_port(), "rank": 1, "world": 2, "timeout_s": 120.0}
            proc.stdin.write(_action("preflight", "long", checks=["comm"], comm=comm))
            children = await wait_until(lambda: _children(os.getpid(), "gridwatch.trainer.allreduce"), what="the all-reduce child")
            proc.stdin.write(_action("preflight", "second", checks=["network"]))
            res = await _read_until(proc, lambda f: isinstance(f, p.ActionResult))
            assert res.id == "second" and not res.ok and res.message.startswith("busy: pre-flight long is running")
        # The session is gone: so is its child, and the node takes a new pre-flight.
        await wait_until(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children), what="the child killed")
        await wait_until(lambda: ra.agent.preflight_running is None, what="the pre-flight released")
    finally:
        await stop_agent(ra)


# --------------------------------------------------------------- 10: scenes


async def test_capture_scene_stays_in_a_private_scene_dir_whatever_the_id(tmp_path: Path) -> None:
    scenes = tmp_path / "scenes"
    agent = Agent(AgentConfig(node_name="n1", scene_dir=str(scenes)))
    agent.tick()
    for evil in ("../../escaped", "/tmp/abs", "..", "a/../../b"):
        res = await agent.act(OPERATOR, p.Action(id=p.Text(evil), action=p.Text("capture_scene"), args={"label": "../up"}))
        assert res.ok, res.message
        where = Path(res.data["path"])
        assert where.resolve().parent == scenes.resolve()
        assert stat.S_IMODE(where.stat().st_mode) == 0o700
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in where.iterdir())
    assert sorted(x.name for x in tmp_path.iterdir()) == ["scenes"]
    assert stat.S_IMODE(scenes.stat().st_mode) == 0o700
    from gridwatch.agent.actions import scene_path

    with pytest.raises(ValueError):
        scene_path(str(scenes), "x", "y", "../../stamp")  # the last check holds whatever built the name


# --------------------------------------------------------------- 11: budgets


def test_a_token_bucket_refills_with_its_clock() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, burst=3, clock=clock)
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    assert bucket.retry_after() == pytest.approx(0.5)
    clock.t += 0.5
    assert bucket.take() and not bucket.take()
    clock.t -= 100  # a clock stepping back gives nothing and takes nothing
    assert not bucket.take()


async def test_a_flood_of_actions_is_refused_per_key_and_the_ring_keeps_its_history(keys) -> None:
    ra = await start_agent(keys, action_burst=5, action_rate=1.0)
    clock = FakeClock()
    ra.agent.budgets = KeyedBuckets(1.0, 5, clock)
    try:
        conn, proc, _ = await _open(ra, keys.operator_key, keys.known_hosts)
        async with conn:
            before = ra.agent.ring.last_seq
            for i in range(50):
                proc.stdin.write(_action("inject_fault", f"f{i}", kind="meteor"))
            results = [await _read_until(proc, lambda f: isinstance(f, p.ActionResult)) for _ in range(50)]
            refused = [r for r in results if "over its budget" in r.message]
            assert len(refused) == 45
            # Each refusal says when to try again (the five let through may answer after them: not in order).
            assert all("try again in 1.0 s" in r.message for r in refused)
            # Refused, or changed nothing: no event in the ring for any of them.
            events = [p.decode_agent_frame(f) for f in ra.agent.ring.since(before)[0]]
            assert not [e for e in events if isinstance(e, p.Event) and e.kind == "action"]
            clock.t += 1.0
            proc.stdin.write(_action("ping", "again"))
            res = await _read_until(proc, lambda f: isinstance(f, p.ActionResult))
            assert res.ok, res.message
            assert ra.agent.refused_requests == 45
    finally:
        await stop_agent(ra)


async def test_pending_actions_per_session_are_bounded(keys) -> None:
    from gridwatch.agent.clients import MAX_PENDING

    ra = await start_agent(keys, action_burst=1000)
    release = asyncio.Event()

    async def slow_ping(agent, caller, action):
        await release.wait()
        return p.ActionResult(id=action.id, action=action.action, ok=True, message=p.Text("pong"))

    ra.agent.actions["ping"] = slow_ping
    try:
        conn, proc, _ = await _open(ra, keys.viewer_key, keys.known_hosts)
        async with conn:
            for i in range(MAX_PENDING + 4):
                proc.stdin.write(_action("ping", f"p{i}"))
            refused = [await _read_until(proc, lambda f: isinstance(f, p.ActionResult)) for _ in range(4)]
            assert all(not r.ok and "still running" in r.message for r in refused)
            release.set()
            answered = [await _read_until(proc, lambda f: isinstance(f, p.ActionResult)) for _ in range(MAX_PENDING)]
            assert all(r.ok for r in answered)
    finally:
        await stop_agent(ra)


async def test_an_action_that_changes_nothing_raises_no_event(keys) -> None:
    agent = Agent(AgentConfig(node_name="n1"))
    for _ in range(3):
        assert (await agent.act(OPERATOR, p.Action(id=p.Text("i"), action=p.Text("isolate")))).ok
    events = [p.decode_agent_frame(f) for f in agent.ring.since(0)[0]]
    kinds = [str(e.kind) for e in events if isinstance(e, p.Event)]
    assert kinds == ["isolated", "action"]


@pytest.mark.slow
async def test_a_console_that_stops_reading_is_told_and_closed_never_silently_dropped(keys, tmp_path: Path) -> None:
    from gridwatch.agent.logs import LogTailer

    log = tmp_path / "flood.log"
    log.write_text("")
    ra = await start_agent(keys, interval=0.05, tailer=LogTailer([str(log)], kernel=False))
    try:
        conn, proc, _ = await _open(ra, keys.viewer_key, keys.known_hosts)
        async with conn:
            proc.stdin.write(p.encode(p.Subscribe(logs=True)))
            await wait_until(lambda: any(c.logs for c in ra.agent.clients), what="subscribed to logs")
            # ... and reads nothing while 12 MB of log lines arrive.
            with log.open("a") as f:
                f.write(("x" * 1000 + "\n") * 12_000)
            await wait_until(lambda: not ra.agent.clients, timeout=20, what="the session closed")
            last = await _read_until(proc, lambda f: isinstance(f, p.Error), timeout=20)
            assert last.code == "overloaded" and "not reading" in last.message
            assert ra.agent.dropped_replies > 0
    finally:
        await stop_agent(ra)


# --------------------------------------------------------------- 12: isolation


async def test_isolate_fails_out_loud_when_the_state_cannot_be_kept(keys, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.mkdir()  # a directory where the file should go: it cannot be replaced
    ra = await start_agent(keys, state_file=str(state))
    fleet, frames = make_fleet(ra, keys)
    await fleet.start()
    try:
        await wait_until(lambda: fleet.connected, what="connected")
        res = await fleet.action("node-1", "isolate", reason="xid 79")
        assert not res.ok and "could not be written" in res.message and "not isolated" in res.message
        assert not ra.agent.isolated
        assert not p.decode_agent_frame(ra.agent.hello("operator")).isolated
        assert not any(e.kind == "isolated" for e in of_type(frames, p.Event))
    finally:
        await fleet.stop()
        await stop_agent(ra)


# ------------------------------------------------------------------ 7: boot id


async def test_every_agent_start_says_a_new_boot_id(keys) -> None:
    first = await start_agent(keys)
    try:
        conn, _, hello = await _open(first, keys.viewer_key, keys.known_hosts)
        conn.close()
    finally:
        await stop_agent(first)
    second = await start_agent(keys)
    try:
        conn, _, again = await _open(second, keys.viewer_key, keys.known_hosts)
        conn.close()
    finally:
        await stop_agent(second)
    assert len(hello.boot_id) == 32 and int(hello.boot_id, 16) >= 0
    assert again.boot_id and again.boot_id != hello.boot_id


# ------------------------------------------------------ 16: authorized files


async def test_an_authorized_file_others_can_write_grants_nobody(keys, logs) -> None:
    ra = await start_agent(keys)
    try:
        os.chmod(keys.authorized_viewers, 0o666)
        for _ in range(2):
            with pytest.raises(asyncssh.PermissionDenied):
                await _open(ra, keys.viewer_key, keys.known_hosts)
        named = [m for m in logs if str(keys.authorized_viewers) in m and "writable by group and others" in m]
        assert len(named) == 1, logs
        os.chmod(keys.authorized_viewers, 0o644)
        conn, _, hello = await _open(ra, keys.viewer_key, keys.known_hosts)
        conn.close()
        assert hello.role == "viewer"
        if os.geteuid() == 0:
            os.chown(keys.authorized_viewers, 65534, -1)  # owned by nobody: refused though 0644
            with pytest.raises(asyncssh.PermissionDenied):
                await _open(ra, keys.viewer_key, keys.known_hosts)
            assert any("owned by uid 65534" in m for m in logs)
    finally:
        await stop_agent(ra)


# -------------------------------------------------------------- 18: algorithms


async def test_sha1_key_exchange_is_refused(agent, keys) -> None:
    with pytest.raises((asyncssh.KeyExchangeFailed, asyncssh.DisconnectError)):
        await asyncssh.connect(
            "127.0.0.1", agent.port, username="t", client_keys=[str(keys.operator_key)], known_hosts=str(keys.known_hosts),
            kex_algs=["diffie-hellman-group14-sha1"],
        )


async def test_a_1024_bit_rsa_client_key_is_refused_though_listed(agent, keys, tmp_path: Path, logs) -> None:
    weak = asyncssh.generate_private_key("ssh-rsa", key_size=1024)
    path = tmp_path / "weak_key"
    weak.write_private_key(str(path))
    with open(keys.authorized_operators, "a") as f:
        f.write(weak.export_public_key().decode())
    with pytest.raises(asyncssh.PermissionDenied):
        await _open(agent, path, keys.known_hosts)
    assert any("a 1024-bit RSA key" in m for m in logs)


# ---------------------------------------------------------------------- Low


async def test_refused_exec_sftp_and_forwarding_are_logged_sparingly(agent, keys, logs) -> None:
    async with asyncssh.connect(
        "127.0.0.1", agent.port, username="x", client_keys=[str(keys.operator_key)], known_hosts=str(keys.known_hosts)
    ) as conn:
        assert (await conn.run("id")).exit_status == 1
        with pytest.raises(asyncssh.ChannelOpenError):
            await conn.run(subsystem="sftp")
        with pytest.raises(asyncssh.ChannelOpenError):
            await conn.open_connection("127.0.0.1", agent.port)
        for _ in range(30):
            await conn.run("id")
    refused = [m for m in logs if m.startswith("refused ")]
    assert any(m.startswith("refused a command from x (operator") for m in refused)
    assert any(m.startswith("refused SFTP from") for m in refused)
    assert any(m.startswith("refused port forwarding from") for m in refused)
    assert len(refused) <= 10, refused


async def test_resume_from_is_kept_to_what_the_agent_sent(keys) -> None:
    ra = await start_agent(keys, interval=0.02, ring_frames=5)
    try:
        await wait_until(lambda: ra.agent.ring.last_seq > 10, what="the ring to overrun")
        for resume in (-(2**63), 0, 1):
            conn, proc, _ = await _open(ra, keys.viewer_key, keys.known_hosts)
            async with conn:
                proc.stdin.write(p.encode(p.Subscribe(resume_from=resume)))
                gap = await _read_until(proc, lambda f: isinstance(f, p.Gap))
                assert gap.from_seq >= 1 and gap.to_seq < ra.agent.ring.first_seq
        # Frames asked for again and again are counted once: never more than the ring let go.
        assert ra.agent.dropped_frames <= ra.agent.ring.first_seq - 1
        conn, proc, _ = await _open(ra, keys.viewer_key, keys.known_hosts)
        async with conn:
            proc.stdin.write(p.encode(p.Subscribe(resume_from=2**63)))  # frames never sent
            sample = await _read_until(proc, lambda f: isinstance(f, p.Sample))
            assert sample.seq <= ra.agent.ring.last_seq
    finally:
        await stop_agent(ra)


async def test_connections_that_never_authenticate_are_capped_and_timed_out(keys, logs) -> None:
    ra = await start_agent(keys, max_unauthenticated=3, login_timeout=1.0)
    held = []
    try:
        for _ in range(3):
            held.append(await asyncio.open_connection("127.0.0.1", ra.port))
            banner = await asyncio.wait_for(held[-1][0].readline(), 5)  # the agent has seen this one
            assert banner.startswith(b"SSH-2.0-")
        reader, writer = await asyncio.open_connection("127.0.0.1", ra.port)
        await asyncio.wait_for(reader.read(), 5)  # closed at once: EOF
        writer.close()
        assert any("3 connections are still authenticating" in m for m in logs)
        # Past the login timeout the silent ones are dropped and a console gets in again.
        for r, _ in held:
            await asyncio.wait_for(r.read(), 10)
        fleet, frames = make_fleet(ra, keys)
        await fleet.start()
        try:
            await wait_until(lambda: next(iter(fleet.links.values())).state == LinkState.CONNECTED, what="a console connected")
        finally:
            await fleet.stop()
    finally:
        for _, w in held:
            w.close()
        await stop_agent(ra)



@pytest.mark.parametrize(
    "pattern, why",
    [
        ("(a+)+$", "repetition inside a repetition"),
        ("(a?){30}a{30}", "repetition inside a repetition"),
        ("(a|aa)*b", "alternation inside a repetition"),
        (r"(x)\1", "back-references"),
        ("a" * 501, "at most 500 characters"),
    ],
)
def test_search_patterns_that_can_backtrack_without_bound_are_refused(pattern: str, why: str) -> None:
    from gridwatch.agent.logsearch import SearchRefused, vet_pattern

    with pytest.raises(SearchRefused, match=why):
        vet_pattern(pattern)
    for fine in ("NCCL.*timeout", r"Xid \(PCI:[0-9a-f:.]+\): 79", "(err|warn): .*", "(ab){3}", "(a+)?"):
        vet_pattern(fine)
