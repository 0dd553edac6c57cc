"""The view rows and their sorting: the node table's rows, the footer, the heatmap's cells, the training run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, overload

from gridwatch.console.fleet.metrics import Metric, gpu_metric
from gridwatch.console.fleet.node import NodeState, NodeStatus
from gridwatch.wire.protocol import TrainerStatus


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
    job: str = ""  # the scheduler's jobs on the node (Slurm job ids, pods), else the trainer's job name
    every_s: float = 1.0  # the node's cadence: a frame at least this often (a sample a tick, or its summaries)

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
# The row field (and GpuAggregate field, same name) each value sort reads.
SORT_FIELDS: dict[str, str] = {"util": "util", "temp": "temp_max", "power": "power_w", "mem": "mem_pct",
                               "rx": "rx_bps", "tx": "tx_bps", "step": "step_time_s", "age": "age_s"}
# A value sort's order is made again at most this often (its rows' values are always fresh): an
# operator reads a reshuffle every tick at 12,500 nodes as noise, and each one costs a sort of the fleet.
VALUE_ORDER_EVERY_S = 2.0
FILTER_EVERY_S = 1.0  # likewise a filter's matches, made again at once when the filter text changes


# A node heard within this many of its intervals is on time (jitter included; stale is three).
ON_TIME_INTERVALS = 1.5


def seen_age(age_s: float | None, every_s: float) -> float | None:
    """How late a node is, as SEEN shows and sorts it: 0.0 while heard within its cadence, else its age.

    On-time nodes read alike and keep their order by name in the age sort, rather than reshuffle
    with each frame's arrival.
    """
    if age_s is not None and age_s < ON_TIME_INTERVALS * every_s:
        return 0.0
    return age_s


def status_key(order: int, marked: bool, name: str) -> tuple:
    # Problems first: a down node outranks a healthy isolated one.
    return (0, order, not marked, name)


def value_key(value: float | None, name: str) -> tuple:
    # N/A sorts last whichever way the operator sorts.
    return (1, 0.0, name) if value is None else (0, value, name)


def sort_value(row: NodeRow, key: str) -> tuple:
    if key == "name":
        return (0, row.name)
    if key == "status":
        marked = row.isolated or row.mismatch or bool(row.gpu_bad) or row.patrol_failing or row.preflight_failed
        return status_key(STATUS_ORDER[row.status], marked, row.name)
    if key == "age":
        return value_key(seen_age(row.age_s, row.every_s), row.name)
    return value_key(getattr(row, SORT_FIELDS[key]), row.name)


_Place = tuple[int, bool]  # a node's place in the status order: (STATUS_ORDER of its status, marked)


@dataclass(slots=True)
class Order:
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
    hearsay: int = 0  # of the nodes, those read from Prometheus alone (no agent speaks for them)


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

    @property
    def stamp(self) -> tuple:
        """What its cells are made of: equal stamps, equal cells (a view keeps a node's cells until this changes).

        The reading itself, not a copy: a new frame is a new object, and an unchanged node compares by identity.
        """
        node = self._node
        xids = sum(node.xids.values()) if node.xids else 0  # the health colours count them
        return (node.reading, self.status, self.isolated, self.mismatch, self.checks_failing, self.gpus,
                self._metric, xids)


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
class JobRow:
    """One scheduler job across the fleet, as ``squeue`` shows it, from the agents of the nodes it runs on."""

    scheduler: str
    id: str
    user: str
    name: str
    nodes: str  # as the scheduler writes them; empty when no agent could read it
    on: list[str]  # the nodes whose agents report it
    worst: NodeStatus  # the worst state among those nodes
    pids: int


@dataclass(slots=True)
class TrainingSummary:
    """The training run as the most advanced trainer status reports it."""

    node: str
    status: TrainerStatus
    age_s: float | None
    loss: list[tuple[int, float]]
    nodes_reporting: int
