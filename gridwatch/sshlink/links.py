"""What the console knows of each link to its fleet, and the words for it: a link's state and options, a relay's
link, which node name an agent may speak as, and one sentence for why a link failed.

The connections themselves are :class:`gridwatch.sshlink.client.Fleet`'s.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import asyncssh

from gridwatch.sshlink.hostlist import Endpoint
from gridwatch.wire import protocol as p
from gridwatch.wire.names import node_name_refusal

# Errors quote what a peer sent; this is enough to say what happened.
MAX_ERROR_CHARS = 300


def hello_name_refusal(endpoint: Endpoint, name: str) -> str:
    """Why the agent at ``endpoint`` may not speak as ``name``; '' when it may.

    An endpoint given by host name binds the name: the agent must be that host
    or its first label (``node001.cluster:8022`` may be ``node001``). One given
    by IP address names no node, so there the first hello pins the name; what
    tells such agents apart is each node's own host key, which the console pins.
    """
    refused = node_name_refusal(name)
    if refused:
        return f"{endpoint}: the agent says it is {refused}"
    host = endpoint.host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return ""
    wanted = host.lower().rstrip(".")
    if name.lower() in (wanted, wanted.split(".", 1)[0]):
        return ""
    return (
        f"{endpoint}: the agent says it is {name!r}, but this endpoint is the host {host}; its frames are refused "
        f"(name the agent {wanted.split('.', 1)[0]!r}, or list the node by its address)"
    )


class LinkState(StrEnum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    STALE = "stale"  # connected, but no frame for STALE_AFTER_INTERVALS intervals
    DOWN = "down"  # cannot connect or the connection dropped
    REFUSED = "refused"  # the key or the host key is wrong: retrying will not help by itself


@dataclass
class NodeLink:
    """What the console knows about its link to one agent."""

    endpoint: Endpoint
    name: str
    state: LinkState = LinkState.CONNECTING
    role: str | None = None
    last_error: str | None = None
    last_frame_at: float | None = None
    last_seq: int = 0
    frames: int = 0  # frames received and decoded
    repeated: int = 0  # of them, numbered frames already had (a resume's overlap): dropped
    gaps: int = 0  # frames the agent no longer had when we asked
    bad_frames: int = 0
    hello: p.Hello | None = None
    want_logs: bool = False
    want_full: bool = False  # full samples: an operator has this node open
    every: float = 0.0  # seconds between the summaries it sends (their ``every``); 0: one per sample
    attempts: int = 0
    newer_protocol_noted: bool = False
    pinned: str | None = None  # the node name its first hello gave; later frames must carry it
    foreign_frames: int = 0  # frames dropped because they named another node
    restarts: int = 0  # new boot ids seen after the first hello
    last_gap: str | None = None  # what the last gap was, in words
    read_from_start: bool = False  # the agent restarted: ask for its new boot from its first frame
    via: Endpoint | None = None  # the relay that carries this node's stream; None: a link of our own
    barred: bool = False  # through a relay: its last hello was refused, so its frames are dropped

    @property
    def interval(self) -> float:
        """Its heartbeat: the hello's tick, or the summaries' cadence while they come."""
        return max(self.hello.interval if self.hello else 1.0, self.every)


@dataclass
class RelayStatus:
    """The console's link to one relay (``gridwatch relay``) and the nodes it carries for us."""

    endpoint: Endpoint
    carried: dict[str, NodeLink]  # "host:port" -> the node's link
    name: str = ""  # the relay's own name, from its hello
    state: LinkState = LinkState.CONNECTING
    role: str | None = None  # what our key may do at the relay
    last_error: str | None = None
    attempts: int = 0
    bad_frames: int = 0
    messages: int = 0  # lines received from it
    reads: int = 0  # reads of its stream: the console's wake-ups for it, many lines each


class LinkRefused(Exception):
    """The console will not take this agent's frames; the message says why and what to do."""


def weak_host_key(endpoint: Endpoint, weak: str, known_hosts: str) -> LinkRefused:
    """The refusal of an agent whose host key is ``weak`` (policy.weak_key_reason): pinned or not, a key this weak
    proves little about who answers."""
    return LinkRefused(f"{endpoint}: the agent's host key is {weak}; give the agent a new host key "
                       f"and trust it with: gridwatch keys trust {endpoint} --known-hosts {known_hosts}")


@dataclass
class FleetOptions:
    key_path: str
    known_hosts: str
    username: str = "gridwatch"
    connect_timeout: float = 5.0
    backoff_min: float = 0.5
    backoff_max: float = 30.0
    stale_intervals: float = p.STALE_AFTER_INTERVALS  # no frame within this many intervals: stale
    dead_intervals: float = 10.0  # ... this many: drop the connection and reconnect
    # The console's runtime asks summaries (and full samples for the nodes an operator opens,
    # subscribe_full); a bare Fleet (``gridwatch tail``) gets every sample whole.
    mode: p.StreamMode = p.StreamMode.FULL
    summary_every: float = 0.0  # seconds between a node's summaries; 0: one per sample
    watches: list[p.Watch] = field(default_factory=list)  # conditions the agents evaluate for the engine
    # Through a relay: the longest it may hold a node's frame to send it with others (events go at once).
    relay_flush: float = 0.5
    # A relay's own Fleet, carrying nodes for a console: answers no request of its own waits for go to
    # on_frame (they are the console's), and an agent's restart makes no gap here (the console counts it
    # against its own last seq when the new boot's hello reaches it).
    relaying: bool = False
    # Who reads an agent's packets: "auto" as GRIDWATCH_SSH_CLIENT says (libssh2 unless it says asyncssh),
    # "libssh2" (gridwatch.sshlink.lean, where installed: half asyncssh's CPU per message) or "asyncssh".
    # A relay's own link is asyncssh's either way.
    ssh_client: str = "auto"
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)


def explain(endpoint: Endpoint, exc: BaseException, known_hosts: str) -> tuple[LinkState, str]:
    """One sentence for the operator: what happened and what to do.

    Reasons quote the peer (an SSH disconnect reason is sent by whatever listens at
    the address, before its host key is checked), so the sentence is cleaned whole.
    """
    state, message = _explain(endpoint, exc, known_hosts)
    return state, p.clean_text(message, MAX_ERROR_CHARS)


def _explain(endpoint: Endpoint, exc: BaseException, known_hosts: str) -> tuple[LinkState, str]:
    if isinstance(exc, LinkRefused):
        return LinkState.REFUSED, str(exc)
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return LinkState.REFUSED, (
            f"{endpoint}: host key not trusted by {known_hosts} (unknown or changed); check its fingerprint, "
            f"then run: gridwatch keys trust {endpoint} --known-hosts {known_hosts}"
        )
    if isinstance(exc, asyncssh.PermissionDenied):
        return LinkState.REFUSED, (
            f"{endpoint}: the agent refused our key; add its .pub to the agent's authorized_viewers or authorized_operators"
        )
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return LinkState.DOWN, f"{endpoint}: no answer within the timeout"
    if isinstance(exc, ConnectionRefusedError):
        return LinkState.DOWN, f"{endpoint}: connection refused (is the agent running?)"
    if isinstance(exc, asyncssh.ChannelOpenError):
        return LinkState.DOWN, f"{endpoint}: the agent refused the gridwatch subsystem: {exc.reason}"
    if isinstance(exc, OSError):
        return LinkState.DOWN, f"{endpoint}: {exc.strerror or exc}"
    if isinstance(exc, asyncssh.Error):
        return LinkState.DOWN, f"{endpoint}: {exc.reason or type(exc).__name__}"
    return LinkState.DOWN, f"{endpoint}: {str(exc) or type(exc).__name__}"
