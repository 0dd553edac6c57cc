"""The trainer's control contract: the messages of its local control socket, which both ends import (no torch).

A node's trainer serves a unix socket; its agent connects and exchanges
newline-delimited JSON. A request is ``{"cmd": NAME, "args": {...}}``; every
request gets exactly one reply line ``{"ok": bool, "message": str, "status": ...}``.
``status`` returns a :class:`gridwatch.wire.protocol.TrainerStatus`; the controls are
:data:`CONTROL_COMMANDS`. The node agent imports this module, so it must never
import torch.

The socket itself (where it is, who may be at either end, the client) is
gridwatch.wire.controlsock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec

from gridwatch.wire.protocol import Event, Text, TrainerStatus, clean_text, text_dec_hook, text_enc_hook

# A request or reply longer than this is refused: the status is a few KB at most.
MAX_MESSAGE_BYTES = 1 << 16

STATUS = "status"
# Reads answered from the control thread at once, even while the loop is stuck in a collective.
COLLECTIVES = "collectives"  # the rank's collective record (args: {"limit": N})
STACKS = "stacks"  # every thread's Python stack, as faulthandler prints it
READ_COMMANDS: frozenset[str] = frozenset({STATUS, COLLECTIVES, STACKS})


class ControlCommand(StrEnum):
    """The controls: queued by the trainer's control thread, applied by every rank at the next step boundary."""

    CHECKPOINT_NOW = "checkpoint_now"
    PAUSE = "pause"
    RESUME = "resume"
    LEAVE = "leave"
    RESTART_FROM = "restart_from"


CONTROL_COMMANDS: frozenset[str] = frozenset(c.value for c in ControlCommand)
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


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (even one we may not signal): is a trainer's writer still there."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    if req.cmd == ControlCommand.RESTART_FROM:
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


def events_after(status: TrainerStatus, seq: int) -> list[Event]:
    """The events in ``status`` newer than ``seq`` (what a relay has not sent yet)."""
    return [e for e in status.events if e.seq > seq]
