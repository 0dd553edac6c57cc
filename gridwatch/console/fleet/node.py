"""The node model: everything the console knows about one node, and its events, logs and checks."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from gridwatch.console.fleet.history import NodeHistory, RingColumns
from gridwatch.console.fleet.metrics import GpuAggregate, Metric, aggregate, worst_gpu, worst_of
from gridwatch.wire.protocol import (
    Event,
    GpuBrief,
    GpuSample,
    Hello,
    LogLine,
    Sample,
    SchedulerJob,
    Summary,
    TrainerStatus,
)

NODE_EVENTS = 200
NODE_LOG_LINES = 1000


# ---------------------------------------------------------------------------- nodes


class NodeStatus(StrEnum):
    """How a node looks at a glance; worst first in sort order."""

    DOWN = "down"
    REFUSED = "refused"
    STALE = "stale"
    # Live, but a GPU is lost or failing (fallen off the bus, ECC, not answering NVML): the node is not "ok".
    DEGRADED = "degraded"
    CONNECTING = "connecting"
    OK = "ok"


@dataclass(slots=True)
class EventRecord:
    """An event as the console received it; ``seq`` orders records across nodes."""

    seq: int
    node: str
    received_at: float
    event: Event


@dataclass(slots=True)
class LogRecord:
    """A log line (streamed, or found by a search) with its node."""

    seq: int
    node: str
    line: LogLine

class PatrolStatus(StrEnum):
    """The node's own patrol as its events tell it: the agent reports only transitions."""

    UNKNOWN = "unknown"  # no patrol event seen since the console connected
    OK = "ok"
    FAILING = "failing"


@dataclass(slots=True)
class CheckVerdict:
    """One check on one node: pass or fail, and why in one line."""

    name: str
    ok: bool
    detail: str


@dataclass(slots=True)
class PatrolState:
    """The last patrol transition of a node: which checks fail and why, and when that changed."""

    status: PatrolStatus = PatrolStatus.UNKNOWN
    failing: list[CheckVerdict] = field(default_factory=list)
    changed_at: float | None = None  # console clock, when the event arrived


@dataclass(slots=True)
class PreflightResult:
    """A node's last pre-flight as the console ran it: its verdict, each check, when."""

    at: float  # console clock
    ok: bool
    checks: list[CheckVerdict] = field(default_factory=list)
    error: str | None = None  # why the node could not be checked at all

    @property
    def failing(self) -> list[CheckVerdict]:
        return [c for c in self.checks if not c.ok]


@dataclass
class NodeState:
    """Everything the console knows about one node; mutated only by :class:`StateStore`."""

    key: str
    name: str
    link: str = "connecting"
    link_error: str | None = None
    role: str | None = None
    hello: Hello | None = None
    # The newest reading: a summary while the node streams summaries (read as a sample only when
    # something asks for ``sample``), else the whole sample.
    summary: Summary | None = None
    _sample: Sample | None = None
    last_frame_at: float | None = None
    last_sample_at: float | None = None
    interval: float = 1.0
    isolated: bool = False
    gaps: int = 0
    last_gap: str | None = None  # the last gap in words (an agent restart may lose an unknown number)
    foreign_frames: int = 0  # frames its link dropped because they named another node
    last_error: str | None = None
    history: NodeHistory = field(default_factory=NodeHistory)
    xids: Counter[int] = field(default_factory=Counter)  # gpu index -> XID events seen
    events: deque[EventRecord] = field(default_factory=lambda: deque(maxlen=NODE_EVENTS))
    logs: deque[LogRecord] = field(default_factory=lambda: deque(maxlen=NODE_LOG_LINES))
    logs_subscribed: bool = False
    _agg: GpuAggregate | None = None  # of the newest reading, summed when first read after it arrived
    patrol: PatrolState = field(default_factory=PatrolState)
    preflight: PreflightResult | None = None

    @property
    def checks_failing(self) -> bool:
        """The patrol or the last pre-flight says this node is sub-healthy."""
        return self.patrol.status is PatrolStatus.FAILING or (self.preflight is not None and not self.preflight.ok)

    @property
    def stack_hash(self) -> str:
        return str(self.hello.stack.hash) if self.hello else ""

    @property
    def sample(self) -> Sample | None:
        """The newest reading as a sample (a summary converted once, on first read: what it lacks is N/A)."""
        if self._sample is None and self.summary is not None:
            self._sample = self.summary.as_sample()
        return self._sample

    @sample.setter
    def sample(self, sample: Sample | None) -> None:
        self._sample = sample
        self.summary = None

    @property
    def reading(self) -> Sample | Summary | None:
        """The newest sample or summary as it arrived, for readers that need only what both carry."""
        return self._sample if self._sample is not None else self.summary

    @property
    def jobs(self) -> Sequence[SchedulerJob]:
        """The scheduler's jobs on the node, as its newest reading says (none before one arrives)."""
        reading = self.reading
        return reading.jobs if reading is not None else ()

    @property
    def gpus(self) -> Sequence[GpuSample | GpuBrief]:
        """The GPUs of the newest reading (none before one arrives)."""
        reading = self.reading
        return reading.gpus if reading is not None else ()

    @property
    def gpu_count(self) -> int:
        """GPUs in the newest reading, else as many as the hello names."""
        reading = self.reading
        if reading is not None:
            return len(reading.gpus)
        return len(self.hello.gpus) if self.hello else 0

    @property
    def trainer(self) -> TrainerStatus | None:
        reading = self.reading
        return reading.trainer if reading is not None else None

    @property
    def agg(self) -> GpuAggregate | None:
        """The newest reading's GPUs summed up (None before one arrives); made on first read, once per reading."""
        if self._agg is None:
            reading = self.reading
            if reading is not None:
                self._agg = aggregate(reading, self.xids)
        return self._agg

    @agg.setter
    def agg(self, agg: GpuAggregate | None) -> None:
        self._agg = agg  # None: made again on the next read (an XID changed a GPU's health)

    def worst(self, metric: Metric) -> float | None:
        """The hottest GPU on ``metric``'s 0..1 scale: from the aggregate when one is made, else from that one metric."""
        if self._agg is not None:
            return worst_of(self._agg, metric)
        return None if self.reading is None else worst_gpu(self.gpus, metric, self.xids)

    @property
    def gpu_history(self) -> list[RingColumns]:
        """Each GPU's history, by index."""
        return self.history.per_gpu

    @property
    def host_history(self) -> RingColumns:
        return self.history.host


def event_text(event: Event) -> str:
    """An event as one line of plain text."""
    parts = [str(event.kind)]
    if event.gpu is not None:
        parts.append(f"gpu{event.gpu}")
    if event.code is not None:
        parts.append(f"code={event.code}")
    if event.message:
        parts.append(str(event.message))
    return " ".join(parts)


def patrol_failures(event: Event) -> list[CheckVerdict]:
    """The failing checks a ``patrol_failed`` event names, each with its one-line reason."""
    names = [n.strip() for n in str(event.details.get("checks", "")).split(",") if n.strip()]
    if not names:
        # An agent that named no checks still said the node is failing: keep its message.
        return [CheckVerdict("patrol", False, str(event.message) or "patrol failed")]
    return [CheckVerdict(n, False, str(event.details.get(n, "")) or "failed") for n in names]
