"""Frames a console sends an agent: the subscription (with the metric conditions to watch), actions and log searches."""

from __future__ import annotations

from typing import Any

import msgspec

from gridwatch.wire.frames import Frame, StreamMode
from gridwatch.wire.text import Text


class Subscribe(Frame, tag="subscribe"):
    """Start (or resume) the stream; ``resume_from`` is the last seq the client has."""

    resume_from: int | None = None
    logs: bool = False  # stream raw log lines too (only for nodes the operator looks at)
    # Sent again on a live stream, these switch it without moving its place (logs too).
    mode: StreamMode = StreamMode.FULL  # an older console asks nothing and gets full samples, as before
    every: float = 0.0  # summary mode: at most one summary this many seconds (0: one per sample)
    watches: list[Watch] = []  # metric conditions the agent evaluates and reports (condition_held / _cleared)


class Watch(msgspec.Struct, gc=False, kw_only=True):
    """A metric condition for the agent to evaluate: ``metric op threshold`` held ``hold`` seconds. Data, never code.

    ``metric`` is one of :data:`WATCH_METRICS`; ``name`` (the playbook's) and the
    condition's text come back in the agent's events so the console knows what held.
    """

    name: Text
    metric: Text
    op: Text  # > >= < <= == !=
    threshold: float
    hold: float = 0.0


# The metrics an agent can evaluate, per GPU: metric name -> the GpuSample field it reads, or
# "throttle:WORD" for "a throttle reason naming WORD is active" (1 or 0). The playbooks' names.
WATCH_METRICS: dict[str, str] = {
    "gpu.temperature": "temp_c",
    "gpu.util": "util",
    "gpu.mem_util": "mem_util",
    "gpu.memory_used": "mem_used_mb",
    "gpu.power": "power_w",
    "gpu.sm_clock": "sm_clock_mhz",
    "gpu.mem_clock": "mem_clock_mhz",
    "gpu.pcie_replay": "pcie_replay",
    "gpu.ecc_sbe": "ecc_sbe",
    "gpu.ecc_dbe": "ecc_dbe",
    "gpu.retired_pages": "retired_pages",
    "gpu.nvlink_errors": "nvlink_errors",
    "gpu.throttle.thermal": "throttle:thermal",
    "gpu.throttle.power": "throttle:power",
}
WATCH_OPS: frozenset[str] = frozenset({">", ">=", "<", "<=", "==", "!="})
MAX_WATCHES = 64  # a console sends its playbooks' conditions: more than this is a bug, refused


class Behalf(msgspec.Struct, gc=False, kw_only=True):
    """Who a relay forwards a request for: the console key it accepted, and that key's role at the relay.

    An agent takes it only to lower what a request may do (the lesser of its caller's role and this one)
    and to budget each console behind a relay on its own; it never raises a caller's rights.
    """

    key: Text
    role: Text


class Action(Frame, tag="action"):
    """An operator action. Who asked is the key the agent accepted (and, behind a relay, ``behalf``)."""

    id: Text
    # An AgentAction's value (wire/kinds.py), as text: an agent answers a name it does not know with a
    # failed ActionResult that says so, where a typed field would refuse the whole frame.
    action: Text
    args: dict[Text, Any] = {}
    reason: Text = Text("")
    # The sending console's fencing token (its etcd lease's revision); None: a console alone, not fenced.
    # An agent refuses an acting request whose token is older than the newest it has seen.
    fence: int | None = None
    # A playbook step's idempotency key ("<incident>/<step index>"): a repeat is answered with the first outcome.
    key: Text | None = None
    behalf: Behalf | None = None  # set by a relay: the console key it forwards this for


class Search(Frame, tag="search"):
    id: Text
    pattern: Text  # a regular expression
    since: float | None = None
    until: float | None = None
    limit: int = 500
    behalf: Behalf | None = None  # set by a relay (see Action.behalf)
