"""The console's state store: the newest frames per node and short histories, read by the UI on a timer.

Frames arrive one at a time from the fleet; applying one costs O(size of the
frame). The UI never reacts per frame: it asks this store for rows, cells and
series once per tick. Nothing here imports textual.
"""

from __future__ import annotations

import re
import time
from array import array
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import tzinfo
from enum import StrEnum
from typing import Callable, Generic, Iterable, Sequence, TypeVar, overload

from agents.protocol import (
    ActionResult,
    Error,
    Event,
    Frame,
    Gap,
    GpuSample,
    Hello,
    LogLine,
    Sample,
    Summary,
    SEVERITIES,
    STALE_AFTER_INTERVALS,
    Severity,
    TrainerStatus,
    clean_text,
)
from agents.protocol import severity_rank as _known_rank
from playbooks.clock import Clock, ManualClock, SystemClock  # one clock for store and engine
from console.fleet import logtime
from console.fleet.hostlist import HostlistError, expand
from console.fleet.preflight import majority_hash

HISTORY_POINTS = 120  # two minutes at the agents' default 1 s tick
NODE_EVENTS = 200
NODE_LOG_LINES = 1000
FLEET_EVENTS = 10_000
FLEET_LOG_LINES = 5_000
LOSS_POINTS = 2_000
NAN = float("nan")


# --------------------------------------------------------------------------- history


class MetricRing:
    """A fixed-size ring of several metrics sampled together (one array, no per-point objects).

    At 10,000 GPUs x 4 metrics x 120 points, a deque of floats would hold ~5 M
    Python objects; one ``array('f')`` per GPU holds the same in ~19 MB.
    """

    __slots__ = ("metrics", "size", "head", "count", "data")

    def __init__(self, metrics: int, size: int = HISTORY_POINTS) -> None:
        self.metrics = metrics
        self.size = size
        self.head = 0
        self.count = 0
        self.data = array("f", [NAN]) * (metrics * size)

    def push(self, values: Iterable[float | None]) -> None:
        base = self.head * self.metrics
        for i, v in enumerate(values):
            self.data[base + i] = NAN if v is None else v
        self.head = (self.head + 1) % self.size
        self.count = min(self.count + 1, self.size)

    def series(self, metric: int) -> list[float]:
        """Oldest to newest; NaN where the value was N/A."""
        start = (self.head - self.count) % self.size
        m = self.metrics
        return [self.data[((start + i) % self.size) * m + metric] for i in range(self.count)]


# GPU history columns, in MetricRing order.
GPU_UTIL, GPU_TEMP, GPU_POWER, GPU_MEM = range(4)
# Host history columns.
HOST_CPU, HOST_MEM, HOST_RX, HOST_TX = range(4)


class Metric(StrEnum):
    """What the heatmap colours cells by."""

    UTIL = "util"
    TEMP = "temp"
    POWER = "power"
    MEMORY = "memory"
    HEALTH = "health"


# Ranges that map a metric onto 0..1 for colouring; a GPU past the top is "hot".
_TEMP_RANGE = (30.0, 90.0)
_POWER_MAX_W = 700.0


def gpu_health(gpu: GpuSample, xids: int = 0) -> float:
    """0 healthy, 0.5 degraded (throttling, corrected errors), 1 failing (lost, hung, DBE, XID)."""
    if gpu.state != "ok" or (gpu.ecc_dbe or 0) > 0 or gpu.remapped_rows_failed or xids > 0:
        return 1.0
    if gpu.throttle or (gpu.ecc_sbe or 0) > 0 or gpu.remapped_rows_pending:
        return 0.5
    return 0.0


def gpu_metric(gpu: GpuSample, metric: Metric, xids: int = 0) -> float | None:
    """The GPU's value of ``metric`` scaled to 0..1, or None when the GPU cannot give it."""
    if metric is Metric.HEALTH:
        return gpu_health(gpu, xids)
    if gpu.state != "ok":
        return None
    if metric is Metric.UTIL:
        v = gpu.util
        return None if v is None else min(max(v / 100.0, 0.0), 1.0)
    if metric is Metric.TEMP:
        v = gpu.temp_c
        lo, hi = _TEMP_RANGE
        return None if v is None else min(max((v - lo) / (hi - lo), 0.0), 1.0)
    if metric is Metric.POWER:
        v = gpu.power_w
        return None if v is None else min(max(v / _POWER_MAX_W, 0.0), 1.0)
    used, total = gpu.mem_used_mb, gpu.mem_total_mb
    if used is None or not total:
        return None
    return min(max(used / total, 0.0), 1.0)


def worst_of(agg: GpuAggregate, metric: Metric) -> float | None:
    """The node's hottest GPU on ``metric``'s 0..1 scale (as :func:`gpu_metric`), from its aggregate: O(1) a tick."""
    if metric is Metric.HEALTH:
        return 1.0 if agg.bad else (0.5 if agg.degraded else (0.0 if agg.gpus else None))
    if metric is Metric.UTIL:
        return None if agg.util_max is None else min(max(agg.util_max / 100.0, 0.0), 1.0)
    if metric is Metric.TEMP:
        lo, hi = _TEMP_RANGE
        return None if agg.temp_max is None else min(max((agg.temp_max - lo) / (hi - lo), 0.0), 1.0)
    if metric is Metric.POWER:
        return None if agg.power_max is None else min(max(agg.power_max / _POWER_MAX_W, 0.0), 1.0)
    return agg.mem_max


# ---------------------------------------------------------------------------- nodes


class NodeStatus(StrEnum):
    """How a node looks at a glance; worst first in sort order."""

    DOWN = "down"
    REFUSED = "refused"
    STALE = "stale"
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


@dataclass(slots=True)
class GpuAggregate:
    """A node's GPUs summed up for its table row; made once per sample, not once per tick."""

    gpus: int = 0
    bad: int = 0
    util: float | None = None
    temp_max: float | None = None
    power_w: float | None = None
    mem_pct: float | None = None
    rx_bps: float | None = None
    tx_bps: float | None = None
    step_time_s: float | None = None
    # The worst GPU per metric (healthy GPUs only, as the heatmap colours them): a node's one cell when zoomed out.
    util_max: float | None = None
    power_max: float | None = None
    mem_max: float | None = None  # 0..1
    degraded: bool = False


def aggregate(sample: Sample, xids: Counter[int]) -> GpuAggregate:
    """Mean utilization, hottest GPU, total power and memory, NIC totals, failing GPUs."""
    agg = GpuAggregate()
    util_sum = 0.0
    util_n = 0
    temp = power = None
    used = total = 0.0
    for gpu in sample.gpus:
        agg.gpus += 1
        health = gpu_health(gpu, xids.get(gpu.index, 0))
        if health >= 1.0:
            agg.bad += 1
        elif health > 0.0:
            agg.degraded = True
        ok = gpu.state == "ok"
        if gpu.util is not None:
            util_sum += gpu.util
            util_n += 1
            if ok and (agg.util_max is None or gpu.util > agg.util_max):
                agg.util_max = gpu.util
        if gpu.temp_c is not None and (temp is None or gpu.temp_c > temp):
            temp = gpu.temp_c
        if gpu.power_w is not None:
            power = (power or 0.0) + gpu.power_w
            if ok and (agg.power_max is None or gpu.power_w > agg.power_max):
                agg.power_max = gpu.power_w
        if gpu.mem_used_mb is not None and gpu.mem_total_mb:
            used += gpu.mem_used_mb
            total += gpu.mem_total_mb
            if ok and (agg.mem_max is None or gpu.mem_used_mb / gpu.mem_total_mb > agg.mem_max):
                agg.mem_max = min(max(gpu.mem_used_mb / gpu.mem_total_mb, 0.0), 1.0)
    agg.util = util_sum / util_n if util_n else None
    agg.temp_max, agg.power_w = temp, power
    agg.mem_pct = 100.0 * used / total if total else None
    nics = sample.host.nics
    if nics:
        agg.rx_bps = sum(n.rx_bps for n in nics)
        agg.tx_bps = sum(n.tx_bps for n in nics)
    if sample.trainer is not None:
        agg.step_time_s = sample.trainer.step_time_s
    return agg


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
    sample: Sample | None = None
    last_frame_at: float | None = None
    last_sample_at: float | None = None
    interval: float = 1.0
    isolated: bool = False
    gaps: int = 0
    last_gap: str | None = None  # the last gap in words (an agent restart may lose an unknown number)
    foreign_frames: int = 0  # frames its link dropped because they named another node
    last_error: str | None = None
    gpu_history: list[MetricRing] = field(default_factory=list)
    host_history: MetricRing = field(default_factory=lambda: MetricRing(4))
    xids: Counter[int] = field(default_factory=Counter)  # gpu index -> XID events seen
    events: deque[EventRecord] = field(default_factory=lambda: deque(maxlen=NODE_EVENTS))
    logs: deque[LogRecord] = field(default_factory=lambda: deque(maxlen=NODE_LOG_LINES))
    logs_subscribed: bool = False
    agg: GpuAggregate | None = None  # of ``sample``; None until needed again
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
    def trainer(self) -> TrainerStatus | None:
        return self.sample.trainer if self.sample else None


@dataclass(slots=True)
class NodeRow:
    """One line of the node table, computed once per tick."""

    name: str
    status: NodeStatus
    isolated: bool
    mismatch: bool
    gpus: int
    gpu_bad: int
    util: float | None
    temp_max: float | None
    power_w: float | None
    mem_pct: float | None
    rx_bps: float | None
    tx_bps: float | None
    step_time_s: float | None
    age_s: float | None
    error: str | None
    patrol_failing: bool = False
    preflight_failed: bool = False

    @property
    def flags(self) -> str:
        marks = []
        if self.patrol_failing:
            marks.append("patrol")
        if self.preflight_failed:
            marks.append("preflight")
        if self.isolated:
            marks.append("isolated")
        if self.mismatch:
            marks.append("stack")
        return ",".join(marks)


SORT_KEYS: tuple[str, ...] = ("name", "status", "util", "temp", "power", "mem", "rx", "tx", "step", "age")


def _sort_value(row: NodeRow, key: str) -> tuple:
    if key == "name":
        return (0, row.name)
    if key == "status":
        order = list(NodeStatus).index(row.status)
        # Problems first: a down node outranks a healthy isolated one.
        marked = row.isolated or row.mismatch or row.gpu_bad or row.patrol_failing or row.preflight_failed
        return (0, order, not marked, row.name)
    value = {
        "util": row.util,
        "temp": row.temp_max,
        "power": row.power_w,
        "mem": row.mem_pct,
        "rx": row.rx_bps,
        "tx": row.tx_bps,
        "step": row.step_time_s,
        "age": row.age_s,
    }[key]
    # N/A sorts last whichever way the operator sorts.
    return (1, 0.0, row.name) if value is None else (0, value, row.name)


@dataclass(slots=True)
class FleetSummary:
    """What the footer shows."""

    connected: int
    total: int
    oldest_age_s: float | None
    gpus: int
    problems: int


class HeatmapNode:
    """One node's cells for the heatmap: a 0..1 value per GPU (None = N/A), computed when first drawn.

    Only the lines on screen are drawn, so most nodes' values are never computed.
    """

    __slots__ = ("name", "status", "isolated", "mismatch", "checks_failing", "gpus", "_node", "_metric", "_values")

    def __init__(self, node: NodeState, status: NodeStatus, mismatch: bool, metric: Metric) -> None:
        self.name = node.name
        self.status = status
        self.isolated = node.isolated
        self.mismatch = mismatch
        self.checks_failing = node.checks_failing
        sample = node.sample
        self.gpus = len(sample.gpus) if sample is not None else (len(node.hello.gpus) if node.hello else 0)
        self._node = node
        self._metric = metric
        self._values: list[float | None] | None = None

    @property
    def values(self) -> list[float | None]:
        if self._values is None:
            node = self._node
            if node.sample is not None:
                self._values = [gpu_metric(g, self._metric, node.xids.get(g.index, 0)) for g in node.sample.gpus]
            else:
                self._values = [None] * self.gpus
        return self._values

    @property
    def worst(self) -> float | None:
        """The node's worst GPU (its one cell when the heatmap is zoomed out), from the aggregate made per sample."""
        node = self._node
        if node.sample is None:
            return None
        if node.agg is None:
            node.agg = aggregate(node.sample, node.xids)
        return worst_of(node.agg, self._metric)


_T = TypeVar("_T")


class LazyRows(Sequence[_T], Generic[_T]):
    """Nodes in display order, each turned into its row when first read: a view draws a page of 12,500, not all."""

    __slots__ = ("nodes", "_make", "_made")

    def __init__(self, nodes: list[NodeState], make: Callable[[NodeState], _T]) -> None:
        self.nodes = nodes
        self._make = make
        self._made: dict[int, _T] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    @overload
    def __getitem__(self, index: int) -> _T: ...

    @overload
    def __getitem__(self, index: slice) -> list[_T]: ...

    def __getitem__(self, index: int | slice) -> _T | list[_T]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self.nodes)))]
        if index < 0:
            index += len(self.nodes)
        made = self._made.get(index)
        if made is None:
            made = self._made[index] = self._make(self.nodes[index])  # IndexError past the end, as a list
        return made

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]


@dataclass(slots=True)
class TrainingSummary:
    """The training run as the most advanced trainer status reports it."""

    node: str
    status: TrainerStatus
    age_s: float | None
    loss: list[tuple[int, float]]
    nodes_reporting: int


# ------------------------------------------------------------------------ log query


class QueryError(ValueError):
    """A logs query that cannot be used; the message says which part and why."""


@dataclass(slots=True)
class LogQuery:
    """``node:node[01-04] sev:error since:10m until:2m <regex>`` parsed; since/until may be absolute times too."""

    nodes: list[str] | None = None
    min_severity: str | None = None
    since_s: float | None = None  # seconds back from now
    until_s: float | None = None
    pattern: re.Pattern[str] | None = None
    since_at: float | None = None  # an absolute time (``since:03:10``), seconds since the epoch
    until_at: float | None = None

    @property
    def regex(self) -> str:
        return self.pattern.pattern if self.pattern else ""

    def window(self, now: float) -> tuple[float | None, float | None]:
        """(since, until) in seconds since the epoch at ``now``; None where the query sets no bound."""
        since = self.since_at if self.since_at is not None else (
            now - self.since_s if self.since_s is not None else None)
        until = self.until_at if self.until_at is not None else (
            now - self.until_s if self.until_s is not None else None)
        return since, until


_QUERY_TOKEN = re.compile(r'(\w+):"([^"]*)"|\S+')  # key:"a value with spaces", or a word


def parse_log_query(text: str, now: float | None = None, zone: tzinfo | None = None) -> LogQuery:
    """Parse the Logs view's one-line query; raises :class:`QueryError` with a one-line reason.

    ``since``/``until`` take a duration back from now or an absolute time in
    ``zone`` (default: the console's), read against ``now`` (default: the wall clock).
    """
    query = LogQuery()
    words: list[str] = []
    for found in _QUERY_TOKEN.finditer(text):
        token = found.group(0)
        key, sep, value = token.partition(":")
        if found.group(1) is not None:
            value = found.group(2)
        if sep and key in ("since", "until"):
            try:
                bound = logtime.parse_time(value, time.time() if now is None else now,
                                           zone or logtime.console_zone())
            except logtime.TimeError as exc:
                raise QueryError(f"{key}: {exc}") from None
            if key == "since":
                query.since_s, query.since_at = bound.ago_s, bound.at
            else:
                query.until_s, query.until_at = bound.ago_s, bound.at
            continue
        if sep and key in ("node", "nodes"):
            try:
                query.nodes = expand(value)
            except HostlistError as exc:
                raise QueryError(f"node set: {exc}") from None
        elif sep and key in ("sev", "severity"):
            if value not in SEVERITIES:
                raise QueryError(f"severity {value!r} is not one of {', '.join(SEVERITIES)}")
            query.min_severity = value
        else:
            words.append(token)
    since, until = query.window(time.time() if now is None else now)
    if since is not None and until is not None and until < since:
        raise QueryError("until is before since: the range holds no time")
    if words:
        try:
            query.pattern = re.compile(" ".join(words), re.IGNORECASE)
        except re.error as exc:
            raise QueryError(f"bad regular expression: {exc}") from None
    return query


def severity_rank(severity: str) -> int:
    """The playbooks' ranking, except that an unknown severity from a newer agent ranks as a warning: shown, not dropped."""
    rank = _known_rank(severity)
    return rank if rank >= 0 else _known_rank(Severity.WARNING)


@dataclass(slots=True)
class LogEntry:
    """One line of the Logs view: an event or a log line, merged by time."""

    ts: float
    node: str
    severity: str
    source: str
    text: str
    is_event: bool


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


# --------------------------------------------------------------------------- store


class StateStore:
    """The newest state of every node, fed frame by frame, read on the UI's tick."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or SystemClock()
        self.nodes: dict[str, NodeState] = {}
        self.events: deque[EventRecord] = deque(maxlen=FLEET_EVENTS)
        self.logs: deque[LogRecord] = deque(maxlen=FLEET_LOG_LINES)
        self.loss: deque[tuple[int, float]] = deque(maxlen=LOSS_POINTS)
        self.generation = 0  # bumped on every change, so a view can skip an idle tick
        self._seq = 0
        self._names: dict[str, str] = {}  # agent-given name -> key, so lookups by name stay O(1)
        self._majority: str | None = None
        self._stack_dirty = True
        self._by_name_order: list[NodeState] | None = None

    # ------------------------------------------------------------------ writing

    def node(self, key: str, name: str | None = None) -> NodeState:
        """The node called ``key``, created on first sight."""
        state = self.nodes.get(key)
        if state is None:
            state = self.nodes[key] = NodeState(key=key, name=name or key)
            self._names[state.name] = key
            self._by_name_order = None
        return state

    def _rename(self, node: NodeState, name: str) -> None:
        if name and name != node.name:
            self._names.pop(node.name, None)
            node.name = name
            self._names[name] = node.key
            self._by_name_order = None

    def _name_order(self) -> list[NodeState]:
        """Every node by name, sorted again only when a node comes or is renamed (not every tick)."""
        if self._by_name_order is None:
            self._by_name_order = sorted(self.nodes.values(), key=lambda n: n.name)
        return self._by_name_order

    def set_link(
        self, key: str, state: str, *, name: str | None = None, error: str | None = None, role: str | None = None,
        foreign_frames: int | None = None,
    ) -> None:
        """Record a link change from the fleet (connecting, connected, stale, down, refused)."""
        node = self.node(key, name)
        if name:
            self._rename(node, name)
        node.link = str(state)
        # Errors can quote what a peer sent (an SSH banner, a reason): cleaned like any node text.
        node.link_error = clean_text(error, 300) if error else None
        if role is not None:
            node.role = role
        if foreign_frames is not None:
            node.foreign_frames = foreign_frames
        self.generation += 1

    def apply(self, frame: Frame, key: str | None = None) -> None:
        """Take one frame from a node. ``key`` names the connection; it defaults to the frame's node."""
        node = self.node(key or str(frame.node), str(frame.node) or None)
        now = self.clock.now()
        node.last_frame_at = now
        self.generation += 1
        if isinstance(frame, Sample):
            if node.hello is not None and node.hello.interval > 0:
                node.interval = node.hello.interval  # back from summaries: one a tick again
            self._apply_sample(node, frame, now)
        elif isinstance(frame, Summary):
            # Read as a sample (what it lacks is N/A); its cadence sets when the node counts as stale.
            node.interval = max(node.hello.interval if node.hello and node.hello.interval > 0 else 1.0, frame.every)
            self._apply_sample(node, frame.as_sample(), now)
        elif isinstance(frame, Event):
            self._apply_event(node, frame, now)
        elif isinstance(frame, LogLine):
            self.add_log(node.name, frame, node)
        elif isinstance(frame, Hello):
            self._apply_hello(node, frame)
        elif isinstance(frame, Gap):
            node.gaps += max(frame.to_seq - frame.from_seq + 1, 0)
            # An empty range is a loss of unknown size (an agent restarted): the reason says it.
            node.last_gap = str(frame.reason) if frame.to_seq < frame.from_seq \
                else f"frames {frame.from_seq}-{frame.to_seq} lost: {frame.reason}"
        elif isinstance(frame, Error):
            node.last_error = f"{frame.code}: {frame.message}" if frame.message else str(frame.code)
        elif isinstance(frame, ActionResult) and not frame.ok and frame.action != "preflight":
            # A failed pre-flight is a verdict on the node, kept in ``preflight``, not a link error.
            node.last_error = f"{frame.action} failed: {frame.message}"

    def _apply_hello(self, node: NodeState, hello: Hello) -> None:
        node.hello = hello
        if hello.node:
            self._rename(node, str(hello.node))
        node.role = str(hello.role)
        node.interval = hello.interval if hello.interval > 0 else 1.0
        node.isolated = hello.isolated
        self._stack_dirty = True

    @staticmethod
    def _patrol_from_sample(node: NodeState, failing: list[str] | None, now: float) -> None:
        """Samples say whether the patrol passes, so a healthy node reads ok, not unknown.

        The reasons arrive with the patrol_failed event; a sample only fills in
        what the console has not seen (it connected after the transition).
        """
        if failing is None:
            return
        if not failing and node.patrol.status is not PatrolStatus.OK:
            node.patrol = PatrolState(PatrolStatus.OK, [], now)
        elif failing and node.patrol.status is not PatrolStatus.FAILING:
            node.patrol = PatrolState(PatrolStatus.FAILING, [CheckVerdict(str(n), False, "failing since before the console connected") for n in failing], now)

    def _apply_sample(self, node: NodeState, sample: Sample, now: float) -> None:
        node.sample = sample
        # Summed here, O(frame), so the UI tick only reads it.
        node.agg = aggregate(sample, node.xids)
        node.last_sample_at = now
        node.isolated = sample.isolated
        self._patrol_from_sample(node, sample.patrol_failing, now)
        history = node.gpu_history
        for gpu in sample.gpus:
            while len(history) <= gpu.index:
                history.append(MetricRing(4))
            mem = None
            if gpu.mem_used_mb is not None and gpu.mem_total_mb:
                mem = 100.0 * gpu.mem_used_mb / gpu.mem_total_mb
            history[gpu.index].push((gpu.util, gpu.temp_c, gpu.power_w, mem))
        host = sample.host
        mem_pct = None
        if host.mem_used_mb is not None and host.mem_total_mb:
            mem_pct = 100.0 * host.mem_used_mb / host.mem_total_mb
        rx = sum(n.rx_bps for n in host.nics) if host.nics else None
        tx = sum(n.tx_bps for n in host.nics) if host.nics else None
        node.host_history.push((host.cpu_percent, mem_pct, rx, tx))
        trainer = sample.trainer
        if trainer is not None and trainer.step is not None and trainer.loss is not None:
            if not self.loss or trainer.step > self.loss[-1][0]:
                self.loss.append((trainer.step, trainer.loss))

    def _apply_event(self, node: NodeState, event: Event, now: float) -> None:
        self._seq += 1
        record = EventRecord(self._seq, node.name, now, event)
        node.events.append(record)
        self.events.append(record)
        if event.kind == "xid" and event.gpu is not None:
            node.xids[event.gpu] += 1
            node.agg = None
        if event.kind == "isolated":
            node.isolated = True
        elif event.kind == "unisolated":
            node.isolated = False
        elif event.kind == "patrol_failed":
            node.patrol = PatrolState(PatrolStatus.FAILING, patrol_failures(event), now)
        elif event.kind == "patrol_recovered":
            node.patrol = PatrolState(PatrolStatus.OK, [], now)

    def set_preflight(self, key: str, result: PreflightResult) -> None:
        """Record a node's pre-flight result (by connection key or agent name); kept for the session."""
        node = self.nodes.get(key) or self.by_name(key)
        if node is None:
            return
        node.preflight = result
        self.generation += 1

    def add_log(self, name: str, line: LogLine, node: NodeState | None = None) -> None:
        """Append a streamed log line to the node's tail and the fleet's."""
        self._seq += 1
        record = LogRecord(self._seq, name, line)
        target = node or self.by_name(name)
        if target is not None:
            target.logs.append(record)
        self.logs.append(record)
        self.generation += 1

    # ------------------------------------------------------------------ reading

    def by_name(self, name: str) -> NodeState | None:
        """The node whose agent calls itself ``name`` (or whose key is ``name``)."""
        key = self._names.get(name, name)
        return self.nodes.get(key)

    def majority_stack(self) -> str | None:
        """The software stack hash most nodes report (None on a tie, as pre-flight judges); recomputed only after a Hello."""
        if self._stack_dirty:
            top, clear = majority_hash(n.stack_hash for n in self.nodes.values() if n.stack_hash)
            self._majority = top if clear else None
            self._stack_dirty = False
        return self._majority

    def stack_mismatch(self, node: NodeState) -> bool:
        majority = self.majority_stack()
        return bool(majority and node.stack_hash and node.stack_hash != majority)

    def status(self, node: NodeState, now: float | None = None) -> NodeStatus:
        """Down and refused come from the link; stale means no frame within three intervals."""
        if node.link in ("down", "refused"):
            return NodeStatus(node.link)
        if node.last_frame_at is None:
            return NodeStatus.CONNECTING
        now = self.clock.now() if now is None else now
        if node.link == "stale" or now - node.last_frame_at > STALE_AFTER_INTERVALS * node.interval:
            return NodeStatus.STALE
        return NodeStatus.OK

    def age(self, node: NodeState, now: float | None = None) -> float | None:
        if node.last_frame_at is None:
            return None
        return max((self.clock.now() if now is None else now) - node.last_frame_at, 0.0)

    def summary(self) -> FleetSummary:
        now = self.clock.now()
        connected = 0
        oldest: float | None = None
        gpus = problems = 0
        for node in self.nodes.values():
            status = self.status(node, now)
            if status is NodeStatus.OK:
                connected += 1
            else:
                problems += 1
            if node.last_frame_at is not None:
                age = now - node.last_frame_at
                oldest = age if oldest is None else max(oldest, age)
            if node.sample is not None:
                gpus += len(node.sample.gpus)
        return FleetSummary(connected, len(self.nodes), oldest, gpus, problems)

    def node_row(self, node: NodeState, now: float) -> NodeRow:
        if node.sample is not None:
            if node.agg is None:
                node.agg = aggregate(node.sample, node.xids)
            agg = node.agg
        else:
            agg = GpuAggregate(gpus=len(node.hello.gpus) if node.hello else 0)
        return NodeRow(
            name=node.name,
            status=self.status(node, now),
            isolated=node.isolated,
            mismatch=self.stack_mismatch(node),
            gpus=agg.gpus,
            gpu_bad=agg.bad,
            util=agg.util,
            temp_max=agg.temp_max,
            power_w=agg.power_w,
            mem_pct=agg.mem_pct,
            rx_bps=agg.rx_bps,
            tx_bps=agg.tx_bps,
            step_time_s=agg.step_time_s,
            age_s=None if node.last_frame_at is None else max(now - node.last_frame_at, 0.0),
            error=node.link_error or node.last_error,
            patrol_failing=node.patrol.status is PatrolStatus.FAILING,
            preflight_failed=node.preflight is not None and not node.preflight.ok,
        )

    def node_rows(self, sort: str = "name", reverse: bool = False, filter_text: str = "") -> Sequence[NodeRow]:
        """The node table: filtered by a case-insensitive substring of name, status or flags."""
        now = self.clock.now()
        needle = filter_text.strip().lower()
        if not needle and sort == "name":
            # The default view of a large fleet: ordered by name alone, rows made only for the page drawn.
            order = self._name_order()
            return LazyRows(order[::-1] if reverse else order, lambda n: self.node_row(n, now))
        rows = []
        for node in self.nodes.values():
            row = self.node_row(node, now)
            if needle and needle not in f"{row.name} {row.status} {row.flags}".lower():
                continue
            rows.append(row)
        rows.sort(key=lambda r: _sort_value(r, sort), reverse=reverse)
        if reverse:
            # Keep N/A at the bottom when the order flips.
            rows.sort(key=lambda r: _sort_value(r, sort)[0])
        return rows

    def heatmap(self, metric: Metric, only: set[str] | None = None) -> LazyRows[HeatmapNode]:
        """Cells for the heatmap in order of first sight, limited to the names in ``only`` when given.

        Each node's cells are made when first read: only the lines on screen are drawn.
        """
        now = self.clock.now()
        nodes = list(self.nodes.values()) if only is None else [n for n in self.nodes.values() if n.name in only]
        return LazyRows(nodes, lambda n: HeatmapNode(n, self.status(n, now), self.stack_mismatch(n), metric))

    def worst_node(self, metric: Metric) -> str | None:
        """The name of the node whose worst GPU is hottest on ``metric`` (health: failing first), or None."""
        best: tuple[float, str] | None = None
        for node in self.nodes.values():
            if node.sample is None:
                continue
            if node.agg is None:
                node.agg = aggregate(node.sample, node.xids)
            value = worst_of(node.agg, metric)
            if value is not None and (best is None or value > best[0]):
                best = (value, node.name)
        return best[1] if best else None

    def training(self) -> TrainingSummary | None:
        """The most advanced trainer status across nodes, or None when no trainer is attached."""
        best: tuple[NodeState, TrainerStatus] | None = None
        reporting = 0
        for node in self.nodes.values():
            status = node.trainer
            if status is None:
                continue
            reporting += 1
            if best is None or (status.step or -1) > (best[1].step or -1):
                best = (node, status)
        if best is None:
            return None
        node, status = best
        return TrainingSummary(node.name, status, self.age(node), list(self.loss), reporting)

    def log_entries(self, query: LogQuery, limit: int = 2000) -> list[LogEntry]:
        """Events and streamed log lines matching ``query``, oldest first, newest ``limit`` kept."""
        now = self.clock.now()
        nodes = set(query.nodes) if query.nodes else None
        min_rank = severity_rank(query.min_severity) if query.min_severity else None
        since, until = query.window(now)
        out: list[LogEntry] = []
        for rec in self.events:
            ev = rec.event
            ts = ev.ts or rec.received_at
            entry = LogEntry(ts, rec.node, str(ev.severity), str(ev.source) or "event", event_text(ev), True)
            if _matches(entry, nodes, min_rank, since, until, query.pattern):
                out.append(entry)
        # Raw log lines carry no severity: a severity filter keeps events only.
        if min_rank is None:
            for log_rec in self.logs:
                line = log_rec.line
                entry = LogEntry(line.line_ts or line.ts, log_rec.node, "", str(line.source), str(line.line), False)
                if _matches(entry, nodes, None, since, until, query.pattern):
                    out.append(entry)
        out.sort(key=lambda e: e.ts)
        return out[-limit:]


def _matches(
    entry: LogEntry,
    nodes: set[str] | None,
    min_rank: int | None,
    since: float | None,
    until: float | None,
    pattern: re.Pattern[str] | None,
) -> bool:
    if nodes is not None and entry.node not in nodes:
        return False
    if min_rank is not None and severity_rank(entry.severity) < min_rank:
        return False
    if since is not None and entry.ts < since:
        return False
    if until is not None and entry.ts > until:
        return False
    return pattern is None or bool(pattern.search(entry.text) or pattern.search(entry.source))


__all__ = ["Clock", "ManualClock", "StateStore", "SystemClock"]
