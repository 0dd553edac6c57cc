"""The relay (``gridwatch relay``): holds the SSH links to a rack's agents and sends their frames to each console on one link.

A console pays a wake-up, a decrypt and a task switch per message it receives;
through a relay it receives many nodes' frames in one write. Per console
session the relay runs a :class:`~gridwatch.sshlink.client.Fleet` of the nodes that
console asked for (only those on the relay's own list), with the relay's own
key, and wraps each frame in a :class:`~gridwatch.wire.protocol.Relayed` frame. It
holds nothing the console needs after a session ends: the console resumes each
node from its own last seq, and the agents' rings hold the frames in between.

Its SSH face is the agent's: public keys only (a console's role is the list its
key is in), no shell, exec, forwarding or SFTP, only the ``gridwatch``
subsystem. Frames and wire: docs/protocol.md, "Relays".
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import tomllib
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import asyncssh
import msgspec
from loguru import logger
from msgspec import Meta

from gridwatch.sshlink.client import Fleet, FleetOptions, LinkState, NodeLink
from gridwatch.sshlink.hostlist import Endpoint, HostlistError, parse_endpoints
from gridwatch.sshlink.keys import KeySet, make_host_key
from gridwatch.sshlink.server import (
    Caller,
    Gate,
    RoleKeyServer,
    SubsystemSession,
    admitted,
    authorized_file_problem,
    subsystem_server_options,
    weaker_role,
)
from gridwatch.wire import protocol as p
from gridwatch.wire.framing import LineBuffer
from gridwatch.wire.protocol import AGENT_VERSION
from gridwatch.wire.settings import ConfigError

READ_CHUNK = 65536
DEFAULT_LISTEN = "0.0.0.0:8023"
DEFAULT_KEYS = "/etc/gridwatch"
RELAY_HOST_KEY = "relay_host_key"  # in the keys directory, made on first start when no host key is there
# The longest a frame waits for others to share its write, whatever the console asks.
FLUSH_MIN_S, FLUSH_MAX_S = 0.05, 2.0
# A console this far behind is let go: the relay must not hold a slow reader's backlog, and the console
# resumes every node from the agents' rings when it is back.
MAX_UNSENT_BYTES = 8 << 20
# Frames that may wait for the next batch; everything else (events, hellos, gaps, answers, errors) goes at once.
BATCHED: tuple[type[p.Frame], ...] = (p.Summary, p.Sample, p.LogLine)
NOT_CARRIED = "not one of this relay's nodes"


class RelayError(RuntimeError):
    """The relay cannot start; the message says what to fix."""


def parse_endpoint(text: str) -> Endpoint | None:
    """One ``host:port`` as a console names a node; None when it is not exactly one."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c in host for c in "[],"):
        return None
    return Endpoint(host, int(port))


# ------------------------------------------------------------------ settings


HostPort = Annotated[str, Meta(pattern=r"^\S*:\d{1,5}$")]
NodeName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")]


class RelaySettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything a relay is told: relay.toml's keys, which the flags of the same names override."""

    listen: HostPort = DEFAULT_LISTEN
    nodes: str | list[str] = ""  # hostlist syntax (or a list of such strings): the only agents it links to
    name: NodeName = msgspec.field(default_factory=lambda: socket.gethostname().split(".", 1)[0] or "relay")
    keys: Annotated[str, Meta(min_length=1)] = DEFAULT_KEYS  # a directory laid out as ``gridwatch keys init`` makes it

    @property
    def node_spec(self) -> str:
        return self.nodes if isinstance(self.nodes, str) else ",".join(self.nodes)


EXPECTED: dict[str, str] = {
    "listen": 'HOST:PORT to listen on, e.g. "0.0.0.0:8023"',
    "nodes": 'a hostlist string or a list of them, e.g. "node[017-512]:8022"',
    "name": "a plain name (letters, digits, '.', '_', '-'), e.g. \"head1\"",
    "keys": "a path to the key directory (operator_key, known_hosts, authorized_viewers, authorized_operators)",
}


def load_settings(path: str | None, overrides: dict[str, Any]) -> tuple[RelaySettings, list[Endpoint]]:
    """Defaults, then ``path`` (relay.toml), then the flags that were given; and the nodes it carries.

    Raises :class:`ConfigError` in one sentence naming the file (or the flag) and the key.
    """
    data: dict[str, Any] = {}
    where = "relay settings"
    if path:
        where = path
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not UTF-8 text") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        settings = msgspec.convert(data, RelaySettings)
    except msgspec.ValidationError as exc:
        raise _settings_error(where, data, str(exc)) from None
    try:
        settings = msgspec.convert({**msgspec.structs.asdict(settings), **given}, RelaySettings)
    except msgspec.ValidationError as exc:
        raise _settings_error("flags", given, str(exc), flags=True) from None
    if int(settings.listen.rpartition(":")[2]) > 65535:
        raise ConfigError(f"{'--listen' if 'listen' in given else where + ': listen'}: expected {EXPECTED['listen']}, "
                          f"got {settings.listen!r}")
    source = "--nodes" if "nodes" in given else f"{where}: nodes"
    if not settings.node_spec.strip():
        raise ConfigError(f"{source}: no nodes: expected {EXPECTED['nodes']}")
    try:
        nodes = parse_endpoints(settings.node_spec)
    except HostlistError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if path and "keys" not in given:
        # A relative key directory in relay.toml is read from the file's folder, as cluster.toml's paths are.
        settings.keys = str(Path(path).parent / Path(settings.keys).expanduser())
    return settings, nodes


def _settings_error(where: str, data: dict[str, Any], message: str, flags: bool = False) -> ConfigError:
    unknown = re.search(r"unknown field `([^`]*)`", message)
    if unknown:
        return ConfigError(f"{where}: unknown key {unknown.group(1)!r} (known keys: {', '.join(RelaySettings.__struct_fields__)})")
    at = re.search(r"at `\$\.([A-Za-z0-9_-]+)", message)
    if at:
        key = at.group(1)
        got = f", got {data[key]!r}"[:120] if key in data else ""
        return ConfigError(f"{'--' + key.replace('_', '-') if flags else where + ': ' + key}: expected {EXPECTED.get(key, 'something else')}{got}")
    return ConfigError(f"{where}: {message}")


@dataclass
class RelayKeys:
    """The files a relay reads, found in one keys directory."""

    client_key: str  # the relay's own key, which the agents' lists authorize (their operator key)
    known_hosts: str  # pins the agents' host keys
    authorized_viewers: str  # consoles that may watch through the relay
    authorized_operators: str  # ... and act
    host_key: str  # what the relay shows consoles

    @classmethod
    def from_dir(cls, directory: str | Path) -> RelayKeys:
        """As ``gridwatch keys init`` lays a directory out; the host key is the fleet's shared one if it is there."""
        ks = KeySet(Path(directory))
        own = ks.dir / RELAY_HOST_KEY
        host_key = own if own.exists() or not ks.host_key.exists() else ks.host_key
        return cls(str(ks.operator_key), str(ks.known_hosts), str(ks.authorized_viewers),
                   str(ks.authorized_operators), str(host_key))


# ------------------------------------------------------------------ sessions


class SessionState(StrEnum):
    WAITING = "waiting"  # hello sent, no relay_subscribe yet
    RELAYING = "relaying"
    CLOSED = "closed"


@dataclass
class RelayCounts:
    """What a relay has done since it started, over every console session."""

    sessions: int = 0
    frames: int = 0  # agents' frames forwarded to consoles
    writes: int = 0  # writes to consoles (each a batch of frames)
    requests: int = 0  # consoles' frames forwarded to agents
    refused_actions: int = 0  # viewers' acting requests the relay answered itself
    bad_lines: int = 0
    dropped_sessions: int = 0  # consoles let go for not reading


class ConsoleSession:
    """One console on the relay: the nodes it asked for, and the batches of their frames on its way."""

    def __init__(self, relay: Relay, process: asyncssh.SSHServerProcess, caller: Caller) -> None:
        self.relay = relay
        self.process = process
        self.caller = caller
        self.state = SessionState.WAITING
        self.fleet: Fleet | None = None
        self.flush_every = 0.5
        self.bad_lines = 0
        self.log = logger.bind(node=relay.name)
        self._out: list[bytes] = []
        self._timer: asyncio.TimerHandle | None = None
        self._done = asyncio.Event()

    def closed(self) -> bool:
        return self.state is SessionState.CLOSED

    # -------------------------------------------------------------- writing

    def _emit(self, frame: p.Frame, urgent: bool) -> None:
        self._emit_raw(p.encode(frame), urgent)

    def _emit_raw(self, data: bytes, urgent: bool) -> None:
        if self.state is SessionState.CLOSED:
            return
        self._out.append(data)
        if urgent:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.flush_every, self.flush)

    def flush(self) -> None:
        """Everything held, in one write."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._out or self.state is SessionState.CLOSED:
            return
        data = b"".join(self._out)
        self._out.clear()
        try:
            self.process.stdout.write(data)
        except (OSError, asyncssh.Error):
            self.close()
            return
        self.relay.counts.writes += 1
        unsent = self.process.channel.get_write_buffer_size()
        if unsent > self.relay.max_unsent:
            self.relay.counts.dropped_sessions += 1
            self.log.warning("closing the session of {}: {:.1f} MB unsent, it is not reading; it resumes from the agents "
                             "when it is back", self.caller, unsent / (1 << 20))
            self.close(abort=True)

    def _error(self, code: str, message: str) -> None:
        self._emit(p.Error(code=p.Text(code), message=p.Text(message), ts=p.now(), node=p.Text(self.relay.name)), urgent=True)

    def _relayed(self, endpoint: Endpoint, frame: p.Frame, urgent: bool) -> None:
        self._emit(p.relayed(str(endpoint), frame), urgent)

    def close(self, abort: bool = False) -> None:
        if self.state is SessionState.CLOSED:
            return
        self.state = SessionState.CLOSED
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        with contextlib.suppress(OSError, asyncssh.Error):
            if abort:
                self.process.channel.abort()
            else:
                self.process.exit(1)
        self._done.set()

    # ------------------------------------------------------------ the fleet

    def _on_frame(self, link: NodeLink, frame: p.Frame) -> None:
        # What the fleet decoded whole: hellos, answers, gaps, errors (the rest comes by _on_passing).
        if isinstance(frame, p.Hello):
            # What a console may do through the relay is the lesser of its role here and the relay's there.
            frame = msgspec.structs.replace(frame, role=p.Text(weaker_role(self.caller.role, frame.role)))
        self.relay.counts.frames += 1
        self._relayed(link.endpoint, frame, urgent=not isinstance(frame, BATCHED))

    def _on_passing(self, link: NodeLink, head: p.Passing, line: bytes) -> None:
        # A node's frame as its agent wrote it: checked here as far as its owner and order (the fleet's _pass),
        # decoded whole and cleaned by the console, as any node's: neither decoded nor encoded again on the way.
        self.relay.counts.frames += 1
        self._emit_raw(p.relayed_line(str(link.endpoint), line), urgent=isinstance(head, p.PassingEvent))

    def _on_status(self, link: NodeLink) -> None:
        role = weaker_role(self.caller.role, link.role) if link.role else None
        self._emit(p.RelayLink(endpoint=p.Text(str(link.endpoint)), state=p.Text(link.state.value),
                               error=p.Text(link.last_error) if link.last_error else None,
                               role=p.Text(role) if role else None, ts=p.now(), node=p.Text(self.relay.name)), urgent=True)

    async def _carry(self, sub: p.RelaySubscribe) -> None:
        """Run a fleet of the nodes asked for that this relay may carry; say which it will not."""
        self.flush_every = min(max(sub.flush, FLUSH_MIN_S), FLUSH_MAX_S)
        old = self.fleet
        if old is not None and not sub.nodes:
            # A later relay_subscribe without nodes: new terms for every node carried, in place.
            self._retune(old, sub)
            return
        wanted: dict[Endpoint, p.RelayNode] = {}
        for node in sub.nodes:
            ep = parse_endpoint(str(node.endpoint))
            if ep is None or ep not in self.relay.allowed:
                self._emit(p.RelayLink(endpoint=node.endpoint, state=p.Text(LinkState.REFUSED.value),
                                       error=p.Text(f"{p.clean_text(str(node.endpoint), 200)}: {NOT_CARRIED}"),
                                       ts=p.now(), node=p.Text(self.relay.name)), urgent=True)
                continue
            wanted[ep] = node
        if old is not None and set(old.links) == set(wanted):
            self._retune(old, sub)
            return
        if old is not None:
            self.fleet = None
            await old.stop()
        fleet = Fleet(list(wanted), self.relay.fleet_options(sub), on_frame=self._on_frame, on_status=self._on_status,
                      on_passing=self._on_passing)
        for ep, node in wanted.items():
            link = fleet.links[ep]
            kept = old.links.get(ep) if old is not None else None
            if kept is not None:  # a node this session already carried goes on from where the relay is
                link.last_seq, link.read_from_start = kept.last_seq, kept.read_from_start
                link.want_full, link.want_logs = kept.want_full, kept.want_logs
            else:
                link.last_seq = max(node.resume_from or 0, 0)
                link.read_from_start = node.read_from_start
                link.want_full, link.want_logs = node.full, node.logs
        self.fleet = fleet
        try:
            await fleet.start()
        except RuntimeError as exc:  # the relay's own key went unreadable since it started
            self.fleet = None
            self.log.error("{}", exc)
            self._error("relay_broken", f"the relay cannot reach its nodes: {exc}")
            self.close()

    @staticmethod
    def _retune(fleet: Fleet, sub: p.RelaySubscribe) -> None:
        """The cadence and watches of ``sub`` for every node ``fleet`` carries, sent to each agent now."""
        fleet.options.mode, fleet.options.summary_every = sub.mode, max(sub.every, 0.0)
        fleet.set_watches(list(sub.watches))

    # ------------------------------------------------------------- requests

    def _bad_line(self, exc: p.FrameError) -> None:
        self.bad_lines += 1
        self.relay.counts.bad_lines += 1
        if self.bad_lines in (1, 10, 100) or self.bad_lines % 1000 == 0:
            self.log.warning("bad line #{} from {}: {}", self.bad_lines, self.caller, exc)
        self._error(exc.code, str(exc))

    async def _on_line(self, line: bytes) -> None:
        try:
            frame = p.decode_client_frame(line)
        except p.FrameError as exc:
            self._bad_line(exc)
            return
        if self.state is SessionState.WAITING and not isinstance(frame, p.RelaySubscribe):
            self._error("relay_subscribe_first", f"this is a relay: send relay_subscribe first, not "
                        f"{frame.__struct_config__.tag}; closing the session")
            self.flush()
            self.close()
            return
        if isinstance(frame, p.RelaySubscribe):
            self.state = SessionState.RELAYING
            await self._carry(frame)
        elif isinstance(frame, p.Relayed):
            self._request(frame)
        else:
            self._error("not_relayed", f"send a node's {frame.__struct_config__.tag} inside a relayed frame "
                        "naming its endpoint")

    def _request(self, outer: p.Relayed) -> None:
        ep = parse_endpoint(str(outer.endpoint))
        fleet = self.fleet
        link = fleet.links.get(ep) if fleet is not None and ep is not None else None
        if fleet is None or ep is None or link is None:
            self._error("not_carried", f"{p.clean_text(str(outer.endpoint), 200)} is not carried in this session "
                        "(name it in relay_subscribe)")
            return
        try:
            frame = p.decode_client_frame(bytes(outer.frame))
        except p.FrameError as exc:
            self._bad_line(exc)
            return
        if isinstance(frame, p.Subscribe):
            link.want_full = frame.mode is p.StreamMode.FULL
            link.want_logs = frame.logs
            fleet.send(link, fleet.subscription(link, link.last_seq or None))
        elif isinstance(frame, p.Action):
            self._action(fleet, link, frame)
        elif isinstance(frame, p.Search):
            if fleet.send(link, msgspec.structs.replace(frame, behalf=self._behalf())):
                self.relay.counts.requests += 1
            else:
                self._relayed(ep, p.SearchResult(id=frame.id, error=p.Text(_no_link(link)), node=p.Text(link.name)), urgent=True)
        else:
            self._error("not_a_node_request", f"a relayed {frame.__struct_config__.tag} is not a request an agent takes")

    def _behalf(self) -> p.Behalf:
        """Who the agent is to cap and budget a forwarded request by: this session's console key and role."""
        return p.Behalf(key=p.Text(self.caller.key), role=p.Text(self.caller.role))

    def _action(self, fleet: Fleet, link: NodeLink, action: p.Action) -> None:
        name = str(action.action)

        def answer(message: str) -> None:
            self._relayed(link.endpoint, p.ActionResult(id=action.id, action=action.action, ok=False,
                                                        message=p.Text(message), node=p.Text(link.name)), urgent=True)

        if self.caller.role != "operator" and name not in p.VIEWER_ACTIONS:
            self.relay.counts.refused_actions += 1
            self.log.warning("refused action {} on {} (id {}) from {}: a viewer's key", name, link.name, str(action.id), self.caller)
            answer(f"the relay took a viewer's key: {name!r} needs the operator role")
            return
        # A scene copy's reads come by the hundred; the console audits the copy itself.
        self.log.log("DEBUG" if name in p.READ_ACTIONS else "INFO",
                     "action {} on {} (id {}) from console key {} ({}) because {!r}", name, link.name,
                     str(action.id), self.caller.key, self.caller.role, str(action.reason))
        if fleet.send(link, msgspec.structs.replace(action, behalf=self._behalf())):
            self.relay.counts.requests += 1
        else:
            answer(_no_link(link))

    # ---------------------------------------------------------------- run

    async def run(self) -> None:
        self.relay.counts.sessions += 1
        self.log.info("console connected: {}", self.caller)
        hello = p.Hello(node=p.Text(self.relay.name), relay=True, role=p.Text(self.caller.role),
                        agent_version=p.Text(AGENT_VERSION), ts=p.now())
        self._emit(hello, urgent=True)
        reader = asyncio.create_task(self._read())
        closed = asyncio.create_task(self._done.wait())
        try:
            await asyncio.wait({reader, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            reader.cancel()
            closed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            fleet, self.fleet = self.fleet, None
            if fleet is not None:
                await fleet.stop()
            self.close()
            self.log.info("console gone: {} ({} bad lines)", self.caller, self.bad_lines)

    async def _read(self) -> None:
        lines = LineBuffer()
        try:
            while self.state is not SessionState.CLOSED:
                data = await self.process.stdin.read(READ_CHUNK)
                if not data:
                    return
                for line in lines.feed(data):
                    await self._on_line(line)
                    if self.closed():  # _on_line may have closed it
                        return
                if lines.oversized:
                    lines.oversized = 0
                    self._bad_line(p.FrameError("too_large", f"a line over {p.MAX_FRAME_BYTES} bytes dropped"))
        except (asyncssh.BreakReceived, asyncssh.SignalReceived, asyncssh.TerminalSizeChanged):
            return
        except (asyncssh.DisconnectError, ConnectionError, asyncio.IncompleteReadError):
            return


def _no_link(link: NodeLink) -> str:
    return f"{link.name}: the relay has no link to it now ({link.state.value}: {link.last_error or 'no connection'})"


# ------------------------------------------------------------------ the SSH face


class _RelayServer(RoleKeyServer):
    """A console's connection to the relay: the keys' lists from the key directory, its session a ConsoleSession."""

    def __init__(self, relay: Relay) -> None:
        super().__init__(relay.gate, relay.name)
        self.relay = relay

    def authorized(self) -> tuple[str, str]:
        return self.relay.keys.authorized_operators, self.relay.keys.authorized_viewers

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        super().connection_made(conn)
        if self._counted:  # not turned away at the gate
            self.relay.connections.add(conn)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._conn is not None:
            self.relay.connections.discard(self._conn)

    def session_requested(self) -> asyncssh.SSHServerSession:
        return SubsystemSession(lambda proc: self.relay.session(proc), self)


@dataclass
class Relay:
    """One relay: its name, the nodes it may carry, its keys; serves consoles until closed."""

    name: str
    nodes: list[Endpoint]
    keys: RelayKeys
    connect_timeout: float = 5.0
    backoff_min: float = 0.5
    backoff_max: float = 30.0
    max_unauthenticated: int = 64
    login_timeout: float = 30.0
    max_unsent: int = MAX_UNSENT_BYTES
    counts: RelayCounts = field(default_factory=RelayCounts)
    sessions: dict[ConsoleSession, asyncio.Task[Any] | None] = field(default_factory=dict)
    connections: set[asyncssh.SSHServerConnection] = field(default_factory=set)
    allowed: frozenset[Endpoint] = frozenset()
    _acceptor: asyncssh.SSHAcceptor | None = None

    def __post_init__(self) -> None:
        self.allowed = frozenset(self.nodes)
        self.log = logger.bind(node=self.name)
        self.gate = Gate(limit=self.max_unauthenticated)  # consoles still authenticating, capped as an agent caps them

    def fleet_options(self, sub: p.RelaySubscribe) -> FleetOptions:
        return FleetOptions(
            key_path=self.keys.client_key, known_hosts=self.keys.known_hosts, connect_timeout=self.connect_timeout,
            backoff_min=self.backoff_min, backoff_max=self.backoff_max,
            mode=sub.mode, summary_every=max(sub.every, 0.0), watches=list(sub.watches),
            relaying=True,
        )

    def host_key(self) -> asyncssh.SSHKey:
        """The key consoles pin for the relay; made (ed25519, 0600) on first start when the directory has none."""
        path = Path(self.keys.host_key)
        if not path.exists():
            try:
                made = make_host_key(path, comment=f"gridwatch-relay-{self.name}")
            except OSError as exc:
                raise RelayError(f"cannot create the relay host key {path}: {exc.strerror or exc}") from None
            self.log.info("made a new host key {} ({}); pin it on each console with: gridwatch keys trust HOST:PORT",
                          path, made.get_fingerprint())
        try:
            return asyncssh.read_private_key(str(path))
        except (OSError, asyncssh.KeyImportError) as exc:
            raise RelayError(f"cannot read the relay host key {path}: {exc}") from None

    def check_keys(self) -> None:
        """Say now, not at the first console, what in the key directory cannot work."""
        try:
            asyncssh.read_private_key(self.keys.client_key)
        except (OSError, asyncssh.KeyImportError) as exc:
            raise RelayError(f"cannot read the relay's key {self.keys.client_key} (the key the agents authorize): {exc}") from None
        if not Path(self.keys.known_hosts).exists():
            raise RelayError(f"no {self.keys.known_hosts}: pin the agents' host keys there with: gridwatch keys trust "
                             f"HOSTLIST --known-hosts {self.keys.known_hosts}")
        for path in (self.keys.authorized_viewers, self.keys.authorized_operators):
            try:
                problem = authorized_file_problem(path, Path(path).stat())
            except FileNotFoundError:
                problem = f"{path} does not exist"
            if problem:
                self.log.warning("{}: it grants no console", problem)

    async def start(self, host: str, port: int) -> int:
        """Listen for consoles; the port it listens on."""
        self.check_keys()
        host_key = self.host_key()
        self._acceptor = await asyncssh.create_server(
            lambda: _RelayServer(self), host, port, server_host_keys=[host_key], **subsystem_server_options(self.login_timeout))
        return int(self._acceptor.sockets[0].getsockname()[1])

    async def session(self, process: asyncssh.SSHServerProcess) -> None:
        caller = admitted(process, "relay")
        if caller is None:
            return
        session = ConsoleSession(self, process, caller)
        self.sessions[session] = asyncio.current_task()
        try:
            await session.run()
        finally:
            self.sessions.pop(session, None)

    async def close(self) -> None:
        """Stop listening, end every console's session and its links."""
        if self._acceptor is not None:
            self._acceptor.close()
            self._acceptor = None
        running = [task for task in self.sessions.values() if task is not None]
        for session in list(self.sessions):
            session.close()
        for conn in list(self.connections):
            conn.close()
        self.connections.clear()
        # Each session stops its own fleet on the way out; the agents see their links close.
        if running:
            await asyncio.wait(running, timeout=5.0)
