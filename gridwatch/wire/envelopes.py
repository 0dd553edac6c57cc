"""Frames through a relay: the nodes a console asks a relay to carry, and the envelope a node's frame travels in.

A relay (``gridwatch relay``, one per few hundred nodes) holds the links to its nodes and sends
their frames to a console on one link, many to a write: the console pays one message per
batch instead of one per node. Frames pass through it as each end encoded them (docs/protocol.md).
"""

from __future__ import annotations

import msgspec

from gridwatch.wire.frames import Frame, StreamMode
from gridwatch.wire.requests import Watch
from gridwatch.wire.text import Text


class RelayNode(msgspec.Struct, gc=False, kw_only=True):
    """One node a console asks a relay to carry, and where the console's copy of its stream stands."""

    endpoint: Text  # host:port, as the relay reaches the agent
    resume_from: int | None = None  # the last seq the console has of it (None: start live)
    read_from_start: bool = False  # the agent restarted: read its new boot from its first frame
    full: bool = False  # full samples (an operator has the node open)
    logs: bool = False


class RelaySubscribe(Frame, tag="relay_subscribe"):
    """Console -> relay, first: carry these nodes, with the stream each should send."""

    nodes: list[RelayNode] = []
    mode: StreamMode = StreamMode.SUMMARY
    every: float = 0.0  # summary mode: at most one summary per node this many seconds
    watches: list[Watch] = []
    # The longest a relay holds a node's frame to send it with others; events, answers and link
    # changes go at once.
    flush: float = 0.5


class Relayed(Frame, tag="relayed"):
    """Either way through a relay: one frame of the node at ``endpoint``, its JSON as that end wrote it."""

    endpoint: Text
    frame: msgspec.Raw


class RelayLink(Frame, tag="relay_link"):
    """Relay -> console: the relay's link to one node changed (the words of the console's link states)."""

    endpoint: Text
    state: Text  # connecting, connected, stale, down, refused
    error: Text | None = None
    role: Text | None = None  # what the relay's key may do on that node


class Passing(msgspec.Struct, tag_field="type", kw_only=True, gc=False):
    """What a relay reads of a node's frame that it passes on as written: the fields its order and owner are in.

    The console decodes the frame whole (and cleans its text, as any node's); the relay reads this much of
    the frames that come by the thousand and decodes the others (hello, answers, gaps, errors) whole.
    """

    seq: int = 0
    node: str = ""
    # A summary's: the seq it follows and its cadence (0.0 for a frame that is not a summary).
    after: int = 0
    every: float = 0.0


class PassingSummary(Passing, tag="summary"):
    pass


class PassingSample(Passing, tag="sample"):
    pass


class PassingEvent(Passing, tag="event"):
    pass


class PassingLog(Passing, tag="log"):
    pass
