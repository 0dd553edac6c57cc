"""GPU metrics: health, each metric scaled onto 0..1 for colouring, and a node's GPUs summed up."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from gridwatch.wire.protocol import GpuBrief, GpuSample, HostSample, Sample, Summary


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
    """Mean utilization, hottest GPU, total power and memory, network totals, failing GPUs (of a sample or a summary)."""
    agg = _aggregate_gpus(sample.gpus, xids)
    if isinstance(sample, Summary):
        agg.rx_bps, agg.tx_bps = sample.rx_bps, sample.tx_bps
    else:
        agg.rx_bps, agg.tx_bps = host_traffic(sample.host)
    if sample.trainer is not None:
        agg.step_time_s = sample.trainer.step_time_s
    return agg


def host_traffic(host: HostSample) -> tuple[float | None, float | None]:
    """Bytes/s in and out of the node: its NICs plus its InfiniBand / RoCE HCA ports; ``None`` where neither reports.

    RDMA traffic (NCCL's, the bulk of a training node's) passes no NIC's counters, only the HCA port's, so
    a node counted by its NICs alone reads 0 B while its HCAs carry tens of GB/s. (IP over InfiniBand is
    counted by both the ``ib0`` netdev and its port: small beside the RDMA traffic, and said here.)
    As the agent's summary sums them (``wire.frames.summarize``).
    """
    nics = host.nics
    ib_rx, ib_tx = hca_traffic(host)
    if not nics and ib_rx is None:
        return None, None
    rx = sum(n.rx_bps for n in nics) + (ib_rx or 0.0)
    tx = sum(n.tx_bps for n in nics) + (ib_tx or 0.0)
    return rx, tx


def hca_traffic(host: HostSample) -> tuple[float | None, float | None]:
    """The InfiniBand / RoCE part of :func:`host_traffic`: bytes/s through the HCA ports; ``None`` where no port reports.

    A port with no rate yet (its first sample) counts for neither; one that reports one direction counts 0 B for the other.
    """
    ports = [p for p in host.ib if p.rx_bps is not None or p.tx_bps is not None]
    if not ports:
        return None, None
    return sum(p.rx_bps or 0.0 for p in ports), sum(p.tx_bps or 0.0 for p in ports)


PCIE_KB = 1024  # nvmlDeviceGetPcieThroughput's "KB/s" are KiB/s (nvitop reads them so too)


def gpu_pcie_traffic(gpu: GpuSample) -> tuple[float | None, float | None]:
    """Bytes/s the GPU receives and sends over PCIe; ``None`` (each way) where NVML cannot say.

    GPM's rates (``NVML_GPM_METRIC_PCIE_RX_PER_SEC``, Hopper and later) where the agent read them, else
    ``nvmlDeviceGetPcieThroughput`` (``nvidia-smi dmon -s t``), which older cards give.
    """
    rx = gpu.pcie_rx_bps if gpu.pcie_rx_bps is not None else (
        None if gpu.pcie_rx_kbs is None else gpu.pcie_rx_kbs * PCIE_KB)
    tx = gpu.pcie_tx_bps if gpu.pcie_tx_bps is not None else (
        None if gpu.pcie_tx_kbs is None else gpu.pcie_tx_kbs * PCIE_KB)
    return rx, tx


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


def gpus_failing(gpus: Iterable[GpuSample | GpuBrief], xids: Counter[int]) -> bool:
    """Whether any GPU is failing as :func:`gpu_health` judges it (1.0): the row's bad GPUs, without summing the rest.

    The status order asks this of every node changed since the last tick; a whole aggregate would cost five times more.
    """
    for gpu in gpus:
        if gpu.state != "ok" or gpu.remapped_rows_failed or (gpu.ecc_dbe or 0) > 0:
            return True
    return bool(xids) and any(xids.get(gpu.index, 0) > 0 for gpu in gpus)
