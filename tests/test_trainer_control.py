"""The trainer's control socket as the node agent sees it: status out, controls in, bad input refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gridwatch.trainer.control_server import ControlServer
from gridwatch.wire.control import events_after, restart_target
from gridwatch.wire.controlsock import SOCKET_ENV, TrainerUnavailable, read_status, request, socket_path
from gridwatch.wire.protocol import Event, Text, TrainerStatus


@pytest.fixture
def server(tmp_path: Path):
    status = TrainerStatus(
        phase=Text("training"), step=7, loss=2.5, world_size=2, node=Text("node-1"),
        events=[Event(kind=Text("straggler"), seq=3, message=Text("rank 1 slow \x1b[31m"))],
    )
    srv = ControlServer(str(tmp_path / "control" / "node-1.sock"), lambda: status, "node-1")
    srv.start()
    yield srv
    srv.stop()


async def test_status_round_trip_cleans_node_text(server: ControlServer) -> None:
    status = await read_status(server.path)
    assert status.step == 7 and status.phase == "training" and status.world_size == 2
    assert "\x1b" not in status.events[0].message
    assert [e.seq for e in events_after(status, 2)] == [3] and events_after(status, 3) == []


async def test_controls_are_queued_for_the_loop(server: ControlServer) -> None:
    for cmd in ("pause", "resume", "checkpoint_now", "leave"):
        reply = await request(server.path, cmd)
        assert reply.ok, reply.message
    reply = await request(server.path, "restart_from", {"checkpoint": "tier1:step-00000040"})
    assert reply.ok
    taken = server.take()
    assert [r.cmd for r in taken] == ["pause", "resume", "checkpoint_now", "leave", "restart_from"]
    assert restart_target(taken[-1].args).step == 40
    assert server.take() == []


async def test_garbage_and_unknown_commands_get_one_line_errors(server: ControlServer) -> None:
    reader, writer = await asyncio.open_unix_connection(server.path)
    for line in (b"not json at all\n", b'{"cmd": "format_disk"}\n', b'{"cmd": "restart_from", "args": {}}\n', b"[1,2]\n"):
        writer.write(line)
        await writer.drain()
        reply = await reader.readline()
        assert b'"ok":false' in reply and reply.count(b"\n") == 1
    # the same connection (and the trainer) still works after the garbage
    writer.write(b'{"cmd": "status"}\n')
    await writer.drain()
    assert b'"ok":true' in await reader.readline()
    writer.close()
    reply = await request(server.path, "format_disk")
    assert not reply.ok and "unknown command 'format_disk'" in reply.message
    assert server.take() == []


async def test_absent_trainer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TrainerUnavailable, match="no trainer is listening"):
        await read_status(str(tmp_path / "none.sock"))


def test_socket_path_default_and_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert socket_path(tmp_path, "node-2") == str(tmp_path / "control" / "node-2.sock")
    monkeypatch.setenv(SOCKET_ENV, "/run/trainer.sock")
    assert socket_path(tmp_path, "node-2") == "/run/trainer.sock"


def test_control_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, gridwatch.wire.control, gridwatch.trainer.control_server, gridwatch.trainer.launch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_restart_from_accepts_what_the_playbooks_send():
    from gridwatch.wire.control import RestartTarget

    assert restart_target({"step": 30}) == RestartTarget(step=30)
    assert restart_target({"checkpoint": "tier1:step-40"}) == RestartTarget(step=40)
    assert restart_target({"incident": "x", "checkpoint": "newest"}) == RestartTarget(fallback=True)
    assert restart_target({"checkpoint": "newest", "step": 60}) == RestartTarget(step=60, fallback=True)
    assert restart_target({"checkpoint": "before", "before_step": 41, "before_ts": 1.0}) == RestartTarget(below=41, fallback=True)
    for bad in ({}, {"checkpoint": "before"}, {"checkpoint": "yesterday"}, {"step": -1}, {"step": True}):
        with pytest.raises(ValueError):
            restart_target(bad)
