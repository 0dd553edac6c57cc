"""The trainer side of the control socket: a small threaded unix-socket server (no torch).

Requests are answered from a thread so that status stays readable while a step
runs or the job is paused; controls are handed to the training loop through a
queue and take effect at the next step boundary, on every rank together.

Only this user, root and the members of an optional group (``control_group``)
may connect: the socket is made 0600 (0660 for that group) whatever the umask,
and every connection's peer credentials are checked (``SO_PEERCRED``), so a
loose mode on the file or its directory lets nobody else in.
"""

from __future__ import annotations

import grp
import os
import queue
import secrets
import socket
import socketserver
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from loguru import logger

from gridwatch.wire.control import (
    COLLECTIVES,
    MAX_MESSAGE_BYTES,
    STACKS,
    STATUS,
    CollectiveRecord,
    ControlReply,
    ControlRequest,
    decode_request,
    dump_limit,
    encode_reply,
)
from gridwatch.wire.controlsock import Peer, peer_of
from gridwatch.wire.protocol import Text, TrainerStatus


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        while True:
            try:
                line = self.rfile.readline(MAX_MESSAGE_BYTES + 1)
            except OSError:
                return
            if not line:
                return
            if len(line) > MAX_MESSAGE_BYTES and not line.endswith(b"\n"):
                reply = ControlReply(ok=False, message=f"request exceeds {MAX_MESSAGE_BYTES} bytes; connection closed")
                self._send(reply)
                return
            self._send(self.server.owner.answer(line))

    def _send(self, reply: ControlReply) -> None:
        try:
            self.wfile.write(encode_reply(reply))
            self.wfile.flush()
        except OSError:
            pass


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    owner: ControlServer

    def verify_request(self, request: socket.socket | tuple[bytes, socket.socket], client_address: object) -> bool:
        # A stream server's request is its connected socket (the tuple is a datagram server's).
        return isinstance(request, socket.socket) and self.owner.admit(request)


REFUSAL_LOG_S = 60.0
MAX_STACK_LINES = 400  # a reply stays far below the client's limit


def thread_stacks() -> list[str]:
    """Every thread's Python stack, newest call last, as faulthandler prints them (read from this thread)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    lines: list[str] = []
    for ident, frame in sys._current_frames().items():
        lines.append(f"Thread {ident:#x} ({names.get(ident, '?')}) (most recent call first):")
        for fs in reversed(traceback.extract_stack(frame)):
            lines.append(f'  File "{fs.filename}", line {fs.lineno} in {fs.name}')
        lines.append("")
    return lines[:MAX_STACK_LINES]


def resolve_group(name: str) -> int:
    """The gid of the group named ``name`` (or given as a number); ``ValueError`` in one line if there is none."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        pass
    if name.isdigit():
        return int(name)
    raise ValueError(f"control group {name!r} does not exist on this machine: create it, or leave control_group empty")


class ControlServer:
    """Serves ``path``: status from ``status_fn``, controls queued for the loop (:meth:`take`).

    ``group`` (a name or gid; empty: none) may connect besides this user and root.
    """

    def __init__(self, path: str, status_fn: Callable[[], TrainerStatus], node: str = "", group: str = "",
                 clock: Callable[[], float] = time.monotonic,
                 collectives_fn: Callable[[int], CollectiveRecord] | None = None) -> None:
        self.path = path
        self._status_fn = status_fn
        self._collectives_fn = collectives_fn
        self._queue: queue.SimpleQueue[ControlRequest] = queue.SimpleQueue()
        self._log = logger.bind(node=node)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.group = group
        self.gid: int | None = resolve_group(group) if group else None
        self._clock = clock
        self._refusals: dict[int, tuple[float, int]] = {}  # uid -> (when last logged, refused since)

    @property
    def mode(self) -> int:
        """The socket file's mode: owner only, or owner and the control group."""
        return 0o600 if self.gid is None else 0o660

    def start(self) -> None:
        path = Path(self.path)
        if not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            # A directory of our own making admits no one else, bar the group's way to the socket.
            os.chmod(path.parent, 0o700 if self.gid is None else 0o710)
            if self.gid is not None:
                os.chown(path.parent, -1, self.gid)
        self._server = _Server(self.path, _Handler, bind_and_activate=False)
        self._server.owner = self
        try:
            self._bind(self._server, path)
            self._server.server_activate()
        except BaseException:
            self._server.server_close()
            self._server = None
            raise
        self._thread = threading.Thread(target=self._server.serve_forever, name="control", daemon=True)
        self._thread.start()
        who = "this user" if self.gid is None else f"this user and group {self.group}"
        self._log.info("control socket at {} (mode {:04o}: {})", self.path, self.mode, who)

    def _bind(self, server: _Server, path: Path) -> None:
        """Bind in a fresh private directory beside ``path``, set the mode there, then move the socket into place.

        Nobody can reach the socket before its mode is set, and a link or file
        planted at ``path`` is replaced, never followed. Moving it over the old
        path also clears a socket file left by a killed trainer.
        """
        staging = path.parent / f".gw-{secrets.token_hex(3)}"  # no longer than most socket names: AF_UNIX paths are short
        os.mkdir(staging, 0o700)
        try:
            temp = staging / "s"
            server.socket.bind(str(temp))
            os.chmod(temp, self.mode)
            if self.gid is not None:
                os.chown(temp, -1, self.gid)
            os.rename(temp, path)
        finally:
            try:
                os.unlink(staging / "s")
            except FileNotFoundError:
                pass
            os.rmdir(staging)
        server.server_address = self.path

    def admit(self, conn: socket.socket) -> bool:
        """Whether this connection's peer may use the trainer: this user, root, or a member of the group."""
        try:
            peer = peer_of(conn)
        except OSError as exc:
            self._log.warning("control socket: refused a connection whose peer is unknown ({})", exc.strerror or exc)
            return False
        if peer.uid in (os.geteuid(), 0) or (self.gid is not None and self.gid in peer.groups):
            return True
        allowed = "this user and root" if self.gid is None else f"this user, root and group {self.group}"
        self._log_refusal(peer, allowed)
        try:
            reply = ControlReply(ok=False, message=f"refused: only {allowed} may use this trainer")
            conn.send(encode_reply(reply), socket.MSG_DONTWAIT)
        except OSError:
            pass
        return False

    def _log_refusal(self, peer: Peer, allowed: str) -> None:
        """One line per refused user a minute, so a peer that keeps trying cannot fill the log."""
        now = self._clock()
        last, since = self._refusals.get(peer.uid, (None, 0))
        if last is not None and now - last < REFUSAL_LOG_S:
            self._refusals[peer.uid] = (last, since + 1)
            return
        self._refusals[peer.uid] = (now, 0)
        more = f" ({since} more refused since the last report)" if since else ""
        self._log.warning("control socket: refused uid {} (pid {}): only {} may use this trainer{}",
                          peer.uid, peer.pid, allowed, more)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def answer(self, line: bytes) -> ControlReply:
        """The reply to one request line; controls are queued, never run here."""
        try:
            req = decode_request(line)
        except ValueError as exc:
            self._log.warning("control socket: {}", exc)
            return ControlReply(ok=False, message=str(exc))
        if req.cmd == COLLECTIVES:
            if self._collectives_fn is None:
                return ControlReply(ok=False, message="this trainer keeps no collective record")
            try:
                return ControlReply(ok=True, collectives=self._collectives_fn(dump_limit(req.args)))
            except Exception as exc:  # a read must never take the server down
                return ControlReply(ok=False, message=f"collective record unavailable: {exc}")
        if req.cmd == STACKS:
            return ControlReply(ok=True, stacks=[Text(line) for line in thread_stacks()])
        if req.cmd == STATUS:
            try:
                return ControlReply(ok=True, status=self._status_fn())
            except Exception as exc:  # status must never take the server down
                return ControlReply(ok=False, message=f"status unavailable: {exc}")
        self._queue.put(req)
        self._log.info("control: {} {} queued", req.cmd, req.args or "")
        return ControlReply(ok=True, message=f"{req.cmd} accepted; applied at the next step boundary")

    def take(self, wait: float = 0.0) -> list[ControlRequest]:
        """Every control received since the last call, oldest first; with ``wait``, block up to that long for one."""
        out: list[ControlRequest] = []
        if wait > 0:
            # A paused loop sleeps here, so the resume that wakes it takes effect at once.
            try:
                out.append(self._queue.get(timeout=wait))
            except queue.Empty:
                return out
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out
