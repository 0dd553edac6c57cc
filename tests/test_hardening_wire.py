"""The wire and the console's fleet under attack: escapes in keys and reasons, impostor agents, restarts, weak keys."""

from __future__ import annotations

import asyncio
import json
import signal
import unicodedata
from pathlib import Path
from typing import Any

import asyncssh
import msgspec
import pytest
from loguru import logger

from gridwatch.console.fleet.state import StateStore
from gridwatch.console.tui.screens import FleetScreen, TrainingScreen
from gridwatch.sshlink.client import Fleet, FleetOptions, LinkState, explain
from gridwatch.sshlink.hostlist import Endpoint, parse_endpoints
from gridwatch.wire import protocol as p
from tests.conftest import free_port, spawn_agent, start_agent, stop_agent, wait_until, wait_until_async
from tests.hostile_peer import CSI_CLEAR, OSC_CLIPBOARD, OSC_TITLE, contains_escape, hostile_peer
from tests.support_stream import fake_agent

ESC = "\x1b"
DCS = f"{ESC}P1$q\"p{ESC}\\"  # a DCS request; some terminals answer it or blank the screen
HOSTILE = [OSC_CLIPBOARD, OSC_TITLE, DCS, CSI_CLEAR, "\x9b2J", "\x9d0;c1\x9c", "\x90q\x9c"]


def hostile_key(i: int) -> str:
    return f"k{i}{HOSTILE[i % len(HOSTILE)]}"


def unclean(text: str) -> list[str]:
    """Characters that must not survive decoding: controls (C0, DEL, C1) and invisible format ones."""
    return [c for c in text if unicodedata.category(c) in ("Cc", "Cf")]


def walk_strings(value: Any, path: str = "frame") -> list[tuple[str, str]]:
    """Every string in a decoded value, dict keys included, with where it sits."""
    found: list[tuple[str, str]] = []
    if isinstance(value, str):
        found.append((path, value))
    elif isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            found += walk_strings(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, dict):
        for k, v in value.items():
            found += walk_strings(k, f"{path}[key]")
            found += walk_strings(v, f"{path}[{k!r}]")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += walk_strings(v, f"{path}[{i}]")
    return found


def hostile_frames() -> list[bytes]:
    """Raw lines a hostile agent (and a hostile console) can send, escapes in every dict key."""
    keys = {hostile_key(i): i for i in range(len(HOSTILE))}
    trainer = {
        "job": "job" + OSC_TITLE,
        "phase": "training",
        "step": 10,
        "loss": 1.0,
        "checkpoints": {**{k: 9 for k in keys}, "0": 9},
        "rank_step_times": {**{k: 0.5 for k in keys}, "0": 0.4},
        "membership": ["node-1" + DCS],
        "events": [{"type": "event", "kind": "nan_loss", "details": {k: k for k in keys}}],
    }
    return [
        json.dumps({"type": "sample", "node": "node-1", "seq": 1, "trainer": trainer}).encode(),
        json.dumps({"type": "hello", "node": "node-1", "stack": {"packages": {k: "1.0" + CSI_CLEAR for k in keys}}}).encode(),
        json.dumps({"type": "event", "node": "node-1", "kind": "xid", "details": {k: OSC_CLIPBOARD for k in keys}}).encode(),
        json.dumps({"type": "action_result", "id": "1", "action": "ping", "ok": True,
                    "data": {k: {k: [k, {k: k}]} for k in keys}}).encode(),
    ]


def test_no_escape_or_control_survives_decoding_in_any_string_dict_keys_included() -> None:
    for line in hostile_frames():
        frame = p.decode_agent_frame(line)
        strings = walk_strings(frame)
        assert any(path.endswith("[key]") for path, _ in strings)
        dirty = [(path, text) for path, text in strings if unclean(text)]
        assert not dirty, dirty
    client = json.dumps({"type": "action", "id": "1", "action": "ping", "args": {hostile_key(i): {hostile_key(i): 1} for i in range(7)}})
    dirty = [(path, text) for path, text in walk_strings(p.decode_client_frame(client)) if unclean(text)]
    assert not dirty, dirty


def test_zero_width_and_invisible_characters_are_dropped_from_node_names() -> None:
    invisible = ["\u200b", "\u200c", "\u200d", "\u200e", "\u200f", "\u2060", "\u2061", "\u2062", "\u2063", "\u2064",
                 "\ufeff", "\u00ad", "\u180e", "\u202e", "\u2066"]
    for ch in invisible:
        assert p.clean_text(f"node{ch}-1") == "node-1", repr(ch)
    hello = p.decode_agent_frame(json.dumps({"type": "hello", "node": "node\u200b-1\ufeff"}))
    assert hello.node == "node-1"


# ------------------------------------------------------------------ the :training view


def _assert_no_hostile_sequence(raw: str) -> None:
    # Styles are CSI SGR sequences of the terminal's own; none of the node's may be there.
    for seq in ("\x1b]52", "\x1b]0;", "\x1bP", "\x1b[2J", "\x07", "\x9b", "\x9d", "\x90", "\x9c"):
        assert seq not in raw, repr(seq)


async def _training_view_bytes(sample: p.Sample) -> tuple[str, str]:
    from tests.support_app import make_app, screen_text, shown, terminal_bytes, wait_for

    app = make_app(["node-1"])
    app.runtime.store.apply(sample)
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("training")
        await wait_for(pilot, lambda: shown(app, TrainingScreen))
        return screen_text(app), terminal_bytes(app)


async def test_training_view_shows_no_escape_from_hostile_checkpoint_and_rank_keys() -> None:
    frame = p.decode_agent_frame(hostile_frames()[0])
    assert isinstance(frame, p.Sample)
    text, raw = await _training_view_bytes(frame)
    _assert_no_hostile_sequence(raw)
    assert "k0]52;c;" in text  # the tier is shown, literally, without its ESC


async def test_widgets_strip_controls_even_from_text_that_skipped_decoding() -> None:
    # The last line: a status built in the console from dirty strings, never decoded.
    keys = {hostile_key(i): 9 for i in range(len(HOSTILE))}
    status = p.TrainerStatus(job=p.Text("job" + OSC_TITLE), phase=p.Text("training"), step=10, loss=1.0,
                             checkpoints=keys, rank_step_times={k: 0.5 for k in keys},
                             membership=[p.Text("node-1" + DCS)])
    text, raw = await _training_view_bytes(p.Sample(node=p.Text("node-1"), seq=50, trainer=status))
    _assert_no_hostile_sequence(raw)
    assert "k0]52;c;" in text and "job]0;pwned" in text


# ------------------------------------------------------------------------- nesting


def _deep(n: int) -> str:
    return '{"a":' * n + "1" + "}" * n


def test_a_frame_nested_600_deep_is_a_bad_frame_not_a_recursion_error() -> None:
    for decode, line in (
        (p.decode_agent_frame, f'{{"type":"action_result","id":"1","action":"ping","ok":true,"data":{_deep(600)}}}'),
        (p.decode_client_frame, f'{{"type":"action","id":"1","action":"ping","args":{{"x":[{_deep(600)}]}}}}'),
        (p.decode_agent_frame, f'{{"type":"action_result","id":"1","action":"ping","ok":true,"data":{"[" * 50000 + "]" * 50000}}}'),
    ):
        with pytest.raises(p.FrameError) as err:
            decode(line)
        assert err.value.code == "bad_frame"


async def test_an_agent_answers_a_deep_frame_with_bad_frame_and_keeps_serving(agent, keys) -> None:
    async with asyncssh.connect("127.0.0.1", agent.port, username="x", client_keys=[str(keys.operator_key)],
                                known_hosts=str(keys.known_hosts)) as conn:
        proc = await conn.create_process(subsystem="gridwatch", encoding=None)
        assert isinstance(p.decode_agent_frame(await proc.stdout.readline()), p.Hello)
        proc.stdin.write(f'{{"type":"action","id":"1","action":"ping","args":{_deep(600)}}}\n'.encode())
        proc.stdin.write(p.encode(p.Action(id=p.Text("2"), action=p.Text("ping"))))
        seen: list[p.Frame] = []
        while not any(isinstance(f, p.ActionResult) and f.id == "2" for f in seen):
            seen.append(p.decode_agent_frame(await asyncio.wait_for(proc.stdout.readline(), 5)))
        assert [str(f.code) for f in seen if isinstance(f, p.Error)] == ["bad_frame"]


async def test_the_console_counts_a_deep_frame_as_bad_and_the_session_goes_on(keys) -> None:
    async def script(process: Any) -> None:
        process.stdout.write(p.encode(p.Hello(node=p.Text("deep"))))
        process.stdout.write(f'{{"type":"action_result","id":"1","action":"ping","ok":true,"data":{_deep(600)}}}\n'.encode())
        process.stdout.write(p.encode(p.Event(node=p.Text("deep"), seq=1, kind=p.Text("xid"), code=79)))
        await process.stdout.drain()
        await asyncio.Event().wait()

    server = await fake_agent(keys, script)
    frames: list[p.Frame] = []
    fleet = Fleet(parse_endpoints(f"127.0.0.1:{server.sockets[0].getsockname()[1]}"),
                  FleetOptions(key_path=str(keys.viewer_key), known_hosts=str(keys.known_hosts)),
                  on_frame=lambda link, f: frames.append(f))
    await fleet.start()
    try:
        link = next(iter(fleet.links.values()))
        await wait_until(lambda: any(isinstance(f, p.Event) for f in frames), what="the event after the deep frame")
        assert link.bad_frames == 1 and link.state == LinkState.CONNECTED
    finally:
        await fleet.stop()
        server.close()


def test_replay_reports_a_deep_line_and_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gridwatch.console.cli import main
    from gridwatch.playbooks.trace import record_line

    t0 = 1_000_000.0
    good = [p.Hello(node=p.Text("n1"), ts=t0), p.Sample(node=p.Text("n1"), seq=1, ts=t0 + 1)]
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(
        record_line("127.0.0.1:1", good[0])
        + b'{"endpoint":"127.0.0.1:1","frame":{"type":"action_result","id":"1","action":"x","ok":true,"data":'
        + _deep(600).encode() + b"}}\n"
        + ("[" * 100_000 + "]" * 100_000 + "\n").encode()
        + record_line("127.0.0.1:1", good[1])
    )
    assert main(["playbook", "replay", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "replayed 2 frames of 4 lines" in out and "first at line 2" in out


# ----------------------------------------------------------------- SSH error reasons


async def test_a_disconnect_reason_full_of_escapes_is_never_logged_stored_or_shown_raw(keys) -> None:
    from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime

    logged: list[str] = []
    sink = logger.add(lambda message: logged.append(str(message)), level="DEBUG")
    try:
        with hostile_peer() as peer:
            runtime = build_runtime(RuntimeOptions(endpoints=parse_endpoints(peer.spec), key_path=str(keys.operator_key),
                                                   known_hosts=str(keys.known_hosts)))
            await runtime.start()
            try:
                link = next(iter(runtime.fleet.links.values()))
                await wait_until(lambda: link.last_error and "go away" in link.last_error, what="the peer's reason")
                node = runtime.store.nodes[peer.spec]
                await wait_until(lambda: node.link_error, what="the reason in the state")
            finally:
                await runtime.stop()
            assert peer.connections >= 1
    finally:
        logger.remove(sink)
    assert not contains_escape(link.last_error) and not contains_escape(node.link_error or "")
    assert "]0;pwned" in link.last_error  # said, literally, so the operator sees something was there
    said = [line.rstrip("\n") for line in logged if "go away" in line]
    assert said and not any(contains_escape(line) for line in said)
    # And every sentence explain() makes from a peer's text.
    ep = Endpoint("127.0.0.1", 1)
    for exc in (asyncssh.ProtocolError(f"x{OSC_TITLE}"), asyncssh.DisconnectError(2, f"x{CSI_CLEAR}"),
                asyncssh.ChannelOpenError(1, f"x{OSC_CLIPBOARD}"), OSError(5, f"x{OSC_TITLE}"), ValueError(f"x{DCS}")):
        _, message = explain(ep, exc, "kh")
        assert not contains_escape(message), (exc, message)


# ------------------------------------------------------------------ impostor agents


def _hostile_publish(agent: Any, claim: str) -> None:
    """Make a real agent stamp every stream frame with another node's name."""

    def publish(frame: p.Frame) -> int:
        frame.seq = agent.ring.last_seq + 1
        frame.ts = agent.clock()
        frame.node = p.Text(claim)
        agent.ring.append(p.encode(frame))
        for client in agent.clients:
            if client.subscribed:
                client.wake.set()
        return frame.seq

    agent.publish = publish


async def test_an_agent_cannot_raise_an_xid_in_another_nodes_name(keys) -> None:
    from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime

    healthy = await start_agent(keys, name="node-1")
    hostile = await start_agent(keys, name="node-2")
    _hostile_publish(hostile.agent, "node-1")
    runtime = build_runtime(RuntimeOptions(endpoints=parse_endpoints(f"{healthy.spec},{hostile.spec}"),
                                           key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts)))
    await runtime.start()
    try:
        links = runtime.fleet.links
        good, bad = links[Endpoint("127.0.0.1", healthy.port)], links[Endpoint("127.0.0.1", hostile.port)]
        await wait_until(lambda: good.state == LinkState.CONNECTED and bad.state == LinkState.CONNECTED, what="both links")
        hostile.agent.publish(p.Event(kind=p.Text("xid"), code=79, gpu=0, severity=p.Text("critical"),
                                      message=p.Text("Xid 79: GPU has fallen off the bus"), source=p.Text("nvml")))
        state = runtime.store.nodes[healthy.spec]

        def against_node_1() -> list[Any]:
            return [i for i in runtime.engine.incidents(include_closed=True) if i.node == "node-1"]

        # Until the console has decided: the impostor's frames dropped, or its xid taken in.
        await wait_until(lambda: getattr(bad, "foreign_frames", 0) >= 3 or against_node_1(), what="the impostor's frames handled")
        await wait_until(lambda: good.frames >= 5, what="the healthy node streaming on")
        assert not against_node_1()
        assert not [r for r in runtime.store.events if r.event.kind == "xid"] and not state.xids
        assert not state.isolated and not healthy.agent.isolated
        assert bad.name == "node-2" and good.name == "node-1"
        assert "claimed to come from 'node-1'" in (bad.last_error or "")
        assert runtime.store.nodes[hostile.spec].link_error and "claimed" in runtime.store.nodes[hostile.spec].link_error
    finally:
        await runtime.stop()
        await stop_agent(healthy)
        await stop_agent(hostile)


async def test_two_links_claiming_one_name_the_second_is_refused(keys) -> None:
    first = await start_agent(keys, name="node-1")
    second = await start_agent(keys, name="node-1")
    frames: list[tuple[Endpoint, p.Frame]] = []
    fleet = Fleet(parse_endpoints(f"{first.spec},{second.spec}"),
                  FleetOptions(key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts), backoff_min=0.05, backoff_max=0.3),
                  on_frame=lambda link, f: frames.append((link.endpoint, f)))
    await fleet.start()
    try:
        links = list(fleet.links.values())

        def held_and_refused() -> tuple[Any, Any] | None:
            # One look at both links: the refused one is retried (the holder may go away), so it can
            # be between attempts on any later look.
            held = [l for l in links if l.state == LinkState.CONNECTED]
            refused = [l for l in links if l.state == LinkState.REFUSED]
            return (held[0], refused[0]) if len(held) == 1 and len(refused) == 1 else None

        await wait_until(lambda: len(frames) >= 5 and held_and_refused(), what="one link held, one refused")
        held, refused = held_and_refused() or await wait_until(held_and_refused, what="one held, one refused")
        assert refused.hello is None and refused.name == str(refused.endpoint)
        assert f"which the agent at {held.endpoint} already is" in refused.last_error
        assert {ep for ep, _ in frames} == {held.endpoint}
        assert fleet.find("node-1") is held
    finally:
        await fleet.stop()
        await stop_agent(first)
        await stop_agent(second)


# -------------------------------------------------------------------- agent restart


async def _operator_session(keys: Any, port: int) -> tuple[asyncssh.SSHClientConnection, Any]:
    """A direct operator connection to an agent that is still starting."""
    conn: list[asyncssh.SSHClientConnection] = []

    async def attempt() -> None:
        try:
            conn.append(await asyncssh.connect("127.0.0.1", port, username="x", client_keys=[str(keys.operator_key)],
                                               known_hosts=str(keys.known_hosts)))
        except OSError:
            pass

    async def connected() -> bool:
        await attempt()
        return bool(conn)

    await wait_until_async(connected, timeout=20, what="the restarted agent to answer")
    proc = await conn[0].create_process(subsystem="gridwatch", encoding=None)
    assert isinstance(p.decode_agent_frame(await asyncio.wait_for(proc.stdout.readline(), 10)), p.Hello)
    return conn[0], proc


async def _read_until(proc: Any, cond: Any) -> p.Frame:
    while True:
        frame = p.decode_agent_frame(await asyncio.wait_for(proc.stdout.readline(), 10))
        if cond(frame):
            return frame


@pytest.mark.parametrize("past", [True, False], ids=["new-seq-past-the-console", "new-seq-behind-the-console"])
async def test_an_event_raised_right_after_an_agent_restart_arrives_and_the_gap_is_recorded(keys, tmp_path, past) -> None:
    port = free_port()
    proc = spawn_agent(keys, port, "node-r", log=tmp_path / "agent.log")
    frames: list[p.Frame] = []
    fleet = Fleet(parse_endpoints(f"127.0.0.1:{port}"),
                  FleetOptions(key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts), backoff_min=0.05, backoff_max=0.3),
                  on_frame=lambda link, f: frames.append(f))
    await fleet.start()
    try:
        link = next(iter(fleet.links.values()))
        await wait_until(lambda: link.state == LinkState.CONNECTED and link.last_seq >= (3 if past else 12), timeout=20,
                         what="the first boot streaming")
        old_boot = str(link.hello.boot_id)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        await wait_until(lambda: link.state == LinkState.DOWN, what="down")
        await fleet.stop()  # the console comes back once the new boot has moved on
        seen = link.last_seq
        proc = spawn_agent(keys, port, "node-r", log=tmp_path / "agent2.log")
        conn, session = await _operator_session(keys, port)
        try:
            session.stdin.write(p.encode(p.Action(id=p.Text("f"), action=p.Text("inject_fault"),
                                                  args={"kind": "xid", "code": 79, "gpu": 1})))
            result = await _read_until(session, lambda f: isinstance(f, p.ActionResult))
            assert result.ok, result.message
            session.stdin.write(p.encode(p.Subscribe(resume_from=0)))
            xid = await _read_until(session, lambda f: isinstance(f, p.Event) and f.kind == "xid")
            await _read_until(session, lambda f: f.seq > (seen + 2 if past else xid.seq + 2))
        finally:
            conn.close()
        if not past:
            assert xid.seq < seen
        n = len(frames)
        await fleet.start()
        await wait_until(lambda: any(isinstance(f, p.Event) and f.kind == "xid" and f.code == 79 for f in frames[n:]),
                         timeout=20, what="the xid raised right after the restart")
        assert str(link.hello.boot_id) != old_boot and link.restarts == 1
        assert link.last_gap == f"agent restarted: frames after seq {seen} of the old boot were never delivered"
        gaps = [f for f in frames[n:] if isinstance(f, p.Gap)]
        assert gaps and "agent restarted" in gaps[0].reason
        store = StateStore()
        for f in frames:
            store.apply(f, "127.0.0.1")
        assert "agent restarted" in (store.nodes["127.0.0.1"].last_gap or "")
    finally:
        await fleet.stop()
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------------ weak keys


async def test_an_agent_with_a_1024_bit_rsa_host_key_is_refused_even_when_pinned(keys, tmp_path) -> None:
    weak = asyncssh.generate_private_key("ssh-rsa", key_size=1024)

    async def script(process: Any) -> None:
        process.stdout.write(p.encode(p.Hello(node=p.Text("weak"))))
        await process.stdout.drain()
        await asyncio.Event().wait()

    server = await fake_agent(keys, script, host_key=weak)
    port = server.sockets[0].getsockname()[1]
    known = tmp_path / "known_hosts"
    known.write_bytes(f"[127.0.0.1]:{port} ".encode() + weak.export_public_key("openssh"))
    frames: list[p.Frame] = []
    fleet = Fleet(parse_endpoints(f"127.0.0.1:{port}"), FleetOptions(key_path=str(keys.viewer_key), known_hosts=str(known)),
                  on_frame=lambda link, f: frames.append(f))
    await fleet.start()
    try:
        link = next(iter(fleet.links.values()))
        await wait_until(lambda: link.state == LinkState.REFUSED, what="refused")
        assert "a 1024-bit RSA key (at least 2048 bits are required)" in link.last_error
        assert not frames
    finally:
        await fleet.stop()
        server.close()
