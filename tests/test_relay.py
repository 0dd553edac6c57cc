"""The relay tier: real agents, a real relay and a console, all over real SSH on loopback."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncssh
import msgspec
import pytest
from loguru import logger

from gridwatch.relay.service import Relay, RelayKeys
from gridwatch.sshlink.client import Fleet, FleetOptions, LinkState
from gridwatch.sshlink.hostlist import Endpoint
from gridwatch.wire import protocol as p
from tests.conftest import PYTHON, ROOT, RunningAgent, free_port, spawn_agent, start_agent, wait_until, wait_until_async
from tests.support_relay import action_events, endpoint, spawn_relay, stop
from tests.support_stream import fake_agent


@dataclass
class Console:
    """A console's Fleet whose nodes are all carried by relays, and what it received per node."""

    fleet: Fleet
    frames: dict[str, list[p.Frame]] = field(default_factory=lambda: defaultdict(list))

    def of(self, node: str, cls: type) -> list:
        return [f for f in self.frames[node] if isinstance(f, cls)]

    def seqs(self, node: str) -> list[int]:
        return [f.seq for f in self.frames[node] if f.seq and not isinstance(f, p.Hello)]


def console(keys, relays: dict[Endpoint, list[Endpoint]], key: Path | None = None, **opts) -> Console:
    c: Console
    opts.setdefault("relay_flush", 0.1)
    fleet = Fleet([], FleetOptions(key_path=str(key or keys.operator_key), known_hosts=str(keys.known_hosts),
                                   backoff_min=0.05, backoff_max=0.3, **opts),
                  on_frame=lambda link, f: c.frames[link.name].append(f), relays=relays)
    c = Console(fleet)
    return c


@pytest.fixture
async def nodes(keys, tmp_path) -> AsyncIterator[list[RunningAgent]]:
    from gridwatch.agent.logs import LogTailer

    # node-2 tails a log, so a search has something to find there.
    (tmp_path / "node-2.log").write_text("")
    tailer = LogTailer([str(tmp_path / "node-2.log")], kernel=False)
    agents = [await start_agent(keys, name=f"node-{i}", interval=0.1, tailer=tailer if i == 2 else None) for i in (1, 2, 3)]
    yield agents
    for ra in agents:
        await stop(ra)


@pytest.fixture
async def relay(keys, nodes) -> AsyncIterator[tuple[Relay, Endpoint]]:
    r = Relay(name="rack1", nodes=[endpoint(ra) for ra in nodes], keys=RelayKeys.from_dir(keys.dir),
              backoff_min=0.05, backoff_max=0.3)
    port = await r.start("127.0.0.1", 0)
    yield r, Endpoint("127.0.0.1", port)
    await r.close()


def pause(agents: list[RunningAgent]) -> None:
    """Stop the agents' ticks (their sessions stay): what they sent so far can then be counted to the end."""
    for ra in agents:
        ra.task.cancel()


async def test_summaries_of_three_nodes_arrive_through_one_relay_every_frame_counted(keys, nodes, relay):
    r, relay_ep = relay
    c = console(keys, {relay_ep: [endpoint(ra) for ra in nodes]}, mode=p.StreamMode.SUMMARY, relay_flush=0.5)
    await c.fleet.start()
    try:
        names = ("node-1", "node-2", "node-3")
        await wait_until(lambda: all(len(c.of(n, p.Summary)) >= 10 for n in names), 15, "ten summaries of each node")
        status = c.fleet.relays[relay_ep]
        assert status.state == LinkState.CONNECTED and status.name == "rack1" and status.role == "operator"
        assert all(link.via == relay_ep and link.state == LinkState.CONNECTED for link in c.fleet.links.values())
        assert not any(c.of(n, p.Sample) for n in names)
        pause(nodes)
        # The agents' own count of what they sent the relay's session == what the console counted, gaps 0.
        sent = {ra.agent.node: next(iter(ra.agent.clients)).sent for ra in nodes}

        def counted() -> bool:
            sent.update({ra.agent.node: next(iter(ra.agent.clients)).sent for ra in nodes})
            return all(c.fleet.find(n).frames == sent[n] for n in names)

        await wait_until(counted, 10, "the console to count every frame the agents sent")
        for ra, n in zip(nodes, names):
            link = c.fleet.find(n)
            assert link.gaps == 0 and link.bad_frames == 0 and link.foreign_frames == 0
            seqs = c.seqs(n)
            assert seqs == list(range(seqs[0], ra.agent.ring.last_seq + 1))
        # One write carries many nodes' frames: that is what a relay is for.
        assert r.counts.writes * 3 < r.counts.frames, r.counts
    finally:
        await c.fleet.stop()


# The first line of tests/data/logcorpus/kernel.jsonl, which names its source (gpud's testdata, dmesg-with-xid-119.log).
KERNEL_LINE = json.loads((ROOT / "tests/data/logcorpus/kernel.jsonl").read_text().splitlines()[0])["line"]


async def test_an_xid_an_operators_actions_and_a_search_go_through_the_relay(keys, nodes, relay, tmp_path):
    _, relay_ep = relay
    c = console(keys, {relay_ep: [endpoint(ra) for ra in nodes]}, mode=p.StreamMode.SUMMARY)
    heard: list[str] = []
    sink = logger.add(lambda m: heard.append(m.record["message"]), level="INFO")
    await c.fleet.start()
    try:
        await wait_until(lambda: c.fleet.connected == 3 and c.of("node-2", p.Summary), 15, "three nodes through the relay")
        assert c.fleet.find("node-2").role == "operator"
        res = await c.fleet.action("node-2", "inject_fault", {"kind": "xid", "code": 79, "gpu": 1}, reason="drill")
        assert res.ok, res.message
        xid = await wait_until(lambda: [e for e in c.of("node-2", p.Event) if e.kind == "xid" and e.code == 79], 10,
                               "the XID at the console")
        assert xid[0].gpu == 1 and xid[0].node == "node-2"
        assert not any(e.kind == "xid" for n in ("node-1", "node-3") for e in c.of(n, p.Event))
        res = await c.fleet.action("node-2", "isolate", reason="xid 79 on gpu 1")
        assert res.ok, res.message
        assert nodes[1].agent.isolated and not nodes[0].agent.isolated
        # The agent's record says what was done; the relay's log says who asked.
        assert len(action_events(nodes[1], "isolate")) == 1 and action_events(nodes[1], "inject_fault")
        assert any("action isolate on node-2" in line and "xid 79 on gpu 1" in line for line in heard)
        with (tmp_path / "node-2.log").open("a") as log:
            log.write(KERNEL_LINE + "\n")

        async def found() -> list[p.LogLine]:
            return await c.fleet.search("GSP_RM_ALLOC", timeout=3)

        lines = await wait_until_async(found, 10, "the log line found through the relay")
        assert [(line.node, line.line) for line in lines] == [("node-2", KERNEL_LINE)]
    finally:
        logger.remove(sink)
        await c.fleet.stop()


async def test_a_viewer_at_the_relay_may_watch_and_ping_but_not_act(keys, nodes, relay):
    _, relay_ep = relay
    c = console(keys, {relay_ep: [endpoint(nodes[0])]}, key=keys.viewer_key, mode=p.StreamMode.SUMMARY)
    await c.fleet.start()
    try:
        await wait_until(lambda: c.of("node-1", p.Summary), 15, "a summary through the relay")
        # The relay's key is an operator's at the agent; through the relay this console is a viewer.
        assert c.fleet.relays[relay_ep].role == "viewer" and c.fleet.find("node-1").role == "viewer"
        res = await c.fleet.action("node-1", "isolate", reason="test")
        assert not res.ok and "the relay took a viewer's key" in res.message
        assert not nodes[0].agent.isolated and not action_events(nodes[0], "isolate")
        pong = await c.fleet.action("node-1", "ping")
        assert pong.ok, pong.message
    finally:
        await c.fleet.stop()


async def test_opening_a_node_and_new_watches_pass_through_the_relay(keys, nodes, relay):
    r, relay_ep = relay
    c = console(keys, {relay_ep: [endpoint(ra) for ra in nodes[:2]]}, mode=p.StreamMode.SUMMARY)
    await c.fleet.start()
    try:
        await wait_until(lambda: c.of("node-1", p.Summary) and c.of("node-2", p.Summary), 15, "summaries")
        c.fleet.subscribe_full("node-1", True)
        await wait_until(lambda: len(c.of("node-1", p.Sample)) >= 3, 10, "full samples of the node opened")
        (session,) = r.sessions
        assert session.fleet is not None and session.fleet.links[endpoint(nodes[0])].want_full  # asked again on a reconnect
        assert not c.of("node-2", p.Sample)
        # New watches reach every node the relay carries for this console, in the same session.
        c.fleet.set_watches([p.Watch(name=p.Text("warm"), metric=p.Text("gpu.temperature"), op=p.Text(">"), threshold=-273.0)])

        def held(node: str) -> bool:
            return any(e.kind == "condition_held" and e.details.get("playbook") == "warm" for e in c.of(node, p.Event))

        await wait_until(lambda: held("node-1") and held("node-2"), 10, "the watch holding on both nodes")
        assert r.counts.sessions == 1 and all(link.gaps == 0 for link in c.fleet.links.values())
    finally:
        await c.fleet.stop()


async def test_a_node_not_on_the_relays_list_is_refused_in_one_line(keys, nodes):
    r = Relay(name="rack1", nodes=[endpoint(nodes[0])], keys=RelayKeys.from_dir(keys.dir))
    port = await r.start("127.0.0.1", 0)
    c = console(keys, {Endpoint("127.0.0.1", port): [endpoint(nodes[0]), endpoint(nodes[1])]})
    await c.fleet.start()
    try:
        outsider = c.fleet.links[endpoint(nodes[1])]
        await wait_until(lambda: outsider.state == LinkState.REFUSED, 15, "the node off the relay's list refused")
        assert "not one of this relay's nodes" in outsider.last_error and "\n" not in outsider.last_error
        assert str(endpoint(nodes[1])) in outsider.last_error
        await wait_until(lambda: c.of("node-1", p.Sample), 10, "the listed node's samples")
        assert not any(ra.agent.clients for ra in nodes[1:])  # the relay never linked to it
    finally:
        await c.fleet.stop()
        await r.close()


async def _raw_session(keys, port: int) -> tuple[asyncssh.SSHClientConnection, asyncssh.SSHClientProcess]:
    conn = await asyncssh.connect("127.0.0.1", port, username="x", client_keys=[str(keys.operator_key)],
                                  known_hosts=str(keys.known_hosts), agent_path=None, config=None)
    proc = await conn.create_process(subsystem=p.SUBSYSTEM, encoding=None)
    return conn, proc


async def _read_until(proc: asyncssh.SSHClientProcess, got: list[p.Frame], cond, what: str) -> None:
    async def more() -> None:
        buf = b""
        while not cond(got):
            data = await proc.stdout.read(65536)
            if not data:
                return
            buf += data
            *lines, buf = buf.split(b"\n")
            got.extend(p.decode_agent_frame(line) for line in lines if line)

    await asyncio.wait_for(more(), 10)
    assert cond(got), what


async def test_a_malformed_line_gets_an_error_and_the_session_lives(keys, nodes, relay):
    r, relay_ep = relay
    conn, proc = await _raw_session(keys, relay_ep.port)
    try:
        got: list[p.Frame] = []
        await _read_until(proc, got, lambda g: g, "the relay's hello")
        assert isinstance(got[0], p.Hello) and got[0].relay and got[0].node == "rack1" and got[0].role == "operator"
        proc.stdin.write(b'{"type": "relay_subscribe", "nodes": [\n')
        await _read_until(proc, got, lambda g: any(isinstance(f, p.Error) for f in g), "an error for the bad line")
        assert next(f for f in got if isinstance(f, p.Error)).code == "bad_frame"
        sub = p.RelaySubscribe(nodes=[p.RelayNode(endpoint=p.Text(str(endpoint(nodes[2]))))], mode=p.StreamMode.SUMMARY)
        proc.stdin.write(p.encode(sub))
        proc.stdin.write(p.encode(p.Relayed(endpoint=p.Text(str(endpoint(nodes[2]))), frame=msgspec.Raw(b'{"type":"act'))))

        def relayed_summaries(g: list[p.Frame]) -> list[p.Frame]:
            inner = [p.decode_agent_frame(bytes(f.frame)) for f in g if isinstance(f, p.Relayed)]
            return [f for f in inner if isinstance(f, p.Summary)]

        await _read_until(proc, got, lambda g: len(relayed_summaries(g)) >= 3, "summaries after the bad lines")
        assert all(f.node == "node-3" for f in relayed_summaries(got))
        assert sum(isinstance(f, p.Error) for f in got) == 2 and r.counts.bad_lines == 2
    finally:
        conn.close()


async def test_anything_but_relay_subscribe_first_is_an_error_and_the_end(keys, relay):
    _, relay_ep = relay
    conn, proc = await _raw_session(keys, relay_ep.port)
    try:
        got: list[p.Frame] = []
        await _read_until(proc, got, lambda g: g, "the relay's hello")
        proc.stdin.write(p.encode(p.Subscribe(mode=p.StreamMode.SUMMARY)))
        rest = await asyncio.wait_for(proc.stdout.read(), 10)
        errors = [p.decode_agent_frame(line) for line in rest.splitlines() if line]
        assert [e.code for e in errors] == ["relay_subscribe_first"]
        assert "send relay_subscribe first" in errors[0].message
        # Like an agent, a relay serves its subsystem and nothing else.
        result = await conn.run("cat /etc/passwd")
        assert result.exit_status == 1 and "only the 'gridwatch' subsystem" in result.stderr
    finally:
        conn.close()


async def test_a_console_that_stops_reading_is_let_go(keys, tmp_path):
    ra = await start_agent(keys, name="node-1", gpus=8, interval=0.05)
    r = Relay(name="rack1", nodes=[endpoint(ra)], keys=RelayKeys.from_dir(keys.dir), max_unsent=256 << 10)
    heard: list[str] = []
    sink = logger.add(lambda m: heard.append(m.record["message"]), level="WARNING")
    port = await r.start("127.0.0.1", 0)
    conn = await asyncssh.connect("127.0.0.1", port, username="x", client_keys=[str(keys.operator_key)],
                                  known_hosts=str(keys.known_hosts), agent_path=None, config=None)
    try:
        # A console that asks for full samples and never reads them: SSH's window fills, then the relay's buffer.
        chan, _session = await conn.create_session(asyncssh.SSHClientSession, subsystem=p.SUBSYSTEM, encoding=None,
                                                   window=16384, max_pktsize=16384)
        chan.pause_reading()
        sub = p.RelaySubscribe(nodes=[p.RelayNode(endpoint=p.Text(str(endpoint(ra))))], mode=p.StreamMode.FULL, flush=0.05)
        chan.write(p.encode(sub))
        await wait_until(lambda: r.counts.dropped_sessions == 1, 30, "the relay to let the console go")
        await wait_until(lambda: not r.sessions and not ra.agent.clients, 10, "its links to end with it")
        assert any("it is not reading" in line for line in heard)
    finally:
        logger.remove(sink)
        conn.close()
        await r.close()
        await stop(ra)


async def test_a_relay_killed_and_restarted_loses_no_frame(keys, nodes, tmp_path):
    port = free_port()
    spec = ",".join(str(endpoint(ra)) for ra in nodes)
    log = tmp_path / "relay.log"
    proc = spawn_relay(keys, port, spec, log)
    relay_ep = Endpoint("127.0.0.1", port)
    c = console(keys, {relay_ep: [endpoint(ra) for ra in nodes]})
    names = ("node-1", "node-2", "node-3")
    try:
        await wait_until(lambda: "listening on 127.0.0.1:" in log.read_text(), 15, "the relay to listen")
        await c.fleet.start()
        await wait_until(lambda: all(len(c.of(n, p.Sample)) >= 3 for n in names), 15, "samples through the relay")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        links = [c.fleet.find(n) for n in names]
        await wait_until(lambda: all(link.state == LinkState.DOWN for link in links), 10, "the links down")
        assert all(str(relay_ep) in link.last_error and "relay" in link.last_error for link in links)
        # The agents go on numbering frames while no relay carries them: the console must get those too.
        await wait_until(lambda: all(ra.agent.ring.last_seq > c.fleet.find(n).last_seq + 3 for ra, n in zip(nodes, names)),
                         10, "frames waiting in the agents' rings")
        before = [len(c.seqs(n)) for n in names]
        proc = spawn_relay(keys, port, spec, log)
        await wait_until(lambda: all(link.state == LinkState.CONNECTED for link in links), 20, "the links back")
        await wait_until(lambda: all(len(c.seqs(n)) > b + 3 for n, b in zip(names, before)), 10, "frames after the restart")
        pause(nodes)
        await wait_until(lambda: all(c.fleet.find(n).last_seq == ra.agent.ring.last_seq for ra, n in zip(nodes, names)),
                         10, "every frame the agents numbered")
        for ra, n in zip(nodes, names):
            seqs, link = c.seqs(n), c.fleet.find(n)
            # Every frame the agent sent from the first the console saw, once, across the relay's death.
            assert seqs == list(range(seqs[0], ra.agent.ring.last_seq + 1)), n
            assert link.gaps == 0 and link.bad_frames == 0
    finally:
        await c.fleet.stop()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0, log.read_text()[-2000:]


async def test_an_agent_restarted_behind_the_relay_is_read_from_its_first_frame(keys, tmp_path):
    port = free_port()
    agent = spawn_agent(keys, port, "node-9")
    ep = Endpoint("127.0.0.1", port)
    r = Relay(name="rack1", nodes=[ep], keys=RelayKeys.from_dir(keys.dir), backoff_min=0.05, backoff_max=0.3)
    c = console(keys, {Endpoint("127.0.0.1", await r.start("127.0.0.1", 0)): [ep]})
    await c.fleet.start()
    try:
        await wait_until(lambda: len(c.of("node-9", p.Sample)) >= 3, 20, "samples of the first boot")
        link = c.fleet.find("node-9")
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        first_boot = len(c.frames["node-9"])
        agent = spawn_agent(keys, port, "node-9")
        await wait_until(lambda: link.restarts == 1 and len(c.of("node-9", p.Sample)) > first_boot, 20,
                         "samples of the second boot")
        new_boot = [f.seq for f in c.frames["node-9"][first_boot:] if isinstance(f, p.Sample)]
        # The new boot from its first frame, each frame once; the restart seen once, by the console.
        assert new_boot[0] <= 2 and new_boot == list(range(new_boot[0], new_boot[-1] + 1))
        restarts = [f for f in c.of("node-9", p.Gap) if "agent restarted" in f.reason]
        assert len(restarts) == 1 and link.state == LinkState.CONNECTED
    finally:
        await c.fleet.stop()
        await r.close()
        agent.send_signal(signal.SIGTERM)
        agent.wait(10)


def test_relay_help_and_a_bad_relay_toml_key(tmp_path):
    run = subprocess.run([PYTHON, "-m", "gridwatch", "relay", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and "--nodes" in run.stdout and "--keys" in run.stdout
    toml = tmp_path / "relay.toml"
    toml.write_text('listen = "127.0.0.1:8023"\nnodes = "node[1-4]:8022"\nflush_every = 1\n')
    run = subprocess.run([PYTHON, "-m", "gridwatch", "relay", "--config", str(toml)], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 2
    assert str(toml) in run.stderr and "flush_every" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    toml.write_text('listen = "127.0.0.1:8023"\nnodes = "node[4-1]"\n')
    run = subprocess.run([PYTHON, "-m", "gridwatch", "relay", "--config", str(toml)], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 2 and f"{toml}: nodes:" in run.stderr and "backwards" in run.stderr


async def test_behind_a_relay_each_console_key_keeps_its_own_role_and_request_budget(keys):
    """The agent caps and budgets a relayed request by the console key behind the relay, not the relay's:
    a viewer gets no operator pre-flight, and its pings do not use up the operator's requests."""
    ra = await start_agent(keys, name="node-1", action_burst=3, action_rate=0.01)
    r = Relay(name="rack1", nodes=[endpoint(ra)], keys=RelayKeys.from_dir(keys.dir), backoff_min=0.05, backoff_max=0.3)
    relay_ep = Endpoint("127.0.0.1", await r.start("127.0.0.1", 0))
    viewer = console(keys, {relay_ep: [endpoint(ra)]}, key=keys.viewer_key, mode=p.StreamMode.SUMMARY)
    operator = console(keys, {relay_ep: [endpoint(ra)]}, mode=p.StreamMode.SUMMARY)
    await viewer.fleet.start()
    await operator.fleet.start()
    try:
        await wait_until(lambda: viewer.of("node-1", p.Summary) and operator.of("node-1", p.Summary), 15,
                         "summaries to both consoles")
        pong = await viewer.fleet.action("node-1", "ping")
        assert pong.ok and pong.data["role"] == "viewer"  # the agent answers the viewer behind the relay
        comm = {"master_addr": "127.0.0.1", "master_port": 29999, "rank": 0, "world": 2}
        pre = await viewer.fleet.action("node-1", "preflight", args={"checks": ["comm"], "comm": comm})
        assert not pre.ok and "needs the operator role; this key is a viewer" in pre.message
        answers = [await viewer.fleet.action("node-1", "ping") for _ in range(3)]
        assert not answers[-1].ok and "over its budget" in answers[-1].message  # the viewer's budget is spent ...
        res = await operator.fleet.action("node-1", "isolate", reason="test")
        assert res.ok, res.message  # ... the operator's is its own
        assert ra.agent.isolated
    finally:
        await viewer.fleet.stop()
        await operator.fleet.stop()
        await r.close()
        await stop(ra)


async def test_a_relay_down_is_the_relays_silence_not_a_lost_heartbeat_for_each_node_behind_it(keys, nodes):
    """The console's engine on a hand-moved clock: a minute with the relay gone opens no heartbeat-lost for
    the nodes behind it, and once it is back their silence counts from then."""
    from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
    from gridwatch.playbooks.clock import ManualClock

    carried = [endpoint(ra) for ra in nodes]
    first = Relay(name="rack1", nodes=carried, keys=RelayKeys.from_dir(keys.dir), backoff_min=0.05, backoff_max=0.3)
    port = await first.start("127.0.0.1", 0)
    clock = ManualClock(1000.0)
    runtime = build_runtime(RuntimeOptions(endpoints=[], relays={Endpoint("127.0.0.1", port): carried},
                                           key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts),
                                           backoff_max=0.3, tick_interval=0), clock=clock)
    await runtime.start()
    second = None

    def heartbeats() -> list:
        return [i for i in runtime.engine.incidents() if i.kind == "heartbeat_lost"]

    try:
        await wait_until(lambda: len(runtime.engine.nodes) == 3, 15, "three nodes through the relay")
        await first.close()
        await wait_until(lambda: runtime.relays_down, 10, "the console to see the relay down")
        clock.advance(60.0)
        runtime.tick_engine()
        assert heartbeats() == []
        assert "3 nodes behind it" in runtime.relay_alert  # the relay's line says it for them
        second = Relay(name="rack1", nodes=carried, keys=RelayKeys.from_dir(keys.dir), backoff_min=0.05,
                       backoff_max=0.3)
        await second.start("127.0.0.1", port)
        await wait_until(lambda: not runtime.relays_down, 15, "the relay back")
        clock.advance(0.2)  # under three of the nodes' 0.1 s heartbeats since the relay came back
        runtime.tick_engine()
        assert heartbeats() == []  # silence counts from the relay's return, not from the last frame before it
    finally:
        await runtime.stop()
        if second is not None:
            await second.close()


async def test_a_relay_passes_frames_on_as_written_and_the_console_still_judges_each(keys):
    """The relay reads a summary or an event only as far as its owner and order, and passes the agent's own line
    on: a frame naming another node stops at the relay, hostile text is cleaned by the console, and a frame the
    relay could order but not use is refused by the console as from any node."""
    def summary(seq: int, **fields: object) -> bytes:
        frame = {"v": 1, "type": "summary", "seq": seq, "ts": 1.0, "node": "odd", "after": seq - 1, "every": 1.0}
        return json.dumps({**frame, **fields}).encode() + b"\n"

    lines = [
        p.encode(p.Hello(node=p.Text("odd"), interval=0.1)),
        summary(1, trainer={"job": "\x1b]0;owned\x07\x1b[31mllm", "phase": "training", "step": 7}),
        summary(2, node="node-1"),  # another node's name: dropped at the relay
        summary(3, gpus="not a list"),  # ordered by the relay, refused by the console
        p.encode(p.Event(node=p.Text("odd"), seq=4, kind=p.Text("xid"), severity=p.Text("critical"),
                         message=p.Text("xid 79"))),
    ]

    async def session(process: asyncssh.SSHServerProcess) -> None:
        process.stdout.write(lines[0])
        await process.stdin.readline()  # the relay's subscribe
        process.stdout.write(b"".join(lines[1:]))
        await process.stdin.read()  # held open until the relay goes

    agent = await fake_agent(keys, session)
    node = Endpoint("127.0.0.1", agent.sockets[0].getsockname()[1])
    r = Relay(name="rack1", nodes=[node], keys=RelayKeys.from_dir(keys.dir), backoff_min=0.05, backoff_max=0.3)
    relay = Endpoint("127.0.0.1", await r.start("127.0.0.1", 0))
    c = console(keys, {relay: [node]}, mode=p.StreamMode.SUMMARY, summary_every=1.0)
    await c.fleet.start()
    try:
        await wait_until(lambda: c.of("odd", p.Event), what="the event through the relay")
        link = c.fleet.links[node]
        assert [f.seq for f in c.of("odd", p.Summary)] == [1]
        job = str(c.of("odd", p.Summary)[0].trainer.job)
        assert "\x1b" not in job and "\x07" not in job and job.endswith("llm")
        assert [str(e.kind) for e in c.of("odd", p.Event)] == ["xid"] and link.bad_frames == 1
        (session,) = r.sessions
        assert session.fleet is not None and session.fleet.links[node].foreign_frames == 1
    finally:
        await c.fleet.stop()
        await r.close()
        agent.close()
