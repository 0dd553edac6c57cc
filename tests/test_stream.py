"""The agent's stream over real SSH on loopback, seen from the fleet client."""

from __future__ import annotations

import asyncio
import signal

import asyncssh
import pytest

from gridwatch.sshlink.client import LinkState
from gridwatch.wire import protocol as p
from tests.conftest import free_port, spawn_agent, start_agent, stop_agent, wait_until
from tests.support_stream import make_fleet, of_type


async def test_operator_streams_hello_and_samples_named_by_node(agent, keys):
    fleet, frames = make_fleet(agent, keys)
    await fleet.start()
    try:
        await wait_until(lambda: len(of_type(frames, p.Sample)) >= 3, what="three samples")
        link = next(iter(fleet.links.values()))
        assert link.name == "node-1"
        assert link.role == "operator"
        assert link.state == LinkState.CONNECTED
        hello = of_type(frames, p.Hello)[0]
        assert len(hello.gpus) == 2 and hello.simulated
        seqs = [f.seq for f in of_type(frames, p.Sample)]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert all(len(s.gpus) == 2 for s in of_type(frames, p.Sample))
    finally:
        await fleet.stop()


async def test_viewer_may_stream_but_not_act(agent, keys):
    fleet, frames = make_fleet(agent, keys, key=keys.viewer_key)
    await fleet.start()
    try:
        await wait_until(lambda: of_type(frames, p.Sample), what="a sample")
        assert next(iter(fleet.links.values())).role == "viewer"
        res = await fleet.action("node-1", "isolate", reason="test")
        assert not res.ok and "operator role" in res.message
        assert not agent.agent.isolated
        pong = await fleet.action("node-1", "ping")
        assert pong.ok
    finally:
        await fleet.stop()


async def test_operator_isolates_and_injects_a_fault(agent, keys):
    fleet, frames = make_fleet(agent, keys)
    await fleet.start()
    try:
        await wait_until(lambda: of_type(frames, p.Sample), what="a sample")
        res = await fleet.action("node-1", "isolate", reason="xid 79 on gpu 1")
        assert res.ok, res.message
        await wait_until(lambda: any(e.kind == "isolated" for e in of_type(frames, p.Event)), what="isolated event")
        await wait_until(lambda: of_type(frames, p.Sample)[-1].isolated, what="isolated sample")
        res = await fleet.action("node-1", "inject_fault", {"kind": "xid", "code": 79, "gpu": 1})
        assert res.ok, res.message
        await wait_until(lambda: any(e.kind == "xid" and e.code == 79 and e.gpu == 1 for e in of_type(frames, p.Event)), what="xid event")
        bad = await fleet.action("node-1", "inject_fault", {"kind": "meteor"})
        assert not bad.ok and "unknown fault kind" in bad.message
        unknown = await fleet.action("node-1", "self_destruct")
        assert not unknown.ok and "unknown action" in unknown.message
    finally:
        await fleet.stop()


async def test_wrong_key_is_refused_with_a_reason(agent, keys, tmp_path):
    from gridwatch.sshlink.keys import init_keys

    other = init_keys(tmp_path / "other")
    fleet, _ = make_fleet(agent, keys, key=other.operator_key)
    await fleet.start()
    try:
        link = next(iter(fleet.links.values()))
        await wait_until(lambda: link.state == LinkState.REFUSED, what="refused state")
        assert "refused our key" in link.last_error and "authorized_" in link.last_error
    finally:
        await fleet.stop()


async def test_unknown_host_key_is_refused_never_accepted(agent, keys, tmp_path):
    from gridwatch.sshlink.keys import init_keys

    other = init_keys(tmp_path / "other")
    fleet, frames = make_fleet(agent, keys, known=other.known_hosts)
    await fleet.start()
    try:
        link = next(iter(fleet.links.values()))
        await wait_until(lambda: link.state == LinkState.REFUSED, what="refused state")
        assert "host key not trusted" in link.last_error and "gridwatch keys trust" in link.last_error
        assert not frames
    finally:
        await fleet.stop()


async def test_shell_exec_and_other_subsystems_are_refused(agent, keys):
    async with asyncssh.connect(
        "127.0.0.1", agent.port, username="x", client_keys=[str(keys.operator_key)], known_hosts=str(keys.known_hosts)
    ) as conn:
        result = await conn.run("cat /etc/passwd")
        assert result.exit_status == 1 and "only the 'gridwatch' subsystem" in result.stderr
        result = await conn.run(subsystem="netconf")
        assert result.exit_status == 1 and "subsystem 'netconf' is not served" in result.stderr
        with pytest.raises(asyncssh.ChannelOpenError):
            await conn.run(subsystem="sftp")
        with pytest.raises(asyncssh.ChannelOpenError):
            await conn.open_connection("127.0.0.1", agent.port)


async def test_garbage_requests_get_errors_and_the_stream_goes_on(agent, keys):
    async with asyncssh.connect(
        "127.0.0.1", agent.port, username="x", client_keys=[str(keys.operator_key)], known_hosts=str(keys.known_hosts)
    ) as conn:
        proc = await conn.create_process(subsystem="gridwatch", encoding=None)
        hello = p.decode_agent_frame(await proc.stdout.readline())
        assert isinstance(hello, p.Hello)
        proc.stdin.write(b"this is not json\n")
        proc.stdin.write(b'{"type":"launch_missiles","v":1}\n')
        proc.stdin.write(b'{"type":"action"}\n')
        proc.stdin.write(b"x" * (p.MAX_FRAME_BYTES + 10) + b"\n")
        proc.stdin.write(p.encode(p.Subscribe()))
        codes, samples = [], 0
        while samples < 2:
            frame = p.decode_agent_frame(await asyncio.wait_for(proc.stdout.readline(), 5))
            if isinstance(frame, p.Error):
                codes.append(str(frame.code))
            samples += isinstance(frame, p.Sample)
        assert codes == ["bad_frame", "unknown_type", "bad_frame", "too_large"]


async def test_resume_after_reconnect_loses_nothing(keys):
    ra = await start_agent(keys, interval=0.05)
    fleet, frames = make_fleet(ra, keys)
    await fleet.start()
    try:
        link = next(iter(fleet.links.values()))
        await wait_until(lambda: len(of_type(frames, p.Sample)) >= 3, what="samples")
        # Drop the connection under the fleet's feet; the agent keeps sampling meanwhile.
        fleet._conns[link.endpoint].close()
        await wait_until(lambda: link.state != LinkState.CONNECTED, what="disconnect seen")
        await wait_until(lambda: link.state == LinkState.CONNECTED and len(of_type(frames, p.Hello)) == 2, what="reconnect")
        last = ra.agent.ring.last_seq
        await wait_until(lambda: link.last_seq >= last + 3, what="stream resumed")
        seqs = [f.seq for _, f in frames if f.seq and not isinstance(f, p.Hello)]
        assert seqs == list(range(seqs[0], seqs[-1] + 1)), "every frame exactly once, in order"
        assert link.gaps == 0
    finally:
        await fleet.stop()
        await stop_agent(ra)


async def test_a_client_behind_the_buffer_gets_an_explicit_gap(keys):
    ra = await start_agent(keys, interval=0.02, ring_frames=5)
    await wait_until(lambda: ra.agent.ring.last_seq > 10, what="the ring to overrun")
    # A console that was away for long resumes from seq 1: frames 2.. are gone.
    fleet, frames = make_fleet(ra, keys)
    link = next(iter(fleet.links.values()))
    link.last_seq = 1
    await fleet.start()
    try:
        await wait_until(lambda: of_type(frames, p.Gap), what="gap frame")
        gap = of_type(frames, p.Gap)[0]
        assert gap.from_seq == 2 and gap.to_seq >= 6
        assert link.gaps == gap.to_seq - 1
        assert "behind" in gap.reason
    finally:
        await fleet.stop()
        await stop_agent(ra)


async def test_a_client_that_never_reads_blocks_nobody(agent, keys):
    async with asyncssh.connect(
        "127.0.0.1", agent.port, username="x", client_keys=[str(keys.viewer_key)], known_hosts=str(keys.known_hosts)
    ) as conn:
        proc = await conn.create_process(subsystem="gridwatch", encoding=None)
        proc.stdin.write(p.encode(p.Subscribe(resume_from=0)))
        # ... and never reads. Another console must still get everything live.
        fleet, frames = make_fleet(agent, keys)
        await fleet.start()
        try:
            await wait_until(lambda: len(of_type(frames, p.Sample)) >= 5, what="samples for the reading client")
            assert len(agent.agent.clients) == 2
        finally:
            await fleet.stop()


async def test_search_merges_answers_by_time(keys, tmp_path):
    from gridwatch.agent.logs import LogTailer

    log = tmp_path / "train.log"
    log.write_text("step 1 ok\nNCCL WARN net timeout\nstep 2 ok\n")
    ra = await start_agent(keys, tailer=LogTailer([str(log)], kernel=False, from_start=True))
    fleet, _ = make_fleet(ra, keys)
    await fleet.start()
    try:
        await wait_until(lambda: fleet.connected == 1 and ra.agent.tailer.search("step 2", None, None, 5), what="log read")
        progress = []
        lines = await fleet.search("NCCL", on_progress=lambda a, t: progress.append((a, t)))
        assert [str(l.line) for l in lines] == ["NCCL WARN net timeout"]
        assert lines[0].node == "node-1" and progress[-1] == (1, 1)
    finally:
        await fleet.stop()
        await stop_agent(ra)


async def test_killed_agent_goes_down_and_comes_back(keys, tmp_path):
    port = free_port()
    proc = spawn_agent(keys, port, "node-k", log=tmp_path / "agent.log")
    fleet, frames = make_fleet(f"127.0.0.1:{port}", keys)
    await fleet.start()
    try:
        link = next(iter(fleet.links.values()))
        await wait_until(lambda: link.state == LinkState.CONNECTED and of_type(frames, p.Sample), timeout=20, what="connected")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        await wait_until(lambda: link.state == LinkState.DOWN, what="down")
        assert link.last_error
        proc = spawn_agent(keys, port, "node-k")
        n = len(of_type(frames, p.Hello))
        await wait_until(lambda: len(of_type(frames, p.Hello)) > n and link.state == LinkState.CONNECTED, timeout=20, what="reconnected")
    finally:
        await fleet.stop()
        proc.kill()
        proc.wait()


async def test_isolation_survives_an_agent_restart(keys, tmp_path):
    state = str(tmp_path / "state.json")
    ra = await start_agent(keys, state_file=state)
    fleet, frames = make_fleet(ra, keys)
    await fleet.start()
    try:
        await wait_until(lambda: fleet.connected, what="connection")
        assert (await fleet.action("node-1", "isolate", reason="bad gpu")).ok
    finally:
        await fleet.stop()
        await stop_agent(ra)
    again = await start_agent(keys, state_file=state)
    try:
        assert again.agent.isolated
        assert p.decode_agent_frame(again.agent.hello("operator")).isolated
    finally:
        await stop_agent(again)
