"""The demo's state file: which agents a running demo started, so ``gridwatch fault node-2`` finds them."""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

import msgspec
from loguru import logger

from gridwatch.wire.control import pid_alive

STATE_NAME = "demo.json"
POINTER_NAME = "gridwatch-demo.current"


class DemoNotFound(LookupError):
    """No running demo where we looked; the message says where and what to do."""


def _private(path: Path) -> bool:
    """A real directory (not a link), ours, that no one else may write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def pointer_dir() -> Path:
    """Where the pointer to this user's newest demo lives: $XDG_RUNTIME_DIR, else a private folder in /tmp.

    /tmp is shared: a folder there that another user made (or a link) is
    refused, so nobody can plant the pointer `gridwatch fault` follows.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and _private(Path(runtime)):
        return Path(runtime)
    base = Path(tempfile.gettempdir()) / f"gridwatch-{os.getuid()}"
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    if not _private(base):
        raise OSError(f"{base} is not a private directory of this user")
    return base


def pointer_path() -> Path:
    return pointer_dir() / POINTER_NAME


def _write_nofollow(path: Path, data: bytes) -> None:
    """Write through a new temp name (never following a link planted there), then rename over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)  # replaces a link at ``path`` itself, never what it points to
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_pointer() -> str:
    """The demo directory the pointer names; DemoNotFound if there is none or it is not ours."""
    try:
        path = pointer_path()
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        raise DemoNotFound("no demo is running (start one with `gridwatch demo`, or give --dir)") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise DemoNotFound(f"{path} is not a file of this user; ignored (give --dir)")
        return fh.read(4096).decode("utf-8", "replace").strip()


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


def write_state(state: DemoState) -> Path:
    path = Path(state.dir) / STATE_NAME
    _write_nofollow(path, msgspec.json.format(msgspec.json.encode(state)))
    try:
        _write_nofollow(pointer_path(), str(Path(state.dir).resolve()).encode())
    except OSError as exc:
        # The demo runs on; only `gridwatch fault` without --dir cannot find it.
        logger.warning("no pointer to this demo for `gridwatch fault`: {}", exc)
    return path


def clear_state(state: DemoState) -> None:
    (Path(state.dir) / STATE_NAME).unlink(missing_ok=True)
    try:
        if _read_pointer() == str(Path(state.dir).resolve()):
            pointer_path().unlink()
    except (OSError, DemoNotFound):
        pass


def read_state(directory: str | None = None) -> DemoState:
    """The state of the demo in ``directory``, or of the newest running demo."""
    if directory is None:
        directory = _read_pointer()
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
