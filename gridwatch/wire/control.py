"""The trainer's local control socket: its message format and an asyncio client (no torch).

A node's trainer serves a unix socket; its agent connects and exchanges
newline-delimited JSON. A request is ``{"cmd": NAME, "args": {...}}``; every
request gets exactly one reply line ``{"ok": bool, "message": str, "status": ...}``.
``status`` returns a :class:`gridwatch.wire.protocol.TrainerStatus`; the controls are
:data:`CONTROL_COMMANDS`. The node agent imports this module, so it must never
import torch.

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
from enum import StrEnum
from pathlib import Path
from typing import Any

import msgspec

from gridwatch.wire.protocol import Event, Text, TrainerStatus, clean_text, text_dec_hook, text_enc_hook

SOCKET_ENV = "GRIDWATCH_TRAINER_SOCKET"
# The trainer's uid, for an agent that runs as another user (a member of the trainer's control group).
TRAINER_UID_ENV = "GRIDWATCH_TRAINER_UID"
# A request or reply longer than this is refused: the status is a few KB at most.
MAX_MESSAGE_BYTES = 1 << 16

STATUS = "status"
# Reads answered from the control thread at once, even while the loop is stuck in a collective.
COLLECTIVES = "collectives"  # the rank's collective record (args: {"limit": N})
STACKS = "stacks"  # every thread's Python stack, as faulthandler prints it
READ_COMMANDS: frozenset[str] = frozenset({STATUS, COLLECTIVES, STACKS})
CONTROL_COMMANDS: frozenset[str] = frozenset(
    {"checkpoint_now", "pause", "resume", "leave", "restart_from"}
)
COMMANDS: frozenset[str] = CONTROL_COMMANDS | READ_COMMANDS
# Entries of a collective record a dump returns at most (the newest): keeps a reply under its limit.
MAX_DUMP_ENTRIES = 512


class CollectiveState(StrEnum):
    """Where one collective is on a rank, as torch's Flight Recorder names it (plus ``failed``)."""

    SCHEDULED = "scheduled"  # the rank called it; it has not started moving data
    STARTED = "started"  # it runs: the rank waits in it for its peers
    COMPLETED = "completed"
    FAILED = "failed"  # it raised (a timeout, a peer that closed)


class CollectiveEntry(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One collective on one rank: matched across ranks by (``pg``, ``seq``)."""

    pg: Text  # the process group's name, the same on every member
    seq: int  # 1, 2, ... per process group, in call order (as NCCL's SeqNum)
    op: Text  # all_reduce, all_gather, broadcast, barrier
    numel: int = 0
    dtype: Text = Text("")
    state: CollectiveState
    scheduled_at: float  # the rank's wall clock
    started_at: float | None = None
    ended_at: float | None = None
    error: Text = Text("")


class ProcessGroupInfo(msgspec.Struct, kw_only=True):
    """A process group this rank is (or was) in: its name, order, this rank's rank and every member's node."""

    name: Text
    ordinal: int  # a later group has a larger one (the job's generation)
    rank: int
    members: list[Text] = []  # node of each rank, in rank order


class CollectiveRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A rank's bounded ring of its newest collectives, as the ``collectives`` command returns it."""

    node: Text
    pid: int
    now: float  # the rank's wall clock when it answered: how long an entry has waited
    groups: list[ProcessGroupInfo] = []
    entries: list[CollectiveEntry] = []
    dropped: int = 0  # entries older than the ring holds


class ControlRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """One line from the agent to the trainer."""

    cmd: str
    args: dict[str, Any] = {}


class ControlReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The trainer's answer to one request; ``ok`` false carries a one-line ``message``."""

    ok: bool
    message: str = ""
    status: TrainerStatus | None = None
    collectives: CollectiveRecord | None = None
    stacks: list[Text] = []  # one line each: every line of node text is cleaned alone


class TrainerUnavailable(OSError):
    """The trainer's socket is absent, refused the connection or did not answer in time."""

    def __init__(self, message: str, *, absent: bool = False) -> None:
        super().__init__(message)
        self.absent = absent  # nothing listens there (yet): a trainer that is starting, or none


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+


@dataclass(frozen=True)
class Peer:
    """Who is at the other end of a unix-socket connection, as the kernel says."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (even one we may not signal): is a trainer's writer still there."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


# A trainer's strings are node-supplied text: the same cleaning as agent frames.
_encoder = msgspec.json.Encoder(enc_hook=text_enc_hook)
_request_decoder = msgspec.json.Decoder(ControlRequest)
_reply_decoder = msgspec.json.Decoder(ControlReply, dec_hook=text_dec_hook)


def encode_request(cmd: str, args: dict[str, Any] | None = None) -> bytes:
    return _encoder.encode(ControlRequest(cmd=cmd, args=dict(args or {}))) + b"\n"


def encode_reply(reply: ControlReply) -> bytes:
    return _encoder.encode(reply) + b"\n"


def decode_request(line: bytes) -> ControlRequest:
    """Parse and check one request line; raises ``ValueError`` with a one-line reason."""
    if len(line) > MAX_MESSAGE_BYTES:
        raise ValueError(f"request of {len(line)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        req = _request_decoder.decode(line.strip())
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not a control request: {clean_text(str(exc), 200)}") from None
    if req.cmd not in COMMANDS:
        known = ", ".join(sorted(COMMANDS))
        raise ValueError(f"unknown command {clean_text(req.cmd, 40)!r}; known: {known}")
    if req.cmd == "restart_from":
        restart_target(req.args)
    if req.cmd == COLLECTIVES:
        dump_limit(req.args)
    return req


def dump_limit(args: dict[str, Any]) -> int:
    """How many entries a ``collectives`` request asks for (1..MAX_DUMP_ENTRIES; default all)."""
    limit = args.get("limit", MAX_DUMP_ENTRIES)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"collectives: limit must be a positive whole number, got {clean_text(str(limit), 40)!r}")
    return min(limit, MAX_DUMP_ENTRIES)


@dataclass(frozen=True)
class RestartTarget:
    """Which checkpoint a ``restart_from`` asks for.

    ``step``: exactly this step. ``below``: the newest valid one whose step is
    below this. Neither: the newest valid one. With both, ``step`` is tried
    first and ``below`` is the fallback when it does not validate.
    """

    step: int | None = None
    below: int | None = None
    fallback: bool = False  # a rule was given: when ``step`` does not validate, use it

    @property
    def newest(self) -> bool:
        return self.step is None or self.fallback


def _named_step(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        step = value
    else:
        text = str(value).rstrip("/").rsplit("/", 1)[-1]
        text = text.split(":", 1)[-1].removeprefix("step-")
        try:
            step = int(text)
        except ValueError:
            raise ValueError(f"restart_from: {clean_text(str(value), 80)!r} does not name a checkpoint step") from None
    if step < 0:
        raise ValueError(f"restart_from: step {step} is negative")
    return step


def restart_target(args: dict[str, Any]) -> RestartTarget:
    """Read ``restart_from`` args.

    Accepted: ``{"step": N}``; ``{"checkpoint": "N" | "step-N" | "tierT:step-N" | PATH}``;
    ``{"checkpoint": "newest"}``; ``{"checkpoint": "before", "before_step": N}``.
    ``step`` may come with "newest"/"before" as the first choice (the playbook
    executor sends it when it knows a step every node holds). Other keys
    (``incident``, ``before_ts``) are for the log only.
    """
    rule, step = args.get("checkpoint"), args.get("step")
    if isinstance(step, bool) or (step is None and rule is None):
        raise ValueError('restart_from needs {"step": N}, {"checkpoint": "newest"} or {"checkpoint": "before", "before_step": N}')
    exact = _named_step(step) if step is not None else None
    if rule == "newest":
        return RestartTarget(step=exact, fallback=True)
    if rule == "before":
        before = args.get("before_step")
        if before is None:
            if exact is None:
                raise ValueError("restart_from before an event needs before_step (the first bad step)")
            return RestartTarget(step=exact)
        return RestartTarget(step=exact, below=_named_step(before), fallback=True)
    if rule is not None and exact is None:
        exact = _named_step(rule)
    return RestartTarget(step=exact)


def decode_reply(line: bytes) -> ControlReply:
    try:
        return _reply_decoder.decode(line.strip())
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"trainer sent an unreadable reply: {clean_text(str(exc), 200)}") from None


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
        raise TrainerUnavailable(f"trainer at {socket_path} did not answer within {timeout:g} s") from None
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


def events_after(status: TrainerStatus, seq: int) -> list[Event]:
    """The events in ``status`` newer than ``seq`` (what a relay has not sent yet)."""
    return [e for e in status.events if e.seq > seq]
