"""Agents' links read by libssh2 (gridwatch.sshlink.lean): the same frames, requests and sentences as asyncssh's,
through a rekey, and a closed link's leftovers never reach the next link given its descriptor. Real SSH on loopback:
real agents and asyncssh servers of the tests' own."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import asyncssh
import pytest

from gridwatch.sshlink import lean
from gridwatch.sshlink.client import LinkState
from gridwatch.sshlink.hostlist import parse_endpoints
from gridwatch.sshlink.keys import init_keys
from gridwatch.wire import protocol as p
from tests.conftest import start_agent, stop_agent, wait_until
from tests.support_stream import AnyKeyServer, fake_agent, fleet_of_one, make_fleet, of_type

pytestmark = pytest.mark.skipif(not lean.AVAILABLE, reason="ssh2-python is not installed: asyncssh reads every link")


@pytest.mark.parametrize("client", ["libssh2", "asyncssh"])
async def test_either_client_streams_a_real_agent_and_carries_its_requests(keys, client: str) -> None:
    ra = await start_agent(keys, gpus=2, interval=0.1)
    fleet, frames = make_fleet(ra, keys, ssh_client=client)
    await fleet.start()
    try:
        link = next(iter(fleet.links.values()))
        await wait_until(lambda: len(of_type(frames, p.Sample)) >= 5, what="five samples")
        conn = fleet._conns[link.endpoint]  # noqa: SLF001 - which library carries it is the point here
        assert isinstance(conn, lean.LeanConnection) == (client == "libssh2")
        result = await fleet.action(link.name, "ping")
        assert result.ok, result.message
    finally:
        await fleet.stop()
        await stop_agent(ra)


@pytest.mark.parametrize("client", ["libssh2", "asyncssh"])
async def test_either_client_refuses_an_unknown_host_key_and_a_key_the_agent_does_not_take(keys, tmp_path, client) -> None:
    ra = await start_agent(keys)
    stranger = init_keys(tmp_path / "stranger", shared_host_key=True)
    try:
        cases = [
            # The agent's host key is not in this known_hosts: refused before our key is offered.
            ({"known": stranger.known_hosts}, "host key not trusted"),
            # Our key is not among the agent's viewers or operators.
            ({"key": stranger.operator_key}, "refused our key"),
        ]
        for which, said in cases:
            fleet, _ = make_fleet(ra, keys, ssh_client=client, **which)
            await fleet.start()
            link = next(iter(fleet.links.values()))
            await wait_until(lambda: link.state == LinkState.REFUSED, what=f"refused: {said}")  # noqa: B023
            assert said in (link.last_error or "")
            await fleet.stop()
    finally:
        await stop_agent(ra)


async def test_a_link_keeps_streaming_through_the_agents_rekeys(keys) -> None:
    """asyncssh's server rekeys after rekey_bytes; libssh2 answers it in the middle of reading, without blocking."""
    frames_sent = 400
    line = p.encode(p.Event(kind=p.Text("log"), message=p.Text("x" * 700)))

    async def script(process: Any) -> None:
        process.stdout.write(p.encode(p.Hello(node=p.Text("rekeyed"), interval=1.0)))
        for _ in range(frames_sent):
            process.stdout.write(line)
            await process.stdout.drain()
        await asyncio.Event().wait()

    # About 300 KB sent: a rekey every 32 KB is ten of them.
    async with fleet_of_one(keys, script, ssh_client="libssh2", rekey_bytes=32 * 1024) as (fleet, frames, link):
        await wait_until(lambda: len(of_type(frames, p.Event)) >= frames_sent, what="every frame through the rekeys")
        assert link.state == LinkState.CONNECTED and link.bad_frames == 0
        assert isinstance(fleet._conns[link.endpoint], lean.LeanConnection)  # noqa: SLF001


async def test_a_closed_links_leftovers_never_reach_the_next_link_on_its_descriptor(keys) -> None:
    """libssh2 sends a channel's close when the channel is freed: were the closed link's descriptor reused by then,
    those bytes would land in the next link's stream and the agent would drop it (a MAC failure)."""

    async def script(process: Any) -> None:
        process.stdout.write(p.encode(p.Hello(node=p.Text("n"), interval=1.0)))
        async for _line in process.stdin:  # a frame for each line the console writes
            process.stdout.write(p.encode(p.Event(kind=p.Text("log"), message=p.Text("tick"))))

    server = await fake_agent(keys, script)
    port = server.sockets[0].getsockname()[1]
    endpoint = parse_endpoints(f"127.0.0.1:{port}")[0]
    key = asyncssh.read_private_key(str(keys.operator_key))
    first: dict[Any, Any] = {}
    conn, _ = await lean.open_lean(endpoint, first, username="gridwatch", key=key, known_hosts=str(keys.known_hosts),
                                   subsystem=p.SUBSYSTEM)
    held = conn._chan  # noqa: SLF001 - the channel outlives its link, as one in a traceback or a frame can
    conn.close()
    second: dict[Any, Any] = {}
    conn2, stream = await lean.open_lean(endpoint, second, username="gridwatch", key=key,
                                         known_hosts=str(keys.known_hosts), subsystem=p.SUBSYSTEM)
    lines: list[bytes] = []
    stream.start(lines.append)
    try:
        del held
        gc.collect()  # the old channel freed now: libssh2 sends its close on its own (shut) socket
        count = len(lines)
        stream.write(b"ask\n" * 20)  # the agent reads these after libssh2's parting bytes, if any reached it
        await wait_until(lambda: len(lines) >= count + 20, what="twenty more frames on the second link")
        assert not stream.closed.done()
    finally:
        conn2.close()
        server.close()


def test_the_client_is_chosen_by_the_environment_and_a_bad_choice_is_refused_in_one_line() -> None:
    assert lean.ssh_client(environ={}) == "libssh2"
    assert lean.ssh_client(environ={"GRIDWATCH_SSH_CLIENT": " asyncssh "}) == "asyncssh"
    for bad in ("libssh", "AUTO", "paramiko"):
        with pytest.raises(ValueError, match=r"^GRIDWATCH_SSH_CLIENT: expected one of asyncssh, libssh2, got") as err:
            lean.ssh_client(environ={"GRIDWATCH_SSH_CLIENT": bad})
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("said", ["", "asyncssh"])
async def test_libssh2_reads_the_links_unless_gridwatch_ssh_client_says_asyncssh(keys, monkeypatch, said: str) -> None:
    if said:
        monkeypatch.setenv("GRIDWATCH_SSH_CLIENT", said)
    else:
        monkeypatch.delenv("GRIDWATCH_SSH_CLIENT", raising=False)
    ra = await start_agent(keys, interval=0.1)
    fleet, frames = make_fleet(ra, keys)
    await fleet.start()
    try:
        link = next(iter(fleet.links.values()))
        await wait_until(lambda: of_type(frames, p.Sample), what="a sample")
        expected = asyncssh.SSHClientConnection if said else lean.LeanConnection
        assert isinstance(fleet._conns[link.endpoint], expected)  # noqa: SLF001
    finally:
        await fleet.stop()
        await stop_agent(ra)


def test_a_relay_given_a_client_it_does_not_know_says_so_and_exits_2(tmp_path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "GRIDWATCH_SSH_CLIENT": "libssh"}
    done = subprocess.run([sys.executable, "-m", "gridwatch", "relay", "--listen", "127.0.0.1:0", "--nodes",
                           "127.0.0.1:1", "--keys", str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "gridwatch relay: GRIDWATCH_SSH_CLIENT: expected one of asyncssh, libssh2, got 'libssh'"


async def test_a_quiet_link_answers_the_agents_keepalives_and_stays_up(keys) -> None:
    """The agent's SSH face lets a console go after 3 unanswered keepalives (60 s each): libssh2 must answer them."""
    hellos = [0]

    async def script(process: Any) -> None:
        hellos[0] += 1
        process.stdout.write(p.encode(p.Hello(node=p.Text("quiet"), interval=60.0)))
        await asyncio.Event().wait()

    async with fleet_of_one(keys, script, ssh_client="libssh2", keepalive_interval=0.05,
                            keepalive_count_max=2) as (fleet, frames, link):
        await wait_until(lambda: link.state == LinkState.CONNECTED, what="the link up")
        conn = fleet._conns[link.endpoint]  # noqa: SLF001
        assert isinstance(conn, lean.LeanConnection)
        # Twenty keepalive periods, ten times what the agent waits before it drops an unanswering console.
        loop = asyncio.get_running_loop()
        until = loop.time() + 1.0
        await wait_until(lambda: loop.time() > until or link.state != LinkState.CONNECTED, what="a second")
        assert link.state == LinkState.CONNECTED and hellos[0] == 1 and fleet._conns[link.endpoint] is conn  # noqa: SLF001


async def test_a_frame_the_socket_held_when_the_console_wrote_is_handed_over_at_once(keys) -> None:
    """libssh2 reads the socket before it writes: a frame taken in so is handed over on the loop's next turn, not
    left in libssh2 until the node's next frame (at a summary's cadence, seconds later)."""
    import select

    async def script(process: Any) -> None:
        process.stdout.write(p.encode(p.Hello(node=p.Text("asked"), interval=60.0)))
        async for line in process.stdin:
            if line.strip() == b"ask":
                process.stdout.write(p.encode(p.Event(kind=p.Text("log"), message=p.Text("answer"))))
            # anything else: no answer, and nothing more from this node

    # The agent on a loop of its own (a thread): it answers while this loop is held below.
    import threading

    agent_loop = asyncio.new_event_loop()
    threading.Thread(target=agent_loop.run_forever, daemon=True).start()
    server = asyncio.run_coroutine_threadsafe(fake_agent(keys, script), agent_loop).result(10)
    port = server.sockets[0].getsockname()[1]
    endpoint = parse_endpoints(f"127.0.0.1:{port}")[0]
    key = asyncssh.read_private_key(str(keys.operator_key))
    conn, stream = await lean.open_lean(endpoint, {}, username="gridwatch", key=key,
                                        known_hosts=str(keys.known_hosts), subsystem=p.SUBSYSTEM)
    lines: list[bytes] = []
    stream.start(lines.append)
    try:
        await wait_until(lambda: lines, what="the hello")
        stream.write(b"ask\n")
        # Without giving the loop a turn: wait until the answer is in the socket, then write again, so libssh2
        # takes the answer in as it writes and the socket has nothing left to wake the loop with.
        ready, _, _ = select.select([conn._sock], [], [], 10)  # noqa: SLF001
        assert ready, "the agent did not answer"
        stream.write(b"quiet\n")
        await wait_until(lambda: any(b"answer" in line for line in lines), timeout=5, what="the answer")
    finally:
        conn.close()

        async def shut() -> None:
            server.close()
            await server.wait_closed()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), agent_loop).result(10)
        agent_loop.call_soon_threadsafe(agent_loop.stop)


async def test_a_weak_host_key_is_refused_before_our_key_is_offered(keys, tmp_path) -> None:
    offered: list[str] = []
    weak = asyncssh.generate_private_key("ssh-rsa", key_size=1024)

    class Counting(AnyKeyServer):
        def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
            offered.append(username)
            return True

    async def script(process: Any) -> None:
        process.stdout.write(p.encode(p.Hello(node=p.Text("weak"))))
        await asyncio.Event().wait()

    server = await fake_agent(keys, script, host_key=weak, server=Counting)
    port = server.sockets[0].getsockname()[1]
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {weak.export_public_key().decode()}")  # pinned, and still too weak
    fleet, frames = make_fleet(f"127.0.0.1:{port}", keys, known=known, ssh_client="libssh2")
    await fleet.start()
    try:
        link = next(iter(fleet.links.values()))
        await wait_until(lambda: link.state == LinkState.REFUSED, what="refused for its weak host key")
        assert "the agent's host key is a 1024-bit RSA key" in (link.last_error or "")
        assert offered == [] and frames == []
    finally:
        await fleet.stop()
        server.close()


async def test_the_frames_an_agent_wrote_just_before_it_was_killed_arrive(keys) -> None:
    """A killed agent's socket is closed by its kernel right behind its last frames (an XID, then the end): they
    arrive, and then the link is down. (An SSH disconnect message in the same read would lose them in libssh2;
    the agent never sends one after data: it ends a session by closing the channel, and dies by closing the socket.)"""
    connections: list[asyncssh.SSHServerConnection] = []

    class Kept(AnyKeyServer):
        def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
            connections.append(conn)

    async def script(process: Any) -> None:
        process.stdout.write(p.encode(p.Hello(node=p.Text("dying"), interval=1.0)))
        await process.stdin.readline()  # the link up: its subscription came
        for code in (48, 63, 79):
            process.stdout.write(p.encode(p.Event(kind=p.Text("xid"), code=code, message=p.Text(f"Xid {code}"))))
        await process.stdout.drain()
        connections[-1].abort()  # what the kernel does to a killed process's socket: no SSH goodbye

    async with fleet_of_one(keys, script, ssh_client="libssh2", server=Kept) as (fleet, frames, link):
        await wait_until(lambda: link.state == LinkState.DOWN, what="the link down")
        assert [e.code for e in of_type(frames, p.Event)][:3] == [48, 63, 79]  # (a reconnect may bring more)


async def test_a_channel_ended_right_behind_its_last_frames_is_seen_as_ended_and_the_frames_arrive(keys) -> None:
    """The far end writes its last frames and ends the channel, its connection left open: libssh2 reads both in
    one go, and the link reads no further than the data it has, so the end must be taken from that same read."""

    async def script(process: Any) -> None:
        process.stdout.write(p.encode(p.Hello(node=p.Text("ending"), interval=1.0)))
        await process.stdin.readline()  # the link up: its subscription came
        process.stdout.write(p.encode(p.Event(kind=p.Text("xid"), code=79, message=p.Text("Xid 79"))))
        process.exit(0)  # end of file and the channel closed, in the packets right behind the event

    async with fleet_of_one(keys, script, ssh_client="libssh2") as (fleet, frames, link):
        await wait_until(lambda: link.state == LinkState.DOWN, what="the link down")
        assert [e.code for e in of_type(frames, p.Event)][:1] == [79]


async def test_a_channel_ended_behind_its_last_frames_and_a_traceback_on_stderr_is_seen_as_ended(keys) -> None:
    """The agent's last frames, a traceback on stderr, then its exit, all in one read: libssh2 says the channel
    has ended only once stderr is read too, so the link reads stderr before it asks."""

    async def script(process: Any) -> None:
        process.stdout.write(p.encode(p.Hello(node=p.Text("ending"), interval=1.0)))
        await process.stdin.readline()  # the link up: its subscription came
        process.stdout.write(p.encode(p.Event(kind=p.Text("xid"), code=79, message=p.Text("Xid 79"))))
        process.stderr.write(b"Traceback (most recent call last): boom\n")
        process.exit(1)

    async with fleet_of_one(keys, script, ssh_client="libssh2") as (fleet, frames, link):
        await wait_until(lambda: link.state == LinkState.DOWN, what="the link down")
        assert [e.code for e in of_type(frames, p.Event)][:1] == [79]
