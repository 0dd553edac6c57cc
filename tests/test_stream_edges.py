"""Edges of the stream: OpenSSH as a client, an agent dying mid-frame, a hostile agent."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from gridwatch.sshlink.client import Fleet, FleetOptions, LinkState
from gridwatch.sshlink.hostlist import parse_endpoints
from gridwatch.wire import protocol as p
from tests.conftest import wait_until
from tests.support_stream import fake_agent


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no OpenSSH client on this machine")
async def test_plain_openssh_shows_readable_frames(agent, keys):
    proc = await asyncio.create_subprocess_exec(
        "ssh", "-s", "-p", str(agent.port), "-i", str(keys.viewer_key),
        "-o", f"UserKnownHostsFile={keys.known_hosts}", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
        "-o", "IdentitiesOnly=yes", "-F", "/dev/null", "127.0.0.1", "gridwatch",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        proc.stdin.write(b'{"type":"subscribe"}\n')
        hello = json.loads(await asyncio.wait_for(proc.stdout.readline(), 15))
        sample = json.loads(await asyncio.wait_for(proc.stdout.readline(), 15))
        assert hello["type"] == "hello" and hello["node"] == "node-1" and hello["role"] == "viewer"
        assert sample["type"] == "sample" and {"v", "seq", "ts", "node"} <= sample.keys()
    finally:
        proc.kill()
        await proc.wait()


async def test_an_agent_that_dies_mid_frame_loses_only_that_frame(keys):
    hello = p.encode(p.Hello(node=p.Text("half"), seq=0))
    sample = p.encode(p.Sample(seq=1, node=p.Text("half")))

    async def script(process):
        process.stdout.write(hello + sample + sample[: len(sample) // 2])
        await process.stdout.drain()
        process.exit(0)

    server = await fake_agent(keys, script)
    port = server.sockets[0].getsockname()[1]
    frames = []
    fleet = Fleet(parse_endpoints(f"127.0.0.1:{port}"), FleetOptions(key_path=str(keys.viewer_key), known_hosts=str(keys.known_hosts), backoff_min=5),
                  on_frame=lambda link, f: frames.append(f))
    await fleet.start()
    try:
        link = next(iter(fleet.links.values()))
        await wait_until(lambda: link.state == LinkState.DOWN, what="down after the agent died")
        assert [type(f) for f in frames] == [p.Hello, p.Sample]
        assert link.bad_frames == 0 and "closed" in link.last_error
    finally:
        await fleet.stop()
        server.close()


async def test_a_hostile_agent_cannot_crash_or_flood_the_console(keys):
    junk = [
        b"\x00\xff" * 100 + b"\n",
        b'{"type":"sample","gpus":[{"index":"zero"}]}\n',
        b'{"type":"warp_drive","v":99}\n',
        b"{" + b'"a":1,' * (p.MAX_FRAME_BYTES // 6) + b"}\n",
        b'{"type":"event","kind":"xid\\u001b[31m","node":"[bold red]evil[/]\\u001b]52;c;aGk=\\u0007","message":"\\u001b[2J"}\n',
        b'{"type":"event","kind":"xid\\u001b[31m","node":"evil","message":"\\u001b[2J\\u001b]0;pwned\\u0007"}\n',
    ]

    async def script(process):
        process.stdout.write(p.encode(p.Hello(node=p.Text("evil"))) + b"".join(junk))
        await process.stdout.drain()
        await asyncio.Event().wait()

    server = await fake_agent(keys, script)
    port = server.sockets[0].getsockname()[1]
    frames = []
    fleet = Fleet(parse_endpoints(f"127.0.0.1:{port}"), FleetOptions(key_path=str(keys.viewer_key), known_hosts=str(keys.known_hosts)),
                  on_frame=lambda link, f: frames.append(f))
    await fleet.start()
    try:
        link = next(iter(fleet.links.values()))
        await wait_until(lambda: any(isinstance(f, p.Event) for f in frames), what="the one good event")
        event = next(f for f in frames if isinstance(f, p.Event))
        assert "\x1b" not in event.node + event.kind + event.message and "\x07" not in event.message
        # The frame that named another node (escapes and all) was dropped, not shown.
        assert link.foreign_frames == 1 and str(event.node) == "evil"
        assert link.bad_frames == 4 and link.state == LinkState.CONNECTED
    finally:
        await fleet.stop()
        server.close()
