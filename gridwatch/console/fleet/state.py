"""The console's state store: the newest frames per node and short histories, read by the UI on a timer.

Frames arrive one at a time from the fleet; applying one costs O(size of the
frame). The UI never reacts per frame: it asks this store for rows, cells and
series once per tick. Nothing here imports textual.
"""

from __future__ import annotations

import re
import time
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import tzinfo
from enum import StrEnum
from typing import Generic, TypeVar, overload

from gridwatch.console.fleet import logtime
from gridwatch.console.fleet.preflight import majority_hash
from gridwatch.playbooks.clock import Clock, ManualClock, SystemClock  # one clock for store and engine
from gridwatch.sshlink.hostlist import HostlistError, expand
from gridwatch.wire.protocol import (
    SEVERITIES,
    STALE_AFTER_INTERVALS,
    ActionResult,
    Error,
    Event,
    Frame,
    Gap,
    GpuBrief,
    GpuSample,
    Hello,
    LogLine,
    Sample,
    Severity,
    Summary,
    TrainerStatus,
    clean_text,
)
from gridwatch.wire.protocol import severity_rank as _known_rank

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
        """One point of every metric, in column order; None (N/A) is kept as NaN."""
        base = self.head * self.metrics
        row = array("f", [NAN if v is None else v for v in values])
        if len(row) != self.metrics:
            row.extend([NAN] * (self.metrics - len(row)))
            del row[self.metrics:]
        self.data[base:base + self.metrics] = row  # one copy in C, not a store per value
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
_COLUMNS = 4  # per GPU and for the host


class RingColumns:
    """Four columns of a node's ring, read as one GPU's (or the host's) history: ``series(GPU_UTIL)``."""

    __slots__ = ("ring", "offset")

    def __init__(self, ring: MetricRing, offset: int) -> None:
        self.ring = ring
        self.offset = offset

    @property
    def count(self) -> int:
        return self.ring.count

    def series(self, metric: int) -> list[float]:
        return self.ring.series(self.offset + metric)


class NodeHistory:
    """A node's host and GPU history in one ring (host columns, then four per GPU): one push per frame.

    One ring per node instead of one per GPU: a frame is a single copy, and 12,500 nodes hold
    12,500 rings rather than 112,500 objects for the collector to walk.
    """

    __slots__ = ("ring", "gpus")

    def __init__(self, gpus: int = 0) -> None:
        self.gpus = gpus
        self.ring = MetricRing(_COLUMNS * (1 + gpus))

    @property
    def host(self) -> RingColumns:
        return RingColumns(self.ring, 0)

    @property
    def per_gpu(self) -> list[RingColumns]:
        """Made when a view reads them (a node's view, a few times a second), not kept per node."""
        return [RingColumns(self.ring, _COLUMNS * (1 + i)) for i in range(self.gpus)]

    def push(self, host: Sequence[float | None], gpus: Sequence[GpuSample | GpuBrief]) -> NodeHistory:
        """Add one point; returns the history to keep (a new, empty one when the node's GPUs changed in number)."""
        n = len(gpus)
        width = n if not n or gpus[-1].index == n - 1 else max(g.index for g in gpus) + 1
        history = self if width == self.gpus else NodeHistory(width)
        values: list[float | None] = list(host)
        values += [None] * (_COLUMNS * width)
        for g in gpus:
            base = _COLUMNS * (1 + g.index)
            used, total = g.mem_used_mb, g.mem_total_mb
            values[base] = g.util
            values[base + 1] = g.temp_c
            values[base + 2] = g.power_w
            values[base + 3] = 100.0 * used / total if used is not None and total else None
        history.ring.push(values)
        return history


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


def gpu_health(gpu: GpuSample | GpuBrief, xids: int = 0) -> float:
    """0 healthy, 0.5 degraded (throttling, corrected errors), 1 failing (lost, hung, DBE, XID)."""
    if gpu.state != "ok" or (gpu.ecc_dbe or 0) > 0 or gpu.remapped_rows_failed or xids > 0:
        return 1.0
    if gpu.throttle or (gpu.ecc_sbe or 0) > 0 or gpu.remapped_rows_pending:
        return 0.5
    return 0.0


def gpu_metric(gpu: GpuSample | GpuBrief, metric: Metric, xids: int = 0) -> float | None:
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


def worst_gpu(gpus: Sequence[GpuSample | GpuBrief], metric: Metric, xids: Counter[int]) -> float | None:
    """The hottest GPU on ``metric``'s 0..1 scale, from the GPUs themselves: one metric, not a whole aggregate.

    Equal to ``worst_of(aggregate(...), metric)``; the zoomed-out heatmap asks it of thousands of nodes a paint.
    """
    if metric is Metric.HEALTH:
        if not gpus:
            return None
        return max(gpu_health(g, xids.get(g.index, 0) if xids else 0) for g in gpus)
    if metric is Metric.MEMORY:
        top: float | None = None
        for g in gpus:
            used, total = g.mem_used_mb, g.mem_total_mb
            if g.state == "ok" and used is not None and total and (top is None or used / total > top):
                top = used / total
        return None if top is None else min(max(top, 0.0), 1.0)
    field_name = "util" if metric is Metric.UTIL else ("temp_c" if metric is Metric.TEMP else "power_w")
    # Temperature counts every GPU, as the aggregate's hottest does; util and power healthy GPUs only.
    values = [v for g in gpus if (v := getattr(g, field_name)) is not None and (metric is Metric.TEMP or g.state == "ok")]
    if not values:
        return None
    v = max(values)
    if metric is Metric.UTIL:
        return min(max(v / 100.0, 0.0), 1.0)
    if metric is Metric.TEMP:
        lo, hi = _TEMP_RANGE
        return min(max((v - lo) / (hi - lo), 0.0), 1.0)
    return min(max(v / _POWER_MAX_W, 0.0), 1.0)


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


def aggregate(sample: Sample | Summary, xids: Counter[int]) -> GpuAggregate:
    """Mean utilization, hottest GPU, total power and memory, NIC totals, failing GPUs (of a sample or a summary)."""
    agg = _aggregate_gpus(sample.gpus, xids)
    if isinstance(sample, Summary):
        agg.rx_bps, agg.tx_bps = sample.rx_bps, sample.tx_bps
    else:
        nics = sample.host.nics
        if nics:
            agg.rx_bps = sum(n.rx_bps for n in nics)
            agg.tx_bps = sum(n.tx_bps for n in nics)
    if sample.trainer is not None:
        agg.step_time_s = sample.trainer.step_time_s
    return agg


def _aggregate_gpus(gpus: Sequence[GpuSample | GpuBrief], xids: Counter[int]) -> GpuAggregate:
    agg = GpuAggregate()
    util_sum = 0.0
    util_n = 0
    temp = power = None
    used = total = 0.0
    for gpu in gpus:
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


# Worst first, as NodeStatus lists them; a dict so a sort key costs a lookup, not an enum walk.
STATUS_ORDER: dict[NodeStatus, int] = {s: i for i, s in enumerate(NodeStatus)}
_LINK_STATUS = {"down": NodeStatus.DOWN, "refused": NodeStatus.REFUSED}
# The row field (and GpuAggregate field, same name) each value sort reads.
SORT_FIELDS: dict[str, str] = {"util": "util", "temp": "temp_max", "power": "power_w", "mem": "mem_pct",
                               "rx": "rx_bps", "tx": "tx_bps", "step": "step_time_s", "age": "age_s"}
# A value sort's order is made again at most this often (its rows' values are always fresh): an
# operator reads a reshuffle every tick at 12,500 nodes as noise, and each one costs a sort of the fleet.
VALUE_ORDER_EVERY_S = 2.0
FILTER_EVERY_S = 1.0  # likewise a filter's matches, made again at once when the filter text changes


def _status_key(order: int, marked: bool, name: str) -> tuple:
    # Problems first: a down node outranks a healthy isolated one.
    return (0, order, not marked, name)


def _value_key(value: float | None, name: str) -> tuple:
    # N/A sorts last whichever way the operator sorts.
    return (1, 0.0, name) if value is None else (0, value, name)


def _sort_value(row: NodeRow, key: str) -> tuple:
    if key == "name":
        return (0, row.name)
    if key == "status":
        marked = row.isolated or row.mismatch or bool(row.gpu_bad) or row.patrol_failing or row.preflight_failed
        return _status_key(STATUS_ORDER[row.status], marked, row.name)
    return _value_key(getattr(row, SORT_FIELDS[key]), row.name)


def gpus_failing(gpus: Iterable[GpuSample | GpuBrief], xids: Counter[int]) -> bool:
    """Whether any GPU is failing as :func:`gpu_health` judges it (1.0): the row's bad GPUs, without summing the rest.

    The status order asks this of every node changed since the last tick; a whole aggregate would cost five times more.
    """
    for gpu in gpus:
        if gpu.state != "ok" or gpu.remapped_rows_failed or (gpu.ecc_dbe or 0) > 0:
            return True
    return bool(xids) and any(xids.get(gpu.index, 0) > 0 for gpu in gpus)


_LINK_QUIET = frozenset({"down", "refused", "stale"})  # links whose node is not live, whatever its frames
# What the fleet's counts hold for a node: (live, GPUs in its newest reading, its interval, its role).
_Counted = tuple[bool, int, float, str]
_UNCOUNTED: _Counted = (False, 0, 0.0, "")
_Place = tuple[int, bool]  # a node's place in the status order: (STATUS_ORDER of its status, marked)
_K = TypeVar("_K")


def _uncount(counter: Counter[_K], key: _K) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]  # so min() and truthiness see only what is there


@dataclass(slots=True)
class _Order:
    """A display order of nodes, with their names, as made at ``made_at``; reused until it must change."""

    nodes: list[NodeState]
    names: list[str]
    made_at: float
    generation: int
    base: list[NodeState]  # the order by name it was made with: another one means nodes came or were renamed
    places: dict[str, _Place] | None = None  # the status order: the nodes it put apart, and where


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
        self.gpus = node.gpu_count
        self._node = node
        self._metric = metric
        self._values: list[float | None] | None = None

    @property
    def values(self) -> list[float | None]:
        if self._values is None:
            node = self._node
            if node.reading is not None:
                self._values = [gpu_metric(g, self._metric, node.xids.get(g.index, 0)) for g in node.gpus]
            else:
                self._values = [None] * self.gpus
        return self._values

    @property
    def worst(self) -> float | None:
        """The node's worst GPU: its one cell when the heatmap is zoomed out."""
        return self._node.worst(self._metric)


_T = TypeVar("_T")


class LazyRows(Sequence[_T], Generic[_T]):
    """Nodes in display order, each turned into its row when first read: a view draws a page of 12,500, not all."""

    __slots__ = ("nodes", "as_of", "_make", "_made", "_names")

    def __init__(self, nodes: list[NodeState], make: Callable[[NodeState], _T], names: list[str] | None = None,
                 as_of: float | None = None) -> None:
        """``names``: the nodes' names, when the caller keeps them; ``as_of``: when the order was made, where it
        can be older than the rows (made fresh when read)."""
        self.nodes = nodes
        self.as_of = as_of
        self._make = make
        self._made: dict[int, _T] = {}
        self._names = names

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
        """The nodes' names in order: the same list object while the order is unchanged (callers may compare it)."""
        if self._names is None:
            self._names = [n.name for n in self.nodes]
        return self._names


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
        # What the views read is kept up to date from the nodes touched since the last read (see _touch),
        # so a tick costs O(rows drawn + nodes changed), not O(fleet).
        self._dirty: dict[str, NodeState] = {}  # for the fleet's counts
        self._dirty_marks: dict[str, NodeState] = {}  # for the status order
        self._touches = 0
        self._framed: OrderedDict[str, NodeState] = OrderedDict()  # nodes by their last frame, oldest first
        self._counted: dict[str, _Counted] = {}
        self._live = 0  # nodes whose link is up and that sent a frame: ok unless their last frame is too old
        self._gpus = 0
        self._intervals: Counter[float] = Counter()  # of the live nodes
        self._roles: Counter[str] = Counter()
        self._apart: dict[str, tuple[int, bool]] = {}  # status order: the nodes not plainly ok, by (status, marked)
        self._marks_for: tuple[str | None, int] | None = None  # (majority stack, unexplained changes) they were made with
        self._marks_at = float("-inf")
        self._orders: dict[tuple[str, bool, str], _Order] = {}
        # The heatmap's nodes in order of first sight: (order by name it was made with, only, nodes, names).
        self._first_sight: tuple[list[NodeState], frozenset[str] | None, list[NodeState], list[str]] | None = None

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
        self._touch(node)
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
        self._touch(node, framed=True)
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
            self._apply_sample(node, frame, now)
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

    def _apply_sample(self, node: NodeState, sample: Sample | Summary, now: float) -> None:
        """A sample, or a summary kept as it came (no sample is made of it unless a view asks)."""
        cpu: float | None
        used: float | None
        total: float | None
        if isinstance(sample, Summary):
            node.summary, node._sample = sample, None
            cpu, used, total, rx, tx = sample.cpu_percent, sample.mem_used_mb, sample.mem_total_mb, sample.rx_bps, sample.tx_bps
        else:
            node.sample = sample
            host = sample.host
            cpu, used, total = host.cpu_percent, host.mem_used_mb, host.mem_total_mb
            rx = sum(n.rx_bps for n in host.nics) if host.nics else None
            tx = sum(n.tx_bps for n in host.nics) if host.nics else None
        node.agg = None  # summed when a view first reads it: most nodes' rows are never drawn
        node.last_sample_at = now
        node.isolated = sample.isolated
        self._patrol_from_sample(node, sample.patrol_failing, now)
        mem_pct = 100.0 * used / total if used is not None and total else None
        node.history = node.history.push((cpu, mem_pct, rx, tx), sample.gpus)
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
        self._touch(node)
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
        status = self._link_status(node)
        last = node.last_frame_at
        if status is not NodeStatus.OK or last is None:
            return status
        now = self.clock.now() if now is None else now
        return NodeStatus.STALE if now - last > STALE_AFTER_INTERVALS * node.interval else NodeStatus.OK

    @staticmethod
    def _link_status(node: NodeState) -> NodeStatus:
        """The status the link and the frames seen say, before the clock is asked (OK: live, unless gone quiet)."""
        status = _LINK_STATUS.get(node.link)
        if status is not None:
            return status
        if node.last_frame_at is None:
            return NodeStatus.CONNECTING
        return NodeStatus.STALE if node.link == "stale" else NodeStatus.OK

    # -------------------------------------------- what the views read, kept from the nodes touched

    def _touch(self, node: NodeState, framed: bool = False) -> None:
        """``node`` is about to change (``framed``: it sent a frame now); the views fold it in when they next read.

        O(1) a frame: it only notes the node, so a tick costs O(rows drawn + nodes changed), not O(fleet).
        """
        key = node.key
        self._dirty[key] = node
        self._dirty_marks[key] = node
        self._touches += 1
        if framed:
            self._framed[key] = node
            self._framed.move_to_end(key)  # frames come in time order: the front is the oldest last frame

    def _fold(self) -> None:
        """Count the nodes touched since the last read again (link up, GPUs, cadence, role): O(nodes touched)."""
        dirty = self._dirty
        if not dirty:
            return
        counted, intervals, roles = self._counted, self._intervals, self._roles
        for key, node in dirty.items():
            reading = node.reading
            new = (node.link not in _LINK_QUIET and node.last_frame_at is not None,
                   len(reading.gpus) if reading is not None else 0, node.interval, node.role or "")
            old = counted.get(key, _UNCOUNTED)
            if new == old:
                continue
            counted[key] = new
            self._gpus += new[1] - old[1]
            if old[0]:
                self._live -= 1
                _uncount(intervals, old[2])
            if new[0]:
                self._live += 1
                intervals[new[2]] += 1
            if old[3]:
                _uncount(roles, old[3])
            if new[3]:
                roles[new[3]] += 1
        dirty.clear()

    def _gone_quiet(self, now: float) -> list[NodeState]:
        """Live nodes whose last frame is older than three intervals: O(nodes not heard from lately), oldest first."""
        self._fold()
        if not self._intervals:
            return []
        # Past this age a node may be stale; younger ones (all after the first such in frame order) are not.
        floor = STALE_AFTER_INTERVALS * min(self._intervals)
        quiet = []
        for node in self._framed.values():
            last = node.last_frame_at
            if last is None:
                continue
            age = now - last
            if age <= floor:
                break
            if node.link not in _LINK_QUIET and age > STALE_AFTER_INTERVALS * node.interval:
                quiet.append(node)
        return quiet

    def role_counts(self) -> dict[str, int]:
        """How many nodes gave this console each role (nodes not heard from yet count in none)."""
        self._fold()
        return dict(self._roles)

    def age(self, node: NodeState, now: float | None = None) -> float | None:
        if node.last_frame_at is None:
            return None
        return max((self.clock.now() if now is None else now) - node.last_frame_at, 0.0)

    def summary(self) -> FleetSummary:
        """The footer's counts: from counters kept per node touched, O(nodes changed + nodes gone quiet)."""
        now = self.clock.now()
        quiet = self._gone_quiet(now)  # counts the nodes touched first
        connected = self._live - len(quiet)
        oldest: float | None = None
        for node in self._framed.values():  # the front sent its last frame longest ago
            if node.last_frame_at is not None:
                oldest = now - node.last_frame_at
                break
        total = len(self.nodes)
        return FleetSummary(connected, total, oldest, self._gpus, total - connected)

    def node_row(self, node: NodeState, now: float) -> NodeRow:
        agg = node.agg or GpuAggregate(gpus=len(node.hello.gpus) if node.hello else 0)
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

    def node_rows(self, sort: str = "name", reverse: bool = False, filter_text: str = "") -> LazyRows[NodeRow]:
        """The node table: filtered by a case-insensitive substring of name, status or flags.

        Rows are made when read (a view reads a page), always from the newest state. The order by
        name is kept until a node comes or is renamed, and the order by status is brought up to date
        from the nodes changed since the last read. An order by a value is made again at most every
        VALUE_ORDER_EVERY_S and a filter's matches every FILTER_EVERY_S (at once for a new filter):
        ``as_of`` on the result says when such an order was made.
        """
        now = self.clock.now()
        needle = filter_text.strip().lower()
        if needle:
            order = self._filtered(sort, reverse, needle, now)
        elif sort == "name":
            order = self._by_name(reverse, now)
        elif sort == "status":
            order = self._by_status(reverse, now)
        else:
            order = self._by_value(sort, reverse, now)
        as_of = order.made_at if needle or sort not in ("name", "status") else None
        return LazyRows(order.nodes, lambda n: self.node_row(n, now), order.names, as_of)

    def _cached(self, key: tuple[str, bool, str], base: list[NodeState], now: float, every: float) -> _Order | None:
        """The order kept under ``key`` while it may still be shown: the same nodes, and nothing changed or young enough."""
        order = self._orders.get(key)
        if order is None or order.base is not base:
            return None
        return order if order.generation == self.generation or now - order.made_at < every else None

    def _keep(self, key: tuple[str, bool, str], order: _Order) -> _Order:
        if len(self._orders) >= 16:
            self._orders.clear()  # filters typed a letter at a time: keep only what is in use
        self._orders[key] = order
        return order

    def _by_name(self, reverse: bool, now: float) -> _Order:
        base = self._name_order()
        order = self._orders.get(("name", reverse, ""))
        if order is not None and order.base is base:
            return order
        nodes = base[::-1] if reverse else base
        return self._keep(("name", reverse, ""), _Order(nodes, [n.name for n in nodes], now, self.generation, base))

    def _by_value(self, sort: str, reverse: bool, now: float) -> _Order:
        key = (sort, reverse, "")
        base = self._name_order()
        order = self._cached(key, base, now, VALUE_ORDER_EVERY_S)
        if order is not None:
            return order
        field_name = SORT_FIELDS[sort]

        def value(node: NodeState) -> float | None:
            if sort == "age":
                last = node.last_frame_at
                return None if last is None else max(now - last, 0.0)
            agg = node.agg
            return None if agg is None else getattr(agg, field_name)

        keyed = [(_value_key(value(n), n.name), n) for n in base]
        keyed.sort(key=lambda kn: kn[0], reverse=reverse)
        if reverse:
            keyed.sort(key=lambda kn: kn[0][0])  # keep N/A at the bottom when the order flips
        nodes = [n for _, n in keyed]
        return self._keep(key, _Order(nodes, [n.name for n in nodes], now, self.generation, base))

    def _filtered(self, sort: str, reverse: bool, needle: str, now: float) -> _Order:
        """The nodes whose name, status or flags hold ``needle``, in the sort asked: O(fleet), once a second at most."""
        key = (sort, reverse, needle)
        base = self._name_order()
        order = self._cached(key, base, now, FILTER_EVERY_S)
        if order is not None:
            return order
        matched = []
        for node in base:
            row = self.node_row(node, now)
            if needle in f"{row.name} {row.status} {row.flags}".lower():
                matched.append((row, node))
        matched.sort(key=lambda rn: _sort_value(rn[0], sort), reverse=reverse)
        if reverse:
            matched.sort(key=lambda rn: _sort_value(rn[0], sort)[0])  # keep N/A at the bottom when the order flips
        nodes = [n for _, n in matched]
        return self._keep(key, _Order(nodes, [n.name for n in nodes], now, self.generation, base))

    def _by_status(self, reverse: bool, now: float) -> _Order:
        """Problems first: the few nodes not plainly ok sorted, then the rest by name; O(nodes changed)."""
        base = self._name_order()
        majority = self.majority_stack()
        outside = self.generation - self._touches  # changes made other than by a frame or a link (a pre-flight)
        if self._marks_for is None or self._marks_for[0] != majority or (
                self._marks_for[1] != outside and now - self._marks_at >= FILTER_EVERY_S):
            # Every node again: the majority stack moved (so may any node's stack mark), or something
            # changed that no frame told (checked at most once a second).
            self._dirty_marks = dict(self.nodes)
            self._marks_for, self._marks_at = (majority, outside), now
        apart = self._apart
        self._place(self._dirty_marks, majority)
        self._dirty_marks.clear()
        places = dict(apart)
        stale = STATUS_ORDER[NodeStatus.STALE]
        for node in self._gone_quiet(now):
            places[node.key] = (stale, apart.get(node.key, (stale, False))[1])
        key = ("status", reverse, "")
        order = self._orders.get(key)
        if order is not None and order.base is base and order.places == places:
            return order
        head = sorted((self.nodes[k] for k in places), key=lambda n: _status_key(*places[n.key], n.name))
        nodes = head + [n for n in base if n.key not in places]
        if reverse:
            nodes.reverse()
        return self._keep(key, _Order(nodes, [n.name for n in nodes], now, self.generation, base, places))

    def _place(self, nodes: dict[str, NodeState], majority: str | None) -> None:
        """Put each of ``nodes`` apart from the plainly ok ones (by its link status and whether it is marked), or not.

        Marked as the row's flags mark it: isolated, stack, failing GPUs, patrol, pre-flight. This runs
        for every node changed since the last read (12,500 a tick when all send a summary a second):
        written as one loop with the checks cheapest first.
        """
        apart, ok, failing = self._apart, NodeStatus.OK, PatrolStatus.FAILING
        link_status = self._link_status
        for key, node in nodes.items():
            preflight = node.preflight
            marked = (node.isolated or node.patrol.status is failing or (preflight is not None and not preflight.ok)
                      or bool(majority and node.hello is not None and node.stack_hash and node.stack_hash != majority))
            if not marked:
                reading = node.reading
                marked = reading is not None and gpus_failing(reading.gpus, node.xids)
            status = link_status(node)
            if status is ok and not marked:
                apart.pop(key, None)
            else:
                apart[key] = (STATUS_ORDER[status], marked)

    def heatmap(self, metric: Metric, only: Collection[str] | None = None) -> LazyRows[HeatmapNode]:
        """Cells for the heatmap in order of first sight, limited to the names in ``only`` when given.

        Each node's cells are made when first read: only the lines on screen are drawn. The list of
        nodes is kept until a node comes or is renamed (or ``only`` changes).
        """
        now = self.clock.now()
        base = self._name_order()  # made again when a node comes or is renamed
        kept = self._first_sight
        if kept is None or kept[0] is not base or kept[1] != only:
            wanted = None if only is None else frozenset(only)
            nodes = [n for n in self.nodes.values() if wanted is None or n.name in wanted]
            kept = self._first_sight = (base, wanted, nodes, [n.name for n in nodes])
        return LazyRows(kept[2], lambda n: HeatmapNode(n, self.status(n, now), self.stack_mismatch(n), metric), kept[3])

    def worst_node(self, metric: Metric) -> str | None:
        """The name of the node whose worst GPU is hottest on ``metric`` (health: failing first), or None."""
        best: tuple[float, str] | None = None
        for node in self.nodes.values():
            agg = node.agg
            if agg is None:
                continue
            value = worst_of(agg, metric)
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
