"""The trainer's local control socket: where it is, who is at either end (``SO_PEERCRED``), and an asyncio client.

The messages it carries are gridwatch.wire.control's. No torch: the node agent
imports this module.

Both ends check who is at the other end (``SO_PEERCRED``): the trainer admits
this user, root and its control group; the client believes only a socket
served by this user, root or the uid in ``GRIDWATCH_TRAINER_UID``, so whoever
gets to put a socket at the path first cannot pose as the trainer.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gridwatch.wire.control import (
    COLLECTIVES,
    MAX_DUMP_ENTRIES,
    MAX_MESSAGE_BYTES,
    STACKS,
    STATUS,
    CollectiveRecord,
    ControlReply,
    decode_reply,
    encode_request,
)
from gridwatch.wire.protocol import TrainerStatus

SOCKET_ENV = "GRIDWATCH_TRAINER_SOCKET"
# The trainer's uid, for an agent that runs as another user (a member of the trainer's control group).
TRAINER_UID_ENV = "GRIDWATCH_TRAINER_UID"


class TrainerUnavailable(OSError):
    """The trainer's socket is absent, refused the connection or did not answer in time."""

    def __init__(self, message: str, *, absent: bool = False, late: bool = False) -> None:
        super().__init__(message)
        self.absent = absent  # nothing listens there (yet): a trainer that is starting, or none
        self.late = late  # it is there and took the request, but gave no answer in time: busy, or frozen


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+


@dataclass(frozen=True)
class Peer:
    """Who is at the other end of a unix-socket connection, as the kernel says."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]

def peer_of(sock: socket.socket) -> Peer:
    """The credentials of ``sock``'s peer (``SO_PEERCRED``), with its groups (``SO_PEERGROUPS``, else the group database)."""
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 1024)
        groups = set(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError:  # an old kernel, or more groups than fit: what the group database says
        try:
            groups = set(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
        except KeyError:
            groups = set()
    return Peer(pid, uid, gid, frozenset(groups | {gid}))


def trusted_server_uids() -> frozenset[int]:
    """The uids a trainer's socket may be served by: this user, root, and ``GRIDWATCH_TRAINER_UID`` if set."""
    uids = {os.geteuid(), 0}
    extra = os.environ.get(TRAINER_UID_ENV, "").strip()
    if extra.isdigit():
        uids.add(int(extra))
    return frozenset(uids)


def _check_server(sock: socket.socket, path: str) -> None:
    """Refuse a socket served by anyone the client does not trust to be the trainer."""
    uid = peer_of(sock).uid
    if uid not in trusted_server_uids():
        raise TrainerUnavailable(
            f"refusing the trainer at {path}: its socket is served by uid {uid}, not by this user or root "
            f"(someone else may be posing as the trainer; set {TRAINER_UID_ENV} if the trainer runs as that user)"
        )


def socket_path(run_dir: str | os.PathLike[str], node: str) -> str:
    """Where the trainer of ``node`` serves its control socket (``GRIDWATCH_TRAINER_SOCKET`` wins)."""
    override = os.environ.get(SOCKET_ENV)
    if override:
        return override
    return str(Path(run_dir) / "control" / f"{node}.sock")


async def _exchange(path: str, data: bytes) -> bytes:
    """Send ``data`` on a new connection to ``path`` and return the first line that comes back."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, path)
        _check_server(sock, path)
        try:
            await loop.sock_sendall(sock, data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a trainer that refused this peer closed at once; its one-line reason is already here
        buf = bytearray()
        while b"\n" not in buf and len(buf) <= MAX_MESSAGE_BYTES * 4:
            try:
                chunk = await loop.sock_recv(sock, 1 << 16)
            except ConnectionResetError:
                break
            if not chunk:
                break
            buf += chunk
        line, newline, _ = bytes(buf).partition(b"\n")
        return line + newline
    finally:
        sock.close()


async def request(
    socket_path: str, command: str, args: dict[str, Any] | None = None, timeout: float = 5.0
) -> ControlReply:
    """Send one command to the trainer at ``socket_path`` and return its reply.

    Raises :class:`TrainerUnavailable` when nobody answers within ``timeout``;
    a refused command comes back as a reply with ``ok`` false, not an exception.
    """
    try:
        async with asyncio.timeout(timeout):
            line = await _exchange(socket_path, encode_request(command, args))
    except TimeoutError:
        raise TrainerUnavailable(f"trainer at {socket_path} did not answer within {timeout:g} s", late=True) from None
    except TrainerUnavailable:
        raise
    except (FileNotFoundError, ConnectionRefusedError):
        raise TrainerUnavailable(f"no trainer is listening at {socket_path}", absent=True) from None
    except OSError as exc:
        raise TrainerUnavailable(f"trainer at {socket_path}: {exc.strerror or exc}") from None
    if not line:
        raise TrainerUnavailable(f"trainer at {socket_path} closed the connection without a reply")
    try:
        return decode_reply(line)
    except ValueError as exc:
        raise TrainerUnavailable(str(exc)) from None


async def read_status(socket_path: str, timeout: float = 2.0) -> TrainerStatus:
    """The trainer's current status; raises :class:`TrainerUnavailable` if it cannot be read."""
    reply = await request(socket_path, STATUS, None, timeout)
    if not reply.ok or reply.status is None:
        raise TrainerUnavailable(f"trainer at {socket_path} refused status: {reply.message}")
    return reply.status


async def read_collectives(socket_path: str, limit: int = MAX_DUMP_ENTRIES, timeout: float = 2.0) -> CollectiveRecord:
    """The trainer's newest ``limit`` collectives; raises :class:`TrainerUnavailable` if they cannot be read."""
    reply = await request(socket_path, COLLECTIVES, {"limit": limit}, timeout)
    if not reply.ok or reply.collectives is None:
        raise TrainerUnavailable(f"trainer at {socket_path} gave no collective record: {reply.message}")
    return reply.collectives


async def read_stacks(socket_path: str, timeout: float = 2.0) -> list[str]:
    """Every thread's Python stack, as the trainer's own control thread prints it."""
    reply = await request(socket_path, STACKS, None, timeout)
    if not reply.ok:
        raise TrainerUnavailable(f"trainer at {socket_path} gave no stacks: {reply.message}")
    return [str(line) for line in reply.stacks]
