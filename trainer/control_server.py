"""The trainer side of the control socket: a small threaded unix-socket server (no torch).

Requests are answered from a thread so that status stays readable while a step
runs or the job is paused; controls are handed to the training loop through a
queue and take effect at the next step boundary, on every rank together.
"""

from __future__ import annotations

import os
import queue
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path

from loguru import logger

from agents.protocol import TrainerStatus
from trainer.control import (
    MAX_MESSAGE_BYTES,
    STATUS,
    ControlReply,
    ControlRequest,
    decode_request,
    encode_reply,
)


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


class ControlServer:
    """Serves ``path``: status from ``status_fn``, controls queued for the loop (:meth:`take`)."""

    def __init__(self, path: str, status_fn: Callable[[], TrainerStatus], node: str = "") -> None:
        self.path = path
        self._status_fn = status_fn
        self._queue: queue.SimpleQueue[ControlRequest] = queue.SimpleQueue()
        self._log = logger.bind(node=node)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # A socket file left by a killed trainer would make bind() fail.
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._server = _Server(self.path, _Handler)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, name="control", daemon=True)
        self._thread.start()
        self._log.info("control socket at {}", self.path)

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
        if req.cmd == STATUS:
            try:
                return ControlReply(ok=True, status=self._status_fn())
            except Exception as exc:  # status must never take the server down
                return ControlReply(ok=False, message=f"status unavailable: {exc}")
        self._queue.put(req)
        self._log.info("control: {} {} queued", req.cmd, req.args or "")
        return ControlReply(ok=True, message=f"{req.cmd} accepted; applied at the next step boundary")

    def take(self) -> list[ControlRequest]:
        """Every control received since the last call, oldest first."""
        out: list[ControlRequest] = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out
