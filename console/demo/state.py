"""The demo's state file: which agents a running demo started, so ``gridwatch fault node-2`` finds them."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgspec

from agents.procs import pid_alive

STATE_NAME = "demo.json"
# Where `gridwatch fault` looks when no --dir is given: the newest demo of this user.
POINTER = Path(tempfile.gettempdir()) / f"gridwatch-demo-{os.getuid()}.current"


class DemoNode(msgspec.Struct, kw_only=True):
    name: str
    host: str
    port: int
    pid: int
    trainer_socket: str = ""

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


class DemoState(msgspec.Struct, kw_only=True):
    """One running demo: its directory, its keys, its processes."""

    dir: str
    pid: int  # the demo process itself
    operator_key: str
    viewer_key: str
    known_hosts: str
    nodes: list[DemoNode] = []
    trainer_pid: int | None = None
    run_dir: str = ""
    started_at: float = 0.0

    def node(self, name: str) -> DemoNode | None:
        return next((n for n in self.nodes if n.name == name), None)


class DemoNotFound(LookupError):
    """No running demo where we looked; the message says where and what to do."""


def write_state(state: DemoState) -> Path:
    path = Path(state.dir) / STATE_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state)))
    os.replace(tmp, path)
    POINTER.write_text(str(Path(state.dir).resolve()))
    return path


def clear_state(state: DemoState) -> None:
    (Path(state.dir) / STATE_NAME).unlink(missing_ok=True)
    try:
        if POINTER.read_text().strip() == str(Path(state.dir).resolve()):
            POINTER.unlink()
    except OSError:
        pass


def read_state(directory: str | None = None) -> DemoState:
    """The state of the demo in ``directory``, or of the newest running demo."""
    if directory is None:
        try:
            directory = POINTER.read_text().strip()
        except OSError:
            raise DemoNotFound("no demo is running (start one with `gridwatch demo`, or give --dir)") from None
    path = Path(directory) / STATE_NAME
    try:
        state = msgspec.json.decode(path.read_bytes(), type=DemoState)
    except FileNotFoundError:
        raise DemoNotFound(f"no demo state in {directory}: is the demo still running?") from None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DemoNotFound(f"{path} is not a demo state file: {exc}") from None
    if not pid_alive(state.pid):
        raise DemoNotFound(f"the demo in {directory} (pid {state.pid}) is no longer running")
    return state
