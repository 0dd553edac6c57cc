"""The console's control socket: an operator's node actions from the command line, run through the runtime.

A console running headless (the service on a head node) has no screen to put a
node back in service from. It serves a unix socket next to its incident
database; ``gridwatch node return|isolate`` sends one request there and gets
one reply. A request is one line of JSON (:class:`NodeRequest`), the reply
one line (:class:`NodeReply`); nothing else travels, and nothing is unpickled.

The action goes through :meth:`ConsoleRuntime.node_action`, the path the TUI's
node view takes: audited before and after, refused when the console is
read-only, and a return to service hands the node back to the scheduler when
the drain there is gridwatch's (a drain still pending is stopped first).

Who may ask: the socket is made 0600 whatever the umask, and every connection's
peer is checked (``SO_PEERCRED``): this user and root only, so a loose mode on
the file or its folder lets nobody else in. The client, in turn, believes only
a socket served by itself, root, or the owner of the folder it lies in.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import secrets
import socket
import stat
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, cast

import msgspec
from loguru import logger

from gridwatch.wire.controlsock import Peer, peer_of
from gridwatch.wire.protocol import AgentAction, clean_text

if TYPE_CHECKING:
    from gridwatch.console.runtime.core import ConsoleRuntime

# A request is a node name and a reason: a few hundred bytes.
MAX_REQUEST_BYTES = 4096
MAX_REASON_CHARS = 500
# sockaddr_un.sun_path holds 108 bytes, the last one a NUL.
MAX_SOCKET_PATH_BYTES = 107
# A client that connects and sends nothing is dropped after this long.
READ_TIMEOUT_S = 10.0
# A refused user is logged once a minute at most, so a peer that keeps trying cannot fill the log.
REFUSAL_LOG_S = 60.0
VERSION = 1


class NodeVerb(StrEnum):
    """What an operator can ask of a node from the command line."""

    RETURN = "return"  # back in service: the agent unisolates, the scheduler resumes gridwatch's drain
    ISOLATE = "isolate"  # out of service: the agent isolates, its trainer leaves the job


# The agent action each verb is, sent through the runtime.
VERB_ACTIONS: dict[NodeVerb, AgentAction] = {NodeVerb.RETURN: AgentAction.UNISOLATE, NodeVerb.ISOLATE: AgentAction.ISOLATE}


class Outcome(StrEnum):
    """How a request ended; the command line's exit code follows from it."""

    DONE = "done"
    REFUSED = "refused"  # this console may not do it (read-only, or the peer is not allowed)
    FAILED = "failed"  # it was tried and did not happen (the agent refused or did not answer)
    BAD_REQUEST = "bad_request"  # the request itself is wrong (unknown node, no reason, unreadable)


class NodeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One line from ``gridwatch node`` to the console."""

    verb: NodeVerb
    node: str
    reason: str
    operator: str = ""  # who, for the audit log (the peer is this console's user or root, so it is believed)
    force: bool = False  # return a node a history rule keeps out (the override is audited)
    v: int = VERSION


class NodeReply(msgspec.Struct, kw_only=True):
    """The console's one-line answer."""

    outcome: Outcome
    message: str


class ControlError(OSError):
    """The control socket cannot be served or reached; the message is one sentence for the operator."""


_request_decoder = msgspec.json.Decoder(NodeRequest)
_reply_decoder = msgspec.json.Decoder(NodeReply)


def socket_for(db_path: str | os.PathLike[str]) -> str:
    """Where the console that keeps its incidents in ``db_path`` serves its control socket: beside it, ``.sock``."""
    return str(Path(db_path).with_suffix(".sock"))


def encode_request(request: NodeRequest) -> bytes:
    return msgspec.json.encode(request) + b"\n"


def encode_reply(reply: NodeReply) -> bytes:
    return msgspec.json.encode(reply) + b"\n"


def decode_request(line: bytes) -> NodeRequest:
    """The request in ``line``; ValueError in one line when it is not one."""
    try:
        request = _request_decoder.decode(line.strip())
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"unreadable request: {clean_text(str(exc), 200)}") from None
    if request.v != VERSION:
        raise ValueError(f"request version {request.v} is not {VERSION}: use the gridwatch of this console")
    if not request.node.strip():
        raise ValueError("no node named")
    if not request.reason.strip():
        raise ValueError("no reason given: say why (it goes to the audit log and the scheduler)")
    return request


def _check_path(path: str) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise ControlError(f"the control socket path {path} is longer than the {MAX_SOCKET_PATH_BYTES} bytes a unix "
                           "socket allows: keep the incident database in a shorter path")


def _answers(path: str) -> bool:
    """Whether something listens at ``path`` now."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


class ControlServer:
    """Serves ``path`` for ``runtime``: one request per connection, from this user or root only."""

    def __init__(self, runtime: ConsoleRuntime, path: str) -> None:
        self.runtime = runtime
        self.path = path
        self._server: asyncio.Server | None = None
        self._inode: int | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._refusals: dict[int, tuple[float, int]] = {}  # uid -> (when last logged, refused since)

    async def start(self) -> None:
        """Listen at ``path``; ControlError in one sentence when another console serves it or it cannot be made."""
        _check_path(self.path)
        path = Path(self.path)
        if path.is_socket() and _answers(self.path):
            raise ControlError(f"another console already serves {self.path}: stop it, or give this one its own --db")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._bind(sock, path)
            self._inode = path.lstat().st_ino
            self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=MAX_REQUEST_BYTES)
        except OSError as exc:
            sock.close()
            raise ControlError(f"cannot serve the control socket {self.path}: {exc.strerror or exc}") from None
        logger.info("control socket at {} (mode 0600: this user and root)", self.path)

    @staticmethod
    def _bind(sock: socket.socket, path: Path) -> None:
        """Bind in a fresh private folder beside ``path``, make it 0600 there, then move it into place.

        Nobody can reach the socket before its mode is set; a link or file
        planted at ``path`` is replaced, never followed; a socket left by a
        console that was killed is replaced too.
        """
        staging = path.parent / f".gw-{secrets.token_hex(3)}"
        os.mkdir(staging, 0o700)
        try:
            temp = staging / "s"
            sock.bind(str(temp))
            os.chmod(temp, 0o600)
            os.rename(temp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging / "s")
            os.rmdir(staging)

    async def stop(self) -> None:
        """Stop listening, let requests under way finish, and remove the socket if it is still ours."""
        if self._server is None:
            return
        self._server.close()
        await self._server.wait_closed()
        self._server = None
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(self.path).st_ino == self._inode:
                os.unlink(self.path)

    def admit(self, peer: Peer) -> bool:
        return peer.uid in (os.geteuid(), 0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            reply = await self._exchange(reader, writer)
            writer.write(encode_reply(reply))
            await writer.drain()
        except (ConnectionError, OSError):
            pass  # the client went away; what it asked was audited if it ran
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()
            if task is not None:
                self._handlers.discard(task)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> NodeReply:
        try:
            peer = peer_of(cast(socket.socket, writer.get_extra_info("socket")))
        except OSError as exc:
            logger.warning("control socket: refused a connection whose peer is unknown ({})", exc.strerror or exc)
            return NodeReply(outcome=Outcome.REFUSED, message="refused: the peer's credentials cannot be read")
        if not self.admit(peer):
            self._log_refusal(peer)
            return NodeReply(outcome=Outcome.REFUSED,
                             message="refused: only this console's user and root may use its control socket")
        try:
            line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
        except (ValueError, asyncio.LimitOverrunError):
            return NodeReply(outcome=Outcome.BAD_REQUEST, message=f"request exceeds {MAX_REQUEST_BYTES} bytes")
        except TimeoutError:
            return NodeReply(outcome=Outcome.BAD_REQUEST, message=f"no request within {READ_TIMEOUT_S:g} s")
        try:
            request = decode_request(line)
        except ValueError as exc:
            return NodeReply(outcome=Outcome.BAD_REQUEST, message=str(exc))
        return await self.answer(request, peer)

    async def answer(self, request: NodeRequest, peer: Peer) -> NodeReply:
        """Run one admitted request through the runtime and say how it went."""
        node = clean_text(request.node, 200)
        reason = clean_text(request.reason, MAX_REASON_CHARS)
        who = clean_text(request.operator, 100).strip() or _login(peer.uid)
        runtime = self.runtime
        if runtime.store.by_name(node) is None:
            known = sorted(n.name for n in runtime.store.nodes.values())
            return NodeReply(outcome=Outcome.BAD_REQUEST,
                             message=f"unknown node {node!r}: this console watches {', '.join(known) or 'no node yet'}")
        if runtime.read_only:
            return NodeReply(outcome=Outcome.REFUSED, message=f"cannot {request.verb} {node}: this console is read-only")
        logger.bind(node=node).info("control socket: {} {} by {} (uid {}, pid {}): {}", request.verb, node, who,
                                    peer.uid, peer.pid, reason)
        result = await runtime.node_action(node, VERB_ACTIONS[request.verb], reason, who=who, force=request.force)
        message = clean_text(str(result.message), 1000)
        return NodeReply(outcome=Outcome.DONE if result.ok else Outcome.FAILED, message=message)

    def _log_refusal(self, peer: Peer) -> None:
        now = self.runtime.store.clock.now()
        last, since = self._refusals.get(peer.uid, (None, 0))
        if last is not None and now - last < REFUSAL_LOG_S:
            self._refusals[peer.uid] = (last, since + 1)
            return
        self._refusals[peer.uid] = (now, 0)
        more = f" ({since} more refused since the last report)" if since else ""
        logger.warning("control socket: refused uid {} (pid {}): only this user and root may use it{}",
                       peer.uid, peer.pid, more)


def _login(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _trusted_server(path: str, uid: int) -> bool:
    """A console is believed when it runs as this user, root, or the owner of the socket's folder."""
    if uid in (os.geteuid(), 0):
        return True
    try:
        return os.stat(Path(path).parent).st_uid == uid
    except OSError:
        return False


async def send(path: str, request: NodeRequest, timeout: float = 120.0) -> NodeReply:
    """Send ``request`` to the console serving ``path`` and return its reply.

    Raises :class:`ControlError` in one sentence when no console answers there
    (none running, the socket stale, or not this user's to use).
    """
    _check_path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise ControlError(f"no console is running here: nothing serves {path} (is `gridwatch console --headless` "
                           "running with this database? else give --socket PATH)") from None
    except OSError as exc:
        raise ControlError(f"cannot reach the console at {path}: {exc.strerror or exc}") from None
    if not stat.S_ISSOCK(mode):
        raise ControlError(f"{path} is not a console's control socket")
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_unix_connection(path, limit=MAX_REQUEST_BYTES * 4)
            try:
                uid = peer_of(cast(socket.socket, writer.get_extra_info("socket"))).uid
                if not _trusted_server(path, uid):
                    raise ControlError(f"refusing the console at {path}: its socket is served by uid {uid}, not by "
                                       "this user, root or the owner of its folder")
                writer.write(encode_request(request))
                with contextlib.suppress(ConnectionError):
                    await writer.drain()  # a console that refused this peer closed at once; its reason is here
                try:
                    line = await reader.readline()
                except ConnectionResetError:
                    line = b""
            finally:
                writer.close()
                with contextlib.suppress(ConnectionError, OSError):
                    await writer.wait_closed()
    except TimeoutError:
        raise ControlError(f"the console at {path} did not answer within {timeout:g} s") from None
    except ConnectionRefusedError:
        raise ControlError(f"no console is running here: {path} is left from one that stopped") from None
    except PermissionError:
        raise ControlError(f"not allowed to use {path}: run this as the console's user or root") from None
    except ControlError:
        raise
    except (OSError, ValueError) as exc:
        raise ControlError(f"cannot reach the console at {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not line:
        raise ControlError(f"the console at {path} closed the connection without a reply")
    try:
        reply = _reply_decoder.decode(line.strip())
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ControlError(f"the console at {path} sent an unreadable reply: {clean_text(str(exc), 200)}") from None
    return NodeReply(outcome=reply.outcome, message=clean_text(reply.message, 1000))
