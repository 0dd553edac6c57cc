"""The console's control socket and ``gridwatch node return|isolate``: who may ask, what a bad request gets, the audit.

A real agent on loopback, the real runtime (SQLite incidents, executor) with
its control server, and the command line an operator runs, as a user would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sqlite3
import stat
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gridwatch.console.cli import main
from gridwatch.console.runtime.control import ControlError, ControlServer, socket_for
from gridwatch.console.runtime.core import ConsoleRuntime
from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
from gridwatch.sshlink.hostlist import parse_endpoints
from tests.conftest import PYTHON, ROOT, RunningAgent, start_agent, stop_agent, wait_until

REASON = "GPU 0 reseated, burn-in passed (ticket OPS-4411)"


@dataclass
class Console:
    runtime: ConsoleRuntime
    server: ControlServer
    agent: RunningAgent
    db: Path

    @property
    def socket(self) -> str:
        return self.server.path

    def audit(self) -> list[tuple[str, str, str, str, str]]:
        with contextlib.closing(sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)) as db:
            return [tuple(r) for r in db.execute("SELECT who, what, why, phase, outcome FROM audit ORDER BY id")]


async def _console(keys, tmp_path: Path, socket_path: str | None = None, **options: object) -> Console:  # noqa: ANN001
    # A 1 s tick: at 0.2 s a busy test host stalls this process past three ticks and the console reads a
    # heartbeat lost (and isolates the node) before the test's own isolate (a console-liveness bug of its own).
    agent = await start_agent(keys, name="node-1", gpus=1, interval=1.0)
    db = tmp_path / "incidents.db"
    runtime = build_runtime(RuntimeOptions(endpoints=parse_endpoints(agent.spec), key_path=str(keys.operator_key),
                                           known_hosts=str(keys.known_hosts), db_path=str(db), operator="svc",
                                           **options))  # type: ignore[arg-type]
    await runtime.start()
    def connected() -> bool:
        node = runtime.store.by_name("node-1")
        return node is not None and str(runtime.store.status(node)) == "ok"

    await wait_until(connected, 20, "node-1 connected")
    server = ControlServer(runtime, socket_path or socket_for(db))
    await server.start()
    return Console(runtime, server, agent, db)


async def _close(console: Console) -> None:
    await console.server.stop()
    await console.runtime.stop()
    await stop_agent(console.agent)


@pytest.fixture
async def console(keys, tmp_path: Path) -> AsyncIterator[Console]:  # noqa: ANN001
    c = await _console(keys, tmp_path)
    yield c
    await _close(c)


async def gridwatch(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The command line, as an operator runs it (in a thread: it has its own event loop, the console is in ours)."""
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _raw(path: str, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(15)
        s.connect(path)
        try:
            s.sendall(data)
        except BrokenPipeError:
            pass  # a refused peer is answered and closed at once, maybe before it sent: the answer is still there
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            buf += chunk
    return buf


def _as_stranger(path: str, data: bytes) -> bytes:
    """``_raw`` from a child process that has become nobody (uid 65534): the kernel vouches for who it is."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, ask, hand the reply back, and go
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, _raw(path, data))
        except BaseException as exc:  # noqa: BLE001 - said to the parent, whose assertion shows it
            os.write(write, f"the stranger's request failed: {exc!r}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        reply = pipe.read()
    os.waitpid(pid, 0)
    return reply


async def test_return_to_service_from_the_command_line_is_audited_like_the_node_view(
        console: Console, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = await gridwatch(capsys, "node", "isolate", "node-1", "--reason", "GPU 0 fell off the bus",
                                     "--db", str(console.db), "--operator", "alice")
    assert code == 0, err
    assert out.startswith("node-1: isolated")
    assert console.agent.agent.isolated  # type: ignore[attr-defined]

    code, out, err = await gridwatch(capsys, "node", "return", "node-1", "--reason", REASON,
                                     "--socket", console.socket, "--operator", "alice")
    assert code == 0, err
    assert out.startswith("node-1: returned to service; scheduler: no scheduler configured")
    assert not console.agent.agent.isolated  # type: ignore[attr-defined]

    audit = console.audit()
    assert ("alice", "isolate on node-1", "GPU 0 fell off the bus", "before", "") in audit
    assert ("alice", "unisolate on node-1", REASON, "before", "") in audit
    after = [a for a in audit if a[1] == "unisolate on node-1" and a[3] == "after"]
    assert after and after[0][4].startswith("done: returned to service")
    # The scheduler's part is audited too, with the operator and the reason.
    assert ("alice", "return_to_service node-1", REASON, "after", "no scheduler configured: nothing to resume") in audit


async def test_the_socket_is_private_and_a_stranger_is_refused_by_its_credentials(
        keys, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    if os.geteuid() != 0:
        pytest.skip("connecting as another user needs root here")
    # A folder and a socket anyone may reach: only the peer check stands between a stranger and the console.
    folder = Path(tempfile.mkdtemp(prefix="gw-ctl-", dir="/tmp"))
    folder.chmod(0o711)
    c = await _console(keys, tmp_path, str(folder / "console.sock"))
    try:
        mode = stat.S_IMODE(os.stat(c.socket).st_mode)
        assert mode == 0o600, oct(mode)
        os.chmod(c.socket, 0o666)
        request = b'{"verb": "isolate", "node": "node-1", "reason": "not mine"}\n'
        reply = await asyncio.to_thread(_as_stranger, c.socket, request)
        assert reply == (b'{"outcome":"refused","message":"refused: only this console\'s user and root may use its '
                         b'control socket"}\n')
        assert not c.agent.agent.isolated  # type: ignore[attr-defined]
        assert not any(a[1].startswith("isolate") for a in c.audit())
    finally:
        await _close(c)
        folder.rmdir()  # the console removed its socket when it stopped


async def test_a_bad_request_gets_one_line_and_the_console_goes_on(
        console: Console, capsys: pytest.CaptureFixture[str]) -> None:
    for data, words in ((b"this is not json\n", "unreadable request"),
                        (b'{"verb": "reboot", "node": "node-1", "reason": "x"}\n', "unreadable request"),
                        (b'{"verb": "return", "node": "node-1", "reason": "x", "then": "reboot"}\n', "unreadable request"),
                        (b'{"verb": "return", "node": "node-1", "reason": "  "}\n', "no reason given"),
                        (b'{"verb": "return", "node": "node-1", "reason": "x", "v": 9}\n', "version 9"),
                        (b"x" * 5000 + b"\n", "exceeds 4096 bytes")):
        reply = await asyncio.to_thread(_raw, console.socket, data)
        assert reply.count(b"\n") == 1, reply
        assert b'"outcome":"bad_request"' in reply and words.encode() in reply, reply
    code, out, err = await gridwatch(capsys, "node", "isolate", "node-1", "--reason", "still answering",
                                     "--socket", console.socket)
    assert code == 0, err


async def test_an_unknown_node_or_no_reason_is_bad_input(console: Console, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = await gridwatch(capsys, "node", "return", "node-9", "--reason", REASON, "--socket", console.socket)
    assert code == 2
    assert err == "gridwatch node return: unknown node 'node-9': this console watches node-1\n"
    code, out, err = await gridwatch(capsys, "node", "return", "node-1", "--reason", " ", "--socket", console.socket)
    assert code == 2 and err.count("\n") == 1 and "--reason must say why" in err
    with pytest.raises(SystemExit) as exited:
        main(["node", "return", "node-1", "--socket", console.socket])
    assert exited.value.code == 2  # argparse: --reason is required
    assert not any(a[1].startswith("unisolate") for a in console.audit())


async def test_a_read_only_console_refuses(keys, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    c = await _console(keys, tmp_path, read_only=True)
    try:
        code, out, err = await gridwatch(capsys, "node", "isolate", "node-1", "--reason", "x", "--db", str(c.db))
        assert code == 1
        assert err == "gridwatch node isolate: cannot isolate node-1: this console is read-only\n"
        assert not c.agent.agent.isolated  # type: ignore[attr-defined]
    finally:
        await _close(c)


async def test_no_console_running_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = await gridwatch(capsys, "node", "return", "node-1", "--reason", REASON,
                                     "--db", str(tmp_path / "incidents.db"))
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"gridwatch node return: no console is running here: nothing serves {tmp_path}/incidents.sock")
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(stale))  # a console that was killed leaves its socket file behind
    code, out, err = await gridwatch(capsys, "node", "return", "node-1", "--reason", REASON, "--socket", str(stale))
    assert code == 1 and err == f"gridwatch node return: no console is running here: {stale} is left from one that stopped\n"


async def test_a_second_console_on_the_same_socket_is_refused_and_a_stale_one_is_replaced(
        console: Console, tmp_path: Path) -> None:
    with pytest.raises(ControlError, match="another console already serves"):
        await ControlServer(console.runtime, console.socket).start()
    stale = tmp_path / "left.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(stale))
    server = ControlServer(console.runtime, str(stale))
    await server.start()
    try:
        reply = await asyncio.to_thread(_raw, str(stale), b"{}\n")
        assert b"bad_request" in reply
    finally:
        await server.stop()
    assert not stale.exists()
    with pytest.raises(ControlError, match="longer than the 107 bytes"):
        await ControlServer(console.runtime, str(tmp_path / ("x" * 120))).start()


def test_every_node_command_has_help() -> None:
    for argv in (["node", "--help"], ["node", "return", "--help"], ["node", "isolate", "--help"]):
        done = subprocess.run([PYTHON, "-m", "gridwatch", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "return" in done.stdout and "exit: 0 done" in done.stdout, done.stderr
    done = subprocess.run([PYTHON, "-m", "gridwatch", "node"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
