"""The history rings: a node's host and GPU metrics over the last couple of minutes, one array per node."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import cast

from gridwatch.wire.protocol import GpuBrief, GpuSample

HISTORY_POINTS = 120  # two minutes at the agents' default 1 s tick
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

    def push(self, values: Sequence[float | None]) -> None:
        """One point of every metric, in column order; None (N/A) is kept as NaN."""
        base = self.head * self.metrics
        row: array[float]
        try:
            row = array("f", cast("Sequence[float]", values))  # a full reading: the list as it is, in C
        except TypeError:  # some value is N/A
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
        if width == n:
            # GPUs in index order (as agents send them): each one's columns appended, no list to fill by index.
            for i, g in enumerate(gpus):
                if g.index != i:
                    break
                used, total = g.mem_used_mb, g.mem_total_mb
                values += (g.util, g.temp_c, g.power_w, 100.0 * used / total if used is not None and total else None)
            else:
                history.ring.push(values)
                return history
            del values[len(host):]
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
