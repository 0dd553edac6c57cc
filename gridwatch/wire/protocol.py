"""The wire protocol between node agents and consoles: newline-delimited JSON frames.

Both ends import this module. Every frame carries ``v`` (protocol version),
``type``, ``seq``, ``ts`` and ``node``. Text that a node supplies is typed
:class:`Text` and is cleaned of control characters and escape sequences when a
frame is decoded, so nothing a node sends can reach a terminal as a command.
A field the hardware cannot give is ``None`` (shown as N/A), never zero.

This is the protocol's public face: the constants every end shares are defined here, and the rest is
named here but defined once, in a module with one job each:

- ``text.py``: node text and its cleaning (:class:`Text`, ``clean_text``, the msgspec hooks);
- ``kinds.py``: the names that travel (severities, event kinds, agent actions, result codes);
- ``readings.py``: what a sample carries (GPUs, host, NICs, HCA ports, agent, software stack);
- ``frames.py``: the frame base and what an agent sends (hello, samples, summaries, events, answers);
- ``requests.py``: what a console sends an agent (subscription, watches, actions, searches);
- ``envelopes.py``: frames through a relay;
- ``codec.py``: frames to and from lines (``encode``, the decoders, :class:`FrameError`).
"""

from __future__ import annotations

import time

from gridwatch.wire.codec import (
    FRAME_TYPES,
    MAX_FRAME_BYTES,
    MAX_NESTING,
    AgentFrame,
    AnyFrame,
    ClientFrame,
    FrameError,
    clean_any,
    decode_agent_frame,
    decode_any_frame,
    decode_client_frame,
    decode_passing,
    encode,
    relayed,
    relayed_line,
)
from gridwatch.wire.envelopes import (
    Passing,
    PassingEvent,
    PassingLog,
    PassingSample,
    PassingSummary,
    Relayed,
    RelayLink,
    RelayNode,
    RelaySubscribe,
)
from gridwatch.wire.frames import (
    FAULT_AT,
    PROTOCOL_VERSION,
    ActionResult,
    Error,
    Event,
    Frame,
    Gap,
    GpuBrief,
    GpuStateWord,
    Hello,
    LogLine,
    Sample,
    SearchResult,
    StreamMode,
    Summary,
    TrainerPhase,
    TrainerStatus,
    fault_time,
    gpu_brief,
    summarize,
)
from gridwatch.wire.kinds import (
    ACTIONS,
    EVENT_KINDS,
    READ_ACTIONS,
    SEVERITIES,
    VIEWER_ACTIONS,
    AgentAction,
    ResultCode,
    Severity,
    severity_rank,
)
from gridwatch.wire.readings import (
    AgentStats,
    GpuInfo,
    GpuSample,
    HostSample,
    IbPortSample,
    NicSample,
    SchedulerJob,
    StackFingerprint,
)
from gridwatch.wire.requests import MAX_WATCHES, WATCH_METRICS, WATCH_OPS, Action, Behalf, Search, Subscribe, Watch
from gridwatch.wire.text import MAX_LINE_CHARS, Text, as_builtins, clean_text, text_dec_hook, text_enc_hook

SUBSYSTEM = "gridwatch"
AGENT_VERSION = "0.1.0"  # the software version a Hello names (agents and relays)
# The version a Hello names when no agent sent it: the console read the node from Prometheus. Such a node
# is shown and its faults are told, but nothing takes it out on a metric exporter's word alone.
HEARSAY_VERSION = "prometheus"
# A node is stale ("heartbeat lost") after this many of its sampling intervals without
# a frame: one definition for the fleet, the state store and the playbooks' default.
STALE_AFTER_INTERVALS = 3.0


def now() -> float:
    return time.time()


__all__ = [
    "ACTIONS",
    "AGENT_VERSION",
    "EVENT_KINDS",
    "FAULT_AT",
    "FRAME_TYPES",
    "HEARSAY_VERSION",
    "MAX_FRAME_BYTES",
    "MAX_LINE_CHARS",
    "MAX_NESTING",
    "MAX_WATCHES",
    "PROTOCOL_VERSION",
    "READ_ACTIONS",
    "SEVERITIES",
    "STALE_AFTER_INTERVALS",
    "SUBSYSTEM",
    "VIEWER_ACTIONS",
    "WATCH_METRICS",
    "WATCH_OPS",
    "Action",
    "ActionResult",
    "AgentAction",
    "AgentFrame",
    "AgentStats",
    "AnyFrame",
    "Behalf",
    "ClientFrame",
    "Error",
    "Event",
    "Frame",
    "FrameError",
    "Gap",
    "GpuBrief",
    "GpuInfo",
    "GpuSample",
    "GpuStateWord",
    "Hello",
    "HostSample",
    "IbPortSample",
    "LogLine",
    "NicSample",
    "Passing",
    "PassingEvent",
    "PassingLog",
    "PassingSample",
    "PassingSummary",
    "RelayLink",
    "RelayNode",
    "RelaySubscribe",
    "Relayed",
    "ResultCode",
    "Sample",
    "Search",
    "SearchResult",
    "Severity",
    "SchedulerJob",
    "StackFingerprint",
    "StreamMode",
    "Subscribe",
    "Summary",
    "Text",
    "TrainerPhase",
    "TrainerStatus",
    "Watch",
    "as_builtins",
    "clean_any",
    "clean_text",
    "decode_agent_frame",
    "decode_any_frame",
    "decode_client_frame",
    "decode_passing",
    "encode",
    "fault_time",
    "gpu_brief",
    "now",
    "relayed",
    "relayed_line",
    "severity_rank",
    "summarize",
    "text_dec_hook",
    "text_enc_hook",
]
