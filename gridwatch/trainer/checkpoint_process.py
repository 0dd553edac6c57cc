"""The checkpointer's end of its writer process: started on first use, started again after it dies.

Every call blocks until the writer answers, so it is made from the
checkpointer's own thread, never the training loop's. A writer that dies
(killed, out of memory) fails the request it was working on with one line;
the next request starts a new one.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from loguru import logger

from gridwatch.trainer.checkpoint import Manifest
from gridwatch.trainer.checkpoint_arena import Arena
from gridwatch.trainer.checkpoint_wire import Copy, Ping, Register, Reply, Request, Write, receive_reply, send

# The writer's command line, before its socket and parent arguments (a test may wrap it).
WRITER_COMMAND = [sys.executable, "-m", "gridwatch.trainer.checkpoint_writer"]


class WriterDied(Exception):
    """The writer process ended while it held a request; the message says how, in one line."""


class WriterProcess:
    """One long-lived writer process and the arenas it has mapped."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._known: set[int] = set()

    @property
    def pid(self) -> int | None:
        """The running writer's process id (None before it starts or after it died)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self) -> None:
        """Start the writer now if none runs (it is started on first use otherwise)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                return
            # It died between saves (the OOM killer, an operator): no save was lost, a new one takes over.
            logger.warning("{}", self._reap())
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The child imports the same gridwatch as this process, wherever that came from.
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        try:
            self._proc = subprocess.Popen(
                [*WRITER_COMMAND, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env,
            )
        finally:
            theirs.close()
        self._sock = ours

    def write(self, arena: Arena, arena_id: int, live_arenas: set[int], root: Path, manifest: Manifest,
              keep: int) -> Reply:
        """Write ``arena`` as a checkpoint under ``root`` and prune to ``keep``; :class:`WriterDied` if the writer died."""
        self.start()  # a writer started now knows no arena yet
        if arena_id not in self._known:
            reply = self._call(Register(arena=arena_id, layout=arena.layout), fd=arena.fd)
            if reply.error:
                return reply
            self._known.add(arena_id)
        self._known &= live_arenas | {arena_id}
        return self._call(Write(arena=arena_id, root=str(root), manifest=manifest, keep=keep,
                                arenas=sorted(self._known)))

    def copy(self, source: Path, root: Path, tier: int, note: str, keep: int) -> Reply:
        """Copy a checkpoint to ``root`` as ``tier``, verified, and prune to ``keep``."""
        return self._call(Copy(source=str(source), root=str(root), tier=tier, note=note, keep=keep))

    def ping(self) -> Reply:
        """A round trip to the writer (started now if none runs): back once it serves; :class:`WriterDied` if it died."""
        return self._call(Ping())

    def close(self) -> None:
        """Let the writer finish and exit (closing our end is its signal)."""
        proc = self._proc
        self._drop()
        if proc is not None:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _call(self, req: Request, fd: int | None = None) -> Reply:
        self.start()
        assert self._sock is not None
        try:
            send(self._sock, req, fd)
            reply = receive_reply(self._sock)
        except OSError:
            reply = None
        if reply is None:
            raise WriterDied(self._reap())
        return reply

    def _reap(self) -> str:
        proc = self._proc
        self._drop()
        code = None
        if proc is not None:
            try:
                code = proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit code {code}"
        return f"the checkpoint writer process died ({how}); a new one takes the next write"

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._proc = None
        self._known = set()
