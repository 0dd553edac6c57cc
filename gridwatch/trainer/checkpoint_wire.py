"""The messages between the checkpointer and its writer process, which both ends import.

They travel as msgpack (msgspec) over a private socket pair, one message a
packet; an arena's memfd rides beside its ``Register`` message. Nothing on
this link is ever unpickled.
"""

from __future__ import annotations

import socket

import msgspec

from gridwatch.trainer.checkpoint import Manifest
from gridwatch.trainer.checkpoint_arena import Layout

# Far more than any manifest: a packet this large is refused rather than cut.
MAX_PACKET = 1 << 20


class Register(msgspec.Struct, tag=True, kw_only=True):
    """Map the arena whose descriptor comes with this message."""

    arena: int
    layout: Layout


class Write(msgspec.Struct, tag=True, kw_only=True):
    """Write the arena's tensors as a checkpoint under ``root``, then keep the ``keep`` newest there."""

    arena: int
    root: str
    manifest: Manifest
    keep: int
    arenas: list[int] = []  # the arenas that still exist: the writer lets go of any other


class Copy(msgspec.Struct, tag=True, kw_only=True):
    """Copy the checkpoint at ``source`` to ``root`` as ``tier``, checking it against its manifest; then prune."""

    source: str
    root: str
    tier: int
    note: str = ""
    keep: int


class Ping(msgspec.Struct, tag=True, kw_only=True):
    """Answer at once: the writer has started and serves (its imports are done)."""


Request = Register | Write | Copy | Ping


class Reply(msgspec.Struct, kw_only=True):
    """What became of one request: ``error`` empty and ``path`` the checkpoint written, or ``error`` in one line."""

    path: str = ""
    error: str = ""
    pruned: int = 0


_request = msgspec.msgpack.Decoder(Request)
_reply = msgspec.msgpack.Decoder(Reply)
_encode = msgspec.msgpack.Encoder().encode


def send(sock: socket.socket, msg: Request | Reply, fd: int | None = None) -> None:
    data = _encode(msg)
    if fd is None:
        sock.send(data)
    else:
        socket.send_fds(sock, [data], [fd])


def receive_request(sock: socket.socket) -> tuple[Request | None, list[int]]:
    """The next request and any descriptors with it; ``None`` when the trainer has gone."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_PACKET, 2)
    if not data:
        return None, fds
    return _request.decode(data), fds


def receive_reply(sock: socket.socket) -> Reply | None:
    """The writer's reply; ``None`` when the writer process has gone."""
    data = sock.recv(MAX_PACKET)
    return _reply.decode(data) if data else None


def one_line(exc: BaseException) -> str:
    """An error as one line an operator reads (the OS's words first for an OSError)."""
    text = str(exc).strip().splitlines()
    msg = text[0] if text else type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror and exc.strerror not in msg:
        msg = f"{exc.strerror}: {msg}"
    return msg[:300]
