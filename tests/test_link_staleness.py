"""A link that holds but falls silent is stale after three of its intervals and dropped after ten, each link at
its own cadence, over real SSH on loopback with the fleet's clock injected (no waiting out the seconds)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gridwatch.sshlink.client import Fleet, FleetOptions, LinkState
from gridwatch.sshlink.hostlist import parse_endpoints
from gridwatch.wire import protocol as p
from tests.conftest import wait_until
from tests.support_stream import fake_agent


async def _agents_and_fleet(keys, names: list[str]) -> tuple[list[float], dict[str, int], dict[str, asyncio.Queue[p.Frame]],
                                                           list[p.Frame], list[Any], Fleet]:
    """Agents that say hello (a 1 s interval) and then only what a test puts in their outbox, and a fleet over
    them whose clock is ``now[0]``: the clock, each agent's hellos, their outboxes, the frames received."""
    now = [1000.0]
    hellos: dict[str, int] = {}
    outboxes: dict[str, asyncio.Queue[p.Frame]] = {}

    def agent(name: str) -> Any:
        async def script(process: Any) -> None:
            hellos[name] = hellos.get(name, 0) + 1
            outboxes[name] = queue = asyncio.Queue()
            process.stdout.write(p.encode(p.Hello(node=p.Text(name), interval=1.0, boot_id=p.Text("b1"))))
            while True:
                process.stdout.write(p.encode(await queue.get()))
        return script

    servers = [await fake_agent(keys, agent(name)) for name in names]
    spec = ",".join(f"127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers)
    received: list[p.Frame] = []
    fleet = Fleet(parse_endpoints(spec), FleetOptions(key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts),
                                                       backoff_min=0.05, backoff_max=0.3, clock=lambda: now[0]),
                  on_frame=lambda link, f: received.append(f))
    return now, hellos, outboxes, received, servers, fleet


async def test_silent_links_go_stale_then_down_each_at_its_own_cadence_and_come_back(keys) -> None:
    now, hellos, outboxes, received, servers, fleet = await _agents_and_fleet(keys, ["quiet", "summaries", "chatty"])
    link = {}
    seq = [0]

    async def send(name: str, frame: p.Frame) -> None:
        count = len(received)
        outboxes[name].put_nowait(frame)
        await wait_until(lambda: len(received) > count, what=f"{name}'s frame")

    def sample(name: str) -> p.Frame:
        seq[0] += 1
        return p.Sample(node=p.Text(name), seq=seq[0], ts=now[0])

    await fleet.start()
    try:
        await wait_until(lambda: len(hellos) == 3 and all(l.state == LinkState.CONNECTED for l in fleet.links.values()),
                         what="three links up")
        link = {l.name: l for l in fleet.links.values()}
        seq[0] += 1
        await send("summaries", p.Summary(node=p.Text("summaries"), seq=seq[0], ts=now[0], every=5.0))
        now[0] += 3.5  # past 3 x 1 s for the hello's cadence, inside 3 x 5 s for the summaries'
        await send("chatty", sample("chatty"))
        await wait_until(lambda: link["quiet"].state == LinkState.STALE, what="the quiet link stale")
        assert link["summaries"].state == LinkState.CONNECTED and link["chatty"].state == LinkState.CONNECTED
        now[0] += 12.0  # 15.5 s since the summary; 15.5 s since the quiet link's hello: past 10 x 1 s
        await send("chatty", sample("chatty"))
        await wait_until(lambda: link["summaries"].state == LinkState.STALE, what="the summaries' link stale")
        # The quiet link is dropped and made again: the agent says hello a second time.
        await wait_until(lambda: hellos["quiet"] == 2 and link["quiet"].state == LinkState.CONNECTED,
                         what="the quiet link dropped and back")
        assert link["chatty"].state == LinkState.CONNECTED
        seq[0] += 1
        await send("summaries", p.Summary(node=p.Text("summaries"), seq=seq[0], ts=now[0], every=5.0))
        assert link["summaries"].state == LinkState.CONNECTED  # a frame brings a stale link back at once
    finally:
        await fleet.stop()
        for server in servers:
            server.close()


async def test_a_stall_of_the_consoles_own_loop_drops_no_link(keys) -> None:
    """The console's process stalls (a busy host, a long GC, a paused VM) for longer than a link may be silent:
    the frames of that time wait unread, so no healthy node's stream is cut for it; silence counts again after."""
    now, hellos, outboxes, received, servers, fleet = await _agents_and_fleet(keys, ["quiet", "chatty"])
    await fleet.start()
    try:
        await wait_until(lambda: len(hellos) == 2 and all(l.state == LinkState.CONNECTED for l in fleet.links.values()),
                         what="two links up")
        link = {l.name: l for l in fleet.links.values()}
        now[0] += 20.0  # past 10 x 1 s: a silence that would drop either link ...
        time.sleep(1.0)  # ... all of it spent with this loop stalled (the fault under test, not a wait)
        count = len(received)
        outboxes["chatty"].put_nowait(p.Sample(node=p.Text("chatty"), seq=1, ts=now[0]))
        await wait_until(lambda: len(received) > count, what="chatty's frame after the stall")
        assert link["quiet"].state == LinkState.CONNECTED and hellos == {"quiet": 1, "chatty": 1}
        # From the stall on, silence counts again: the quiet link is stale after three more of its intervals.
        now[0] += 3.5
        await wait_until(lambda: link["quiet"].state == LinkState.STALE, what="the quiet link stale after the stall")
        assert hellos["quiet"] == 1
    finally:
        await fleet.stop()
        for server in servers:
            server.close()
