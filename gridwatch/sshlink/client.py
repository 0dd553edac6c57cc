"""The console's side of the stream: one SSH connection per node, kept alive.

Host keys are checked against known_hosts (and weak ones refused), a lost
connection is retried with jittered backoff, and a reconnect resumes from the
last seq seen, so nothing is lost that the agent still holds; what it no longer
holds is reported as a gap. A restarted agent (a new boot id) is read from its
first frame. A link's node name is pinned by its first hello: frames naming
another node are dropped and counted, and a second link claiming a name already
held is refused. A hello name must be a plain node name, and an endpoint given
by host name admits only that host's name (see :func:`gridwatch.sshlink.links.hello_name_refusal`). Every string a peer sends is cleaned before it is logged or
stored. Data code: never imports textual.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import asyncssh
from loguru import logger

from gridwatch.sshlink import lean
from gridwatch.sshlink.hostlist import Endpoint
from gridwatch.sshlink.links import (
    MAX_ERROR_CHARS,
    FleetOptions,
    LinkRefused,
    LinkState,
    NodeLink,
    RelayStatus,
    explain,
    hello_name_refusal,
    weak_host_key,
)
from gridwatch.sshlink.policy import client_options, weak_key_reason
from gridwatch.sshlink.stream import LineStream
from gridwatch.wire import protocol as p
from gridwatch.wire.heard import LOOP_STALL_S, HeardOrder

# Names other modules import from here, whichever module of the SSH layer defines them.
__all__ = ["Fleet", "FleetOptions", "LinkState", "NodeLink", "RelayStatus", "explain", "hello_name_refusal"]

# A relay's link: a half-open one under a quiet relay is closed after three unanswered keepalives.
RELAY_KEEPALIVE_S = 60.0
# An action an agent refused as over the key's budget is sent again after the wait it names, if that is at most
# the longest here (a key spent for longer is refused to its caller at once); never sooner than the shortest.
OVER_BUDGET_MIN_WAIT_S, OVER_BUDGET_MAX_WAIT_S = 0.05, 2.0
OVER_BUDGET_ANSWER_S = 1.0  # the time a resent action keeps for its answer (half the timeout, if shorter)


FrameCallback = Callable[[NodeLink, p.Frame], None]

# A relay's: a node's frame passed on as its line, with what was read of it.
PassingCallback = Callable[[NodeLink, p.Passing, bytes], None]
StatusCallback = Callable[[NodeLink], None]
RelayCallback = Callable[["RelayStatus"], None]


def _unanswered(req_id: str, action: str, why: str) -> p.ActionResult:
    """A failed result for an action no agent answered, saying why."""
    return p.ActionResult(id=p.Text(req_id), action=p.Text(action), ok=False, message=p.Text(why))


class Fleet:
    """Connections to many agents; frames and status changes go to callbacks."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        options: FleetOptions,
        on_frame: FrameCallback | None = None,
        on_status: StatusCallback | None = None,
        relays: Mapping[Endpoint, Sequence[Endpoint]] | None = None,
        on_relay: RelayCallback | None = None,
        on_passing: PassingCallback | None = None,
    ) -> None:
        self.options = options
        # With it, summaries, samples, events and log lines are read only as far as their order and owner
        # (decode_passing) and handed over as lines: a relay, which passes them on as written.
        self.on_passing = on_passing
        self.on_frame = on_frame or (lambda link, frame: None)
        self.on_status = on_status or (lambda link: None)
        self.on_relay = on_relay or (lambda relay: None)  # a relay's own link went up or down
        self.links: dict[Endpoint, NodeLink] = {ep: NodeLink(endpoint=ep, name=str(ep)) for ep in endpoints}
        # Nodes a relay carries are links like the others; only their frames travel through it.
        self.relays: dict[Endpoint, RelayStatus] = {}
        for relay, nodes in (relays or {}).items():
            carried: dict[str, NodeLink] = {}
            for ep in nodes:
                link = self.links.setdefault(ep, NodeLink(endpoint=ep, name=str(ep)))
                link.via = relay
                carried[str(ep)] = link
            self.relays[relay] = RelayStatus(endpoint=relay, carried=carried)
        self._relay_procs: dict[Endpoint, LineStream] = {}
        self._procs: dict[Endpoint, LineStream] = {}
        self._conns: dict[Endpoint, asyncssh.SSHClientConnection | lean.LeanConnection] = {}
        # Request id -> (the link asked, its answer): only that link may answer it.
        self._pending: dict[str, tuple[Endpoint, asyncio.Future[Any]]] = {}
        self._claims: dict[str, Endpoint] = {}  # pinned node name -> the link that holds it
        # The links by their last frame, oldest first, with their intervals: the staleness walk reads only the
        # links silent long enough to be stale, not every link every second.
        self._heard_order: HeardOrder[Endpoint, NodeLink] = HeardOrder()
        self._tasks: list[asyncio.Task[None]] = []
        self._client_keys: list[asyncssh.SSHKey] | None = None
        self._lean = False  # agents' links read by libssh2 (set at start)
        self._stopping = False

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        try:
            self._client_keys = [asyncssh.read_private_key(self.options.key_path)]
        except (OSError, asyncssh.KeyImportError) as exc:
            raise RuntimeError(f"cannot read the key {self.options.key_path}: {exc}") from None
        try:
            chosen = lean.ssh_client()
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None
        if self.options.ssh_client != "auto":
            chosen = self.options.ssh_client
        self._lean = lean.AVAILABLE and chosen == "libssh2"
        # A fleet stopped and started again keeps each link's place (last seq, pinned name).
        self._stopping = False
        self._tasks = [asyncio.create_task(self._run_link(link)) for link in self.links.values() if link.via is None]
        self._tasks += [asyncio.create_task(self._run_relay(relay)) for relay in self.relays.values()]
        self._tasks.append(asyncio.create_task(self._watch_staleness()))

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for conn in list(self._conns.values()):
            conn.close()
        self._conns.clear()
        self._procs.clear()
        self._relay_procs.clear()

    def find(self, node: str) -> NodeLink | None:
        """A link by the agent's node name or by ``host:port``."""
        for link in self.links.values():
            if link.name == node or str(link.endpoint) == node:
                return link
        return None

    @property
    def connected(self) -> int:
        return sum(1 for link in self.links.values() if link.state in (LinkState.CONNECTED, LinkState.STALE))

    # --------------------------------------------------------------- requests

    def send(self, link: NodeLink, frame: p.Frame) -> bool:
        """Write one frame to ``link``'s agent (or its relay); False when there is no stream to write to."""
        return self._send(link, frame)

    def _send(self, link: NodeLink, frame: p.Frame) -> bool:
        if link.via is not None:
            # Through the relay: it hands the frame to the node as we wrote it.
            proc = self._relay_procs.get(link.via)
            data = p.encode(p.relayed(str(link.endpoint), frame))
        else:
            proc = self._procs.get(link.endpoint)
            data = p.encode(frame)
        if proc is None:
            return False
        try:
            proc.write(data)
        except (OSError, asyncssh.Error):
            return False
        return True

    async def action(
        self, node: str, action: str, args: dict[str, Any] | None = None, reason: str = "", timeout: float = 30.0,
        fence: int | None = None, key: str | None = None,
    ) -> p.ActionResult:
        """Ask one agent to act; the reply, or a failed result saying why there was none.

        ``fence`` is the leading console's fencing token and ``key`` the step's idempotency
        key (docs/protocol.md); a console alone sends neither.
        """
        link = self.find(node)
        if link is None:
            return _unanswered(uuid.uuid4().hex[:12], action, f"unknown node {node!r}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            result = await self._act_once(link, action, args, reason, max(deadline - loop.time(), 0.0), fence, key)
            # Refused as over the key's budget, the agent did nothing and says when it admits a request again:
            # sent again then, while the caller's time lasts (a burst after a take-over must not fail a step).
            if result.code != p.ResultCode.OVER_BUDGET:
                return result
            named = result.data.get("retry_after_s")
            if not isinstance(named, (int, float)) or not 0 <= named <= OVER_BUDGET_MAX_WAIT_S:
                return result  # a budget that long spent is the operator's to hear of, not to wait out
            wait = max(float(named), OVER_BUDGET_MIN_WAIT_S)
            # Sent again only with time left for its answer: one admitted with milliseconds to go would run and
            # be reported as unanswered, where the refusal said for certain that nothing ran.
            if loop.time() + wait + min(OVER_BUDGET_ANSWER_S, timeout / 2) >= deadline:
                return result
            await asyncio.sleep(wait)

    async def _act_once(self, link: NodeLink, action: str, args: dict[str, Any] | None, reason: str, timeout: float,
                        fence: int | None, key: str | None) -> p.ActionResult:
        req_id = uuid.uuid4().hex[:12]
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = (link.endpoint, fut)
        try:
            frame = p.Action(id=p.Text(req_id), action=p.Text(action), args=args or {}, reason=p.Text(reason),
                             fence=fence, key=p.Text(key) if key is not None else None)
            if not self._send(link, frame):
                return _unanswered(req_id, action, f"{link.name} is not connected ({link.state}: {link.last_error or 'no connection'})")
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            return _unanswered(req_id, action, f"{link.name} did not answer {action} within {timeout:g} s")
        finally:
            self._pending.pop(req_id, None)

    async def search(
        self,
        pattern: str,
        nodes: list[str] | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 500,
        on_progress: Callable[[int, int], None] | None = None,
        timeout: float = 10.0,
    ) -> list[p.LogLine]:
        """Ask every (selected, connected) agent; merge the answers by time."""
        links = [l for l in self.links.values() if nodes is None or l.name in nodes or str(l.endpoint) in nodes]
        total, answered = len(links), 0
        results: list[p.LogLine] = []

        async def one(link: NodeLink) -> None:
            nonlocal answered
            req_id = uuid.uuid4().hex[:12]
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._pending[req_id] = (link.endpoint, fut)
            try:
                if self._send(link, p.Search(id=p.Text(req_id), pattern=p.Text(pattern), since=since, until=until, limit=limit)):
                    res: p.SearchResult = await asyncio.wait_for(fut, timeout)
                    for line in res.lines:
                        line.node = p.Text(link.name)
                    results.extend(res.lines)
            except TimeoutError:
                pass
            finally:
                self._pending.pop(req_id, None)
                answered += 1
                if on_progress:
                    on_progress(answered, total)

        await asyncio.gather(*(one(link) for link in links))
        results.sort(key=lambda line: line.line_ts)
        return results[-limit:] if limit else results

    def subscription(self, link: NodeLink, resume_from: int | None) -> p.Subscribe:
        """What this link asks for: summaries (or full samples while its node is open), logs, the watches."""
        o = self.options
        mode = p.StreamMode.FULL if link.want_full else o.mode
        return p.Subscribe(resume_from=resume_from, logs=link.want_logs, mode=mode,
                           every=o.summary_every if mode is p.StreamMode.SUMMARY else 0.0, watches=o.watches)

    def subscribe_logs(self, node: str, on: bool) -> None:
        link = self.find(node)
        if link is None:
            return
        # Logs are streamed for the nodes an operator looks at: those get full samples too.
        link.want_logs = link.want_full = on
        self._send(link, self.subscription(link, link.last_seq or None))

    def subscribe_full(self, node: str, on: bool) -> None:
        """Full samples from ``node`` while an operator looks at it; summaries again after."""
        link = self.find(node)
        if link is None or link.want_full == on:
            return
        link.want_full = on
        self._send(link, self.subscription(link, link.last_seq or None))

    def set_watches(self, watches: list[p.Watch]) -> None:
        """Conditions every agent should evaluate (the loaded playbooks'); sent to every connected agent now."""
        self.options.watches = list(watches)
        for link in self.links.values():
            if link.via is None:
                self._send(link, self.subscription(link, link.last_seq or None))
        for relay in self.relays.values():  # one message per relay: it applies them to every node it carries
            self._send_relay(relay, self._relay_subscription(relay, first=False))

    # ------------------------------------------------------------ connection

    def _set(self, link: NodeLink, state: LinkState, error: str | None = None) -> None:
        if error is not None:
            error = p.clean_text(error, MAX_ERROR_CHARS)
        changed = link.state != state or (error is not None and error != link.last_error)
        link.state = state
        if error is not None:
            link.last_error = error
        if changed:
            self.on_status(link)

    async def _run_link(self, link: NodeLink) -> None:
        log = logger.bind(node=link.name)
        while not self._stopping:
            link.attempts += 1
            try:
                await self._connect_and_stream(link)
                link.attempts = 0  # a session that ended cleanly resets the backoff
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # every failure becomes a state and a sentence
                state, message = explain(link.endpoint, exc, self.options.known_hosts)
                if message != link.last_error:
                    log.warning(message)
                self._set(link, state, message)
            finally:
                self._procs.pop(link.endpoint, None)
                conn = self._conns.pop(link.endpoint, None)
                if conn is not None:
                    conn.close()
            if self._stopping:
                return
            if link.state in (LinkState.CONNECTED, LinkState.STALE, LinkState.CONNECTING):
                self._set(link, LinkState.DOWN, link.last_error or "connection closed")
            await asyncio.sleep(self._backoff(link))

    def _backoff(self, link: NodeLink | RelayStatus) -> float:
        o = self.options
        base = min(o.backoff_max, o.backoff_min * 2 ** max(link.attempts - 1, 0))
        if link.state == LinkState.REFUSED:
            base = o.backoff_max  # a wrong key stays wrong until someone fixes it
        # Jitter so 1,000 consoles' links do not reconnect in lockstep after an outage.
        return base * o.rng.uniform(0.5, 1.0)

    async def _open(self, endpoint: Endpoint, conns: dict[Endpoint, asyncssh.SSHClientConnection | lean.LeanConnection],
                    keepalive: float = 0.0) -> LineStream:
        """An SSH connection to ``endpoint`` (kept in ``conns`` for the caller to close) and its gridwatch stream.

        ``keepalive``: seconds between keepalives, 0 for none. An agent's link needs none: a silent one is
        closed by _watch_staleness after ``dead_intervals`` of its cadence, sooner than three keepalives
        would, and asyncssh re-arms its keepalive timer at every packet received (a timer cancelled and
        one scheduled per message). A relay's link keeps them: its silence is not watched, its nodes' is.
        """
        o = self.options
        if not keepalive and self._lean and self._client_keys:
            # An agent's link: its packets read by libssh2 (a relay's keeps asyncssh's keepalives).
            try:
                _, stream = await asyncio.wait_for(
                    lean.open_lean(endpoint, conns, username=o.username, key=self._client_keys[0],
                                   known_hosts=o.known_hosts, subsystem=p.SUBSYSTEM),
                    o.connect_timeout)
            except lean.Unexplained:
                # libssh2 keeps no far end's reason: asyncssh tries this once, and opens the link or says why not.
                failed = conns.pop(endpoint, None)
                if failed is not None:
                    failed.close()
            else:
                return stream  # its host key checked for weakness before our key was offered
        conn = await asyncio.wait_for(
            asyncssh.connect(
                endpoint.host,
                endpoint.port,
                username=o.username,
                client_keys=self._client_keys,
                known_hosts=o.known_hosts,
                agent_path=None,
                config=None,
                preferred_auth="publickey",
                keepalive_interval=keepalive,
                **client_options(),
            ),
            o.connect_timeout,
        )
        conns[endpoint] = conn
        self._refuse_weak(endpoint, conn.get_server_host_key())
        _, session = await asyncio.wait_for(
            conn.create_session(LineStream, subsystem=p.SUBSYSTEM, encoding=None), o.connect_timeout)
        assert isinstance(session, LineStream)
        return session

    def _refuse_weak(self, endpoint: Endpoint, host_key: asyncssh.SSHKey | None) -> None:
        weak = weak_key_reason(host_key) if host_key is not None else None
        if weak:
            raise weak_host_key(endpoint, weak, self.options.known_hosts)

    async def _connect_and_stream(self, link: NodeLink) -> None:
        o = self.options
        self._set(link, LinkState.CONNECTING)
        stream = await self._open(link.endpoint, self._conns)
        hello = await asyncio.wait_for(self._first_frame(stream), o.connect_timeout)
        self._on_hello(link, hello)
        self._procs[link.endpoint] = stream

        def oversized(count: int) -> None:
            link.bad_frames += count
            self._set(link, link.state, f"{link.name}: {count} oversized frame(s) dropped")

        # The lines that came with the hello first; from here each message is handled in the channel's own
        # callback: no task is woken per message.
        stream.on_oversized = oversized
        stream.start(lambda line: self._on_line(link, line))
        # No resume point means "start live"; a restarted agent is read from its first frame.
        resume_from = 0 if link.read_from_start else (link.last_seq or None)
        link.read_from_start = False
        if not self._send(link, self.subscription(link, resume_from)):
            raise ConnectionError("the agent closed the stream after its hello")
        self._set(link, LinkState.CONNECTED, None)
        await stream.closed
        raise ConnectionError("the agent closed the stream")

    # ------------------------------------------------------------ relays

    def _relay_subscription(self, relay: RelayStatus, first: bool) -> p.RelaySubscribe:
        """What we ask a relay: the nodes it carries and where we stand in each (first), and the stream's terms."""
        o = self.options
        nodes = [
            p.RelayNode(endpoint=p.Text(ep), resume_from=0 if link.read_from_start else (link.last_seq or None),
                        read_from_start=link.read_from_start, full=link.want_full, logs=link.want_logs)
            for ep, link in relay.carried.items()
        ] if first else []
        return p.RelaySubscribe(nodes=nodes, mode=o.mode, every=o.summary_every if o.mode is p.StreamMode.SUMMARY else 0.0,
                                watches=o.watches, flush=o.relay_flush)

    def _send_relay(self, relay: RelayStatus, frame: p.Frame) -> bool:
        proc = self._relay_procs.get(relay.endpoint)
        if proc is None:
            return False
        try:
            proc.write(p.encode(frame))
        except (OSError, asyncssh.Error):
            return False
        return True

    async def _run_relay(self, relay: RelayStatus) -> None:
        log = logger.bind(node=str(relay.endpoint))
        while not self._stopping:
            relay.attempts += 1
            try:
                await self._relay_session(relay)
                relay.attempts = 0
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # every failure becomes a state and a sentence, for each node carried
                state, message = explain(relay.endpoint, exc, self.options.known_hosts)
                message = "relay " + message.replace("the agent", "the relay")
                if message != relay.last_error:
                    log.warning(message)
                self._relay_is(relay, state, message)
            finally:
                self._relay_procs.pop(relay.endpoint, None)
                conn = self._conns.pop(relay.endpoint, None)
                if conn is not None:
                    conn.close()
            if self._stopping:
                return
            # A session ends only by an exception: the relay is down or refused now, and so are its nodes.
            for link in relay.carried.values():
                self._set(link, relay.state, relay.last_error or f"relay {relay.endpoint}: the relay closed the link")
            await asyncio.sleep(self._backoff(relay))

    def _relay_is(self, relay: RelayStatus, state: LinkState, error: str | None) -> None:
        """The relay's own link is in ``state``; told once per change, not at each attempt while it stays so."""
        changed = relay.state != state
        relay.state, relay.last_error = state, error
        if changed:
            self.on_relay(relay)

    async def _relay_session(self, relay: RelayStatus) -> None:
        o = self.options
        # Its state stays what it was (connecting at first, down while retried) until it is up.
        stream = await self._open(relay.endpoint, self._conns, keepalive=RELAY_KEEPALIVE_S)
        hello = await asyncio.wait_for(self._first_frame(stream), o.connect_timeout)
        if not hello.relay:
            raise LinkRefused(f"{relay.endpoint}: this is an agent ({hello.node}), not a relay; list it under nodes, "
                              "not as a relay's address")
        relay.name, relay.role = str(hello.node), str(hello.role)
        self._relay_procs[relay.endpoint] = stream
        if not self._send_relay(relay, self._relay_subscription(relay, first=True)):
            raise ConnectionError("the relay closed the stream after its hello")
        for link in relay.carried.values():
            link.read_from_start = False
        relay.attempts = 0
        self._relay_is(relay, LinkState.CONNECTED, None)

        def oversized(count: int) -> None:
            relay.bad_frames += count

        def on_line(line: bytes) -> None:
            self._on_relay_line(relay, line)

        def read() -> None:
            # One message is many nodes' frames: the relay sends them together, which is what it is for.
            relay.reads += 1

        stream.on_oversized = oversized
        stream.on_chunk = read
        stream.start(on_line)
        await stream.closed
        raise ConnectionError("the relay closed the stream")

    def _on_relay_line(self, relay: RelayStatus, line: bytes) -> None:
        relay.messages += 1
        try:
            frame = p.decode_agent_frame(line)
        except p.FrameError as exc:
            self._relay_bad(relay, str(exc))
            return
        if isinstance(frame, p.Relayed):
            link = relay.carried.get(str(frame.endpoint))
            if link is None:
                self._relay_bad(relay, f"a frame for {frame.endpoint}, which we did not ask it to carry")
                return
            self._on_line(link, bytes(frame.frame))
        elif isinstance(frame, p.RelayLink):
            link = relay.carried.get(str(frame.endpoint))
            if link is None:
                self._relay_bad(relay, f"a link state for {frame.endpoint}, which we did not ask it to carry")
                return
            try:
                state = LinkState(str(frame.state))
            except ValueError:
                self._relay_bad(relay, f"an unknown link state {str(frame.state)!r} for {frame.endpoint}")
                return
            if frame.role is not None and link.role is None:
                link.role = str(frame.role)
            if link.barred and state in (LinkState.CONNECTED, LinkState.STALE):
                return  # its hello was refused here: the relay's word does not lift that
            error = f"{frame.error} (through relay {relay.name or relay.endpoint})" if frame.error else None
            self._set(link, state, error)
        elif isinstance(frame, p.Error):
            relay.last_error = p.clean_text(f"relay {relay.name or relay.endpoint}: {frame.message}", MAX_ERROR_CHARS)
            logger.bind(node=str(relay.endpoint)).warning("{}", relay.last_error)
        else:
            self._relay_bad(relay, f"a {frame.__struct_config__.tag} frame outside a relayed one")

    def _relay_bad(self, relay: RelayStatus, what: str) -> None:
        relay.bad_frames += 1
        if relay.bad_frames in (1, 10, 100) or relay.bad_frames % 1000 == 0:
            relay.last_error = p.clean_text(f"relay {relay.name or relay.endpoint}: {what}", MAX_ERROR_CHARS)
            logger.bind(node=str(relay.endpoint)).warning("bad frame #{} from the relay: {}", relay.bad_frames, relay.last_error)

    async def _first_frame(self, stream: LineStream) -> p.Hello:
        """The hello (taken from the stream: the lines after it go to its handler once started)."""
        received = await stream.first_lines()
        if not received:
            err = bytes(stream.stderr).decode(errors="replace")
            raise ConnectionError(p.clean_text(err, 200) or "the agent closed the stream before its hello")
        frame = p.decode_agent_frame(received.pop(0))
        if isinstance(frame, p.Hello):
            return frame
        raise ConnectionError(f"expected a hello frame first, got {frame.__struct_config__.tag}")

    def _pin(self, link: NodeLink, hello: p.Hello) -> str:
        """The name this link speaks for; raises :class:`LinkRefused` when it may not have it."""
        said = str(hello.node)
        if said:
            why = hello_name_refusal(link.endpoint, said)
            if why:
                raise LinkRefused(why)
        name = said or str(link.endpoint)
        if link.pinned is not None and name != link.pinned:
            raise LinkRefused(
                f"{link.endpoint}: the agent now says it is {name!r} but it was {link.pinned!r}; "
                "its frames are refused until the console restarts"
            )
        holder = self._claims.get(name)
        if holder is None and name != str(link.endpoint) and any(str(ep) == name for ep in self.links):
            holder = next(ep for ep in self.links if str(ep) == name)
        if holder is not None and holder != link.endpoint:
            raise LinkRefused(
                f"{link.endpoint}: the agent says it is {name!r}, which the agent at {holder} already is; "
                "its frames are refused (give every node its own name)"
            )
        if link.pinned is None:
            link.pinned = name
            self._claims[name] = link.endpoint
        return name

    def _on_hello(self, link: NodeLink, hello: p.Hello) -> None:
        name = self._pin(link, hello)
        log = logger.bind(node=name)
        if hello.v > p.PROTOCOL_VERSION and not link.newer_protocol_noted:
            link.newer_protocol_noted = True
            log.info("agent speaks protocol v{} (we speak v{}): reading what we understand", hello.v, p.PROTOCOL_VERSION)
        link.name = name
        hello.node = p.Text(name)
        link.role = str(hello.role)
        previous, link.hello = link.hello, hello
        lost: p.Gap | None = None
        if previous is not None and self._restarted(link, previous, hello):
            # The new boot numbers its frames afresh: resuming from the old boot's seq would
            # skip (or repeat) frames, and what the old boot never sent is gone.
            link.restarts += 1
            said = max(previous.last_seq, link.last_seq)
            lost = p.Gap(
                node=p.Text(name), ts=hello.ts, from_seq=link.last_seq + 1, to_seq=said,
                reason=p.Text(f"agent restarted: frames after seq {link.last_seq} of the old boot were never delivered"),
            )
            link.gaps += said - link.last_seq
            link.last_gap = str(lost.reason)
            log.warning("{}", lost.reason)
            link.last_seq = 0
            link.read_from_start = True
        link.last_frame_at = self.options.clock()
        self._heard_order.heard(link.endpoint, link, link.last_frame_at)
        self._heard_order.every(link.endpoint, link.interval)
        self.on_frame(link, hello)
        if lost is not None and not self.options.relaying:
            self.on_frame(link, lost)

    @staticmethod
    def _restarted(link: NodeLink, previous: p.Hello, hello: p.Hello) -> bool:
        if previous.boot_id or hello.boot_id:
            return previous.boot_id != hello.boot_id
        # An agent without boot ids is recognised only by numbering from 1 again.
        return hello.last_seq < link.last_seq

    def _foreign(self, link: NodeLink, claimed: str) -> None:
        """A frame naming another node (``claimed``, cleaned): dropped, counted, said (rate-limited)."""
        link.foreign_frames += 1
        n = link.foreign_frames
        if n in (1, 10, 100) or n % 1000 == 0:
            message = (
                f"{link.name}: {n} frame(s) dropped that claimed to come from {claimed!r}; "
                "an agent speaks only for the node it said hello as"
            )
            logger.bind(node=link.name).warning("{}", message)
            self._set(link, link.state, message)

    def _on_line(self, link: NodeLink, line: bytes) -> None:
        if self.on_passing is not None and link.via is None:
            head = p.decode_passing(line)
            if head is not None:
                self._pass(link, head, line)
                return
        try:
            frame = p.decode_agent_frame(line)
        except p.FrameError as exc:
            link.bad_frames += 1
            link.last_error = p.clean_text(f"{link.name}: {exc}", MAX_ERROR_CHARS)
            if link.bad_frames in (1, 10, 100) or link.bad_frames % 1000 == 0:
                logger.bind(node=link.name).warning("bad frame #{}: {}", link.bad_frames, exc)
            return
        if link.via is not None:
            if isinstance(frame, p.Hello):
                # Through a relay the hello comes in the stream: the same checks as on a link of our own.
                try:
                    self._on_hello(link, frame)
                except LinkRefused as exc:
                    link.barred = True
                    self._set(link, LinkState.REFUSED, str(exc))
                    logger.bind(node=link.name).warning("{}", exc)
                else:
                    link.barred = False
                return
            if link.barred or isinstance(frame, (p.Relayed, p.RelayLink)):
                return  # a refused node's frames, or a relay's frame where a node's belongs
        node = frame.node
        if not node:
            frame.node = p.Text(link.pinned or link.name)
        elif node != link.pinned:  # a Text is a str: compared as it is, not copied to compare
            self._foreign(link, str(node))
            return
        self._heard(link)
        if isinstance(frame, (p.ActionResult, p.SearchResult)):
            asked, fut = self._pending.get(str(frame.id), (None, None))
            if fut is not None and asked == link.endpoint and not fut.done():
                fut.set_result(frame)
            elif self.options.relaying:
                self.on_frame(link, frame)  # a relay's: the console that asked waits for it
                return
            if isinstance(frame, p.SearchResult):
                return
        elif isinstance(frame, p.Gap):
            link.gaps += max(frame.to_seq - frame.from_seq + 1, 0)
            link.last_seq = max(link.last_seq, frame.to_seq)
            link.last_gap = f"frames {frame.from_seq}-{frame.to_seq} lost: {frame.reason}"
        elif frame.seq:
            if isinstance(frame, p.Summary):
                fresh = self._in_order(link, frame.seq, frame.every, frame.after)
            else:
                fresh = self._in_order(link, frame.seq, 0.0 if isinstance(frame, p.Sample) else None)
            if not fresh:
                link.repeated += 1
                return
        self.on_frame(link, frame)

    def _heard(self, link: NodeLink) -> None:
        """``link``'s node spoke: counted, its time kept, and a stale link (or one down behind a relay) up again."""
        link.frames += 1
        link.last_frame_at = now = self.options.clock()
        self._heard_order.heard(link.endpoint, link, now)
        if not self._heard_order.counted(link.endpoint):  # a frame ahead of its hello
            self._heard_order.every(link.endpoint, link.interval)
        if link.state == LinkState.STALE or (link.via is not None and link.state == LinkState.DOWN):
            self._set(link, LinkState.CONNECTED)

    def _in_order(self, link: NodeLink, seq: int, every: float | None, after: int | None = None) -> bool:
        """Note a numbered frame's place in ``link``'s stream; False for one already seen (a resume overlapped).

        ``after``: a summary's (the seq it follows); ``every``: the cadence the frame says (a summary's, 0.0 for a
        whole sample), None for a frame that says none (an event, a log line).
        """
        if seq <= link.last_seq:
            return False
        # A summary says which frame it follows: the samples between were folded into it, not lost.
        # Between summaries folded samples leave holes before events too; the next summary's
        # ``after`` tells whether a frame went missing there.
        follows = min(after, seq - 1) if after is not None else (link.last_seq if link.every > 0 else seq - 1)
        if link.last_seq and follows > link.last_seq:
            link.gaps += follows - link.last_seq
        if every is not None and every != link.every:
            link.every = every
            self._heard_order.every(link.endpoint, link.interval)
        link.last_seq = seq
        return True

    def _pass(self, link: NodeLink, head: p.Passing, line: bytes) -> None:
        """A frame a relay passes on as written: the checks _on_line makes of it, on what was read of it."""
        assert self.on_passing is not None
        if head.node and head.node != link.pinned:
            self._foreign(link, p.clean_text(head.node, 200))
            return
        self._heard(link)
        if head.seq:
            summary = isinstance(head, p.PassingSummary)
            every = head.every if summary else 0.0 if isinstance(head, p.PassingSample) else None
            if not self._in_order(link, head.seq, every, head.after if summary else None):
                return
        self.on_passing(link, head, line)

    async def _watch_staleness(self) -> None:
        o = self.options
        loop = asyncio.get_running_loop()
        due = loop.time()
        awake_since = float("-inf")  # silence counts from here at the earliest: this loop was stalled before
        while True:
            now = o.clock()
            if loop.time() - due > LOOP_STALL_S:
                # This watcher woke late, so the loop that reads the links was stalled too: their frames of that
                # time may wait unread (an agent beside it was stalled with it). A link closed now would be a
                # healthy node's stream cut; each gets its intervals again from here.
                awake_since = now
            # Only a link silent past the shortest interval's threshold can be stale or dead.
            floor = min(o.stale_intervals, o.dead_intervals) * self._heard_order.shortest(1.0)
            for link in self._heard_order.quiet(now, floor):
                if link.state not in (LinkState.CONNECTED, LinkState.STALE) or link.last_frame_at is None:
                    continue
                interval = link.interval
                silent = now - max(link.last_frame_at, awake_since)
                if silent > o.dead_intervals * interval:
                    conn = self._conns.get(link.endpoint) if link.via is None else None
                    self._set(link, LinkState.DOWN, f"{link.name}: silent for {silent:.0f} s; reconnecting")
                    if conn is not None:
                        conn.close()
                elif silent > o.stale_intervals * interval and link.state == LinkState.CONNECTED:
                    self._set(link, LinkState.STALE, f"{link.name}: no frame for {silent:.1f} s")
            # Four times a second for a small fleet, once for a large one (a node is stale only after three of
            # its intervals, seconds, so a second later is no news lost).
            every = 0.25 if len(self.links) < 500 else 1.0
            due = loop.time() + every
            await asyncio.sleep(every)
