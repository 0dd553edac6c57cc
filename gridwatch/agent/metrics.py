"""Prometheus /metrics for one agent: dcgm-exporter's GPU names and labels, plus gridwatch_ host and agent metrics."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from loguru import logger
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gridwatch.agent.sources import SourceHealth, SourceState
from gridwatch.agent.sources.ib.metrics import ib_families
from gridwatch.agent.sources.ib.source import IbSource
from gridwatch.wire.protocol import AgentStats, Event, GpuInfo, GpuSample, HostSample
from gridwatch.wire.throttle import encode_throttle
from gridwatch.wire.xid import xid_meaning

# dcgm-exporter's label set, so its Grafana dashboards work unchanged (its released
# versions spell the host label "Hostname"). Its default counters file also makes the
# driver version a label of every GPU metric (DCGM_FI_DRIVER_VERSION, type "label").
GPU_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION")
# dcgm-exporter adds these to DCGM_FI_DEV_XID_ERRORS: the code again, and its meaning.
XID_LABELS = (*GPU_LABELS, "err_code", "err_msg")

# (metric, help, GpuSample field, scale). dcgm-exporter declares some of these
# counters, but prometheus_client would then append "_total" and break the
# names dashboards query; as gauges they keep dcgm's exact names.
_GPU_FIELDS: tuple[tuple[str, str, str, float], ...] = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "util", 1),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", "mem_util", 1),
    ("DCGM_FI_DEV_ENC_UTIL", "Encoder utilization (in %).", "enc_util", 1),
    ("DCGM_FI_DEV_DEC_UTIL", "Decoder utilization (in %).", "dec_util", 1),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temp_c", 1),
    ("DCGM_FI_DEV_MEMORY_TEMP", "Memory temperature (in C).", "mem_temp_c", 1),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w", 1),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "Total energy consumption since boot (in mJ).", "energy_j", 1000),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "sm_clock_mhz", 1),
    ("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", "mem_clock_mhz", 1),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "mem_used_mb", 1),
    ("DCGM_FI_DEV_FB_RESERVED", "Framebuffer memory reserved (in MiB).", "mem_reserved_mb", 1),
    ("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "PCIe transmit throughput (in KB/s).", "pcie_tx_kbs", 1),
    ("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", "PCIe receive throughput (in KB/s).", "pcie_rx_kbs", 1),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "Total number of PCIe retries.", "pcie_replay", 1),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors.", "ecc_sbe", 1),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors.", "ecc_dbe", 1),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "Whether rows are pending remapping (1) or not (0).", "remapped_rows_pending", 1),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether remapping of rows has failed", "remapped_rows_failed", 1),
    (
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for uncorrectable errors",
        "remapped_rows_uncorrectable", 1,
    ),
    (
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for correctable errors",
        "remapped_rows_correctable", 1,
    ),
    (
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "Total number of NVLink bandwidth counters for all lanes.",
        "nvlink_bytes", 1,
    ),
    ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "vGPU License status", "vgpu_license_status", 1),
    # Profiling (DCP) fields, read through NVML GPM on Hopper and later; absent elsewhere, as dcgm leaves them.
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "Ratio of time the graphics engine is active.", "gr_engine_active", 1),
    ("DCGM_FI_PROF_SM_ACTIVE", "The ratio of cycles an SM has at least 1 warp assigned.", "sm_active", 1),
    ("DCGM_FI_PROF_SM_OCCUPANCY", "The ratio of number of warps resident on an SM.", "sm_occupancy", 1),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "Ratio of cycles the tensor (HMMA) pipe is active.", "tensor_active", 1),
    (
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "Ratio of cycles the device memory interface is active sending or receiving data.", "dram_active", 1,
    ),
    (
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads - "
        "in bytes per second.", "pcie_tx_bps", 1,
    ),
    (
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "The rate of data received over the PCIe bus - including both protocol headers and data payloads - "
        "in bytes per second.", "pcie_rx_bps", 1,
    ),
    (
        "DCGM_FI_PROF_NVLINK_TX_BYTES",
        "The rate of data transmitted over NVLink, not including protocol headers, in bytes per second.",
        "nvlink_tx_bps", 1,
    ),
    (
        "DCGM_FI_PROF_NVLINK_RX_BYTES",
        "The rate of data received over NVLink, not including protocol headers, in bytes per second.",
        "nvlink_rx_bps", 1,
    ),
    ("gridwatch_gpu_retired_pages", "Pages retired for single- and double-bit ECC errors (pre-Ampere).", "retired_pages", 1),
    ("gridwatch_gpu_nvlink_errors", "NVLink replay, recovery and CRC errors summed over active links.", "nvlink_errors", 1),
    ("gridwatch_gpu_compute_processes", "Compute processes holding the GPU.", "procs", 1),
)
# Per NVLink, as DCGM's DCGM_FI_PROF_NVLINK_L<n>_TX_BYTES / _RX_BYTES fields (GPM's per-link rates).
_LINK_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("TX", "transmitted", "nvlink_link_tx_bps"),
    ("RX", "received", "nvlink_link_rx_bps"),
)


def xid_message(code: int) -> str:
    """dcgm-exporter's ``err_msg`` for an XID code: ``No Error`` for 0, else what the code means."""
    return "No Error" if code == 0 else xid_meaning(code)


def nvml_bus_id(key: str | None) -> str:
    """``0000:3b:00.0`` back to NVML's (and dcgm-exporter's) ``00000000:3B:00.0``."""
    if not key or key.count(":") != 2:
        return key or ""
    domain, rest = key.split(":", 1)
    return f"{domain.zfill(8)}:{rest}".upper()


@dataclass(frozen=True)
class _Snapshot:
    node: str
    infos: list[GpuInfo]
    gpus: list[GpuSample]
    host: HostSample
    agent: AgentStats


@dataclass
class _EventCounts:
    lock: threading.Lock = field(default_factory=threading.Lock)
    by_kind: dict[tuple[str, str], int] = field(default_factory=dict)
    last_xid: dict[int, int] = field(default_factory=dict)


class MetricsExporter:
    """Holds the latest readings and renders them when Prometheus scrapes.

    ``update`` only swaps a reference, so the sampler pays nothing per tick; the
    families are built on scrape, from its own registry (no process-wide state).
    A field that is ``None`` (N/A) is left out, never exported as 0.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._snap: _Snapshot | None = None
        self._events = _EventCounts()
        self._server: Any = None
        self._sources: list[SourceHealth] = []
        self.infiniband: IbSource | None = None  # its last reading, under node_exporter's infiniband names
        self.registry.register(_Collector(self))

    def update(
        self, node: str, infos: list[GpuInfo], gpus: list[GpuSample], host: HostSample, agent: AgentStats
    ) -> None:
        """The readings of one tick; what the next scrape will show."""
        self._snap = _Snapshot(node, infos, gpus, host, agent)

    def record_sources(self, health: list[SourceHealth]) -> None:
        """How each source's last read went (node_exporter's ``node_scrape_collector_*``)."""
        self._sources = list(health)

    def record_event(self, event: Event) -> None:
        """Count an event (``gridwatch_events_total``); an XID also sets ``DCGM_FI_DEV_XID_ERRORS``."""
        with self._events.lock:
            key = (str(event.kind), str(event.severity))
            self._events.by_kind[key] = self._events.by_kind.get(key, 0) + 1
            if event.kind == "xid" and event.gpu is not None and event.code is not None:
                self._events.last_xid[event.gpu] = event.code

    def render(self) -> bytes:
        """The text a scrape of ``/metrics`` returns."""
        return generate_latest(self.registry)

    def start(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        bound = int(server.server_address[1])
        logger.info("metrics on http://{}:{}/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ---------------------------------------------------------------- families

    def families(self) -> Iterator[Metric]:
        snap = self._snap
        if snap is not None:
            yield from self._gpu_families(snap)
            yield from _host_families(snap.node, snap.host)
            yield from _agent_families(snap.node, snap.agent)
            yield from _source_families(snap.node, self._sources)
        if self.infiniband is not None:
            yield from ib_families(self.infiniband.last)
        yield from self._event_families(snap.node if snap else "")

    def _gpu_families(self, snap: _Snapshot) -> Iterator[Metric]:
        infos = {i.index: i for i in snap.infos}

        def labels(index: int) -> list[str]:
            info = infos.get(index)
            return [
                str(index),
                str(info.uuid) if info else "",
                nvml_bus_id(info.pci_bus_id) if info else "",
                f"nvidia{index}",
                str(info.name) if info else "",
                snap.node,
                str(info.driver or "") if info else "",
            ]

        for name, help_text, attr, scale in _GPU_FIELDS:
            family = GaugeMetricFamily(name, help_text, labels=GPU_LABELS)
            for s in snap.gpus:
                value = getattr(s, attr)
                if value is not None:
                    family.add_metric(labels(s.index), float(value) * scale)
            yield family
        free = GaugeMetricFamily("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", labels=GPU_LABELS)
        throttle = GaugeMetricFamily(
            "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "Current clock throttle reasons (NVML bit mask).", labels=GPU_LABELS
        )
        state = GaugeMetricFamily(
            "gridwatch_gpu_state", "1 for the GPU's current state: ok, hung or lost.", labels=[*GPU_LABELS, "state"]
        )
        for s in snap.gpus:
            if s.mem_total_mb is not None and s.mem_used_mb is not None:
                free.add_metric(labels(s.index), s.mem_total_mb - s.mem_used_mb)
            # A lost GPU's empty list means "unknown", not "not throttled".
            if s.state != "lost":
                throttle.add_metric(labels(s.index), float(encode_throttle([str(t) for t in s.throttle])))
            state.add_metric([*labels(s.index), str(s.state)], 1.0)
        # From the first scrape, as dcgm-exporter: 0 ("No Error") until an XID arrives; alert rules rely on it.
        xid = GaugeMetricFamily(
            "DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", labels=XID_LABELS
        )
        with self._events.lock:
            last_xid = dict(self._events.last_xid)
        for index in sorted({s.index for s in snap.gpus} | set(last_xid)):
            code = last_xid.get(index, 0)
            xid.add_metric([*labels(index), str(code), xid_message(code)], float(code))
        yield from (free, throttle, state, xid)
        yield from _link_families(snap.gpus, labels)

    def _event_families(self, node: str) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "gridwatch_events", "Events this agent raised, by kind and severity.", labels=["node", "kind", "severity"]
        )
        with self._events.lock:
            counts = sorted(self._events.by_kind.items())
        for (kind, severity), count in counts:
            family.add_metric([node, kind, severity], count)
        yield family


def _link_families(gpus: list[GpuSample], labels: Callable[[int], list[str]]) -> Iterator[Metric]:
    """``DCGM_FI_PROF_NVLINK_L<n>_TX_BYTES`` / ``_RX_BYTES``: one family per link any GPU reports."""
    links = max((len(getattr(s, attr)) for s in gpus for _d, _w, attr in _LINK_FIELDS), default=0)
    for link in range(links):
        for direction, verb, attr in _LINK_FIELDS:
            family = GaugeMetricFamily(
                f"DCGM_FI_PROF_NVLINK_L{link}_{direction}_BYTES",
                f"The rate of data {verb} over NVLink {link}, not including protocol headers, in bytes per second.",
                labels=GPU_LABELS,
            )
            for s in gpus:
                values = getattr(s, attr)
                if link < len(values) and values[link] is not None:
                    family.add_metric(labels(s.index), float(values[link]))
            yield family


def _gauge(name: str, help_text: str, node: str, value: float | None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=["node"])
    if value is not None:
        family.add_metric([node], value)
    return family


def _ratio(percent: float | None) -> float | None:
    return None if percent is None else percent / 100.0


def _mib(value: float | None) -> float | None:
    return None if value is None else value * 1024 * 1024


def _host_families(node: str, h: HostSample) -> Iterator[Metric]:
    yield _gauge("gridwatch_host_cpu_utilization_ratio", "Share of all CPUs busy (0-1).", node, _ratio(h.cpu_percent))
    yield _gauge("gridwatch_host_memory_used_bytes", "Memory in use (total - available).", node, _mib(h.mem_used_mb))
    yield _gauge("gridwatch_host_memory_total_bytes", "Physical memory.", node, _mib(h.mem_total_mb))
    yield _gauge("gridwatch_host_load1", "1-minute load average.", node, h.load1)
    yield _gauge("gridwatch_host_load5", "5-minute load average.", node, h.load5)
    yield _gauge("gridwatch_host_load15", "15-minute load average.", node, h.load15)
    yield _gauge("gridwatch_host_disk_read_bytes_per_second", "Disk reads, all disks.", node, h.disk_read_bps)
    yield _gauge("gridwatch_host_disk_written_bytes_per_second", "Disk writes, all disks.", node, h.disk_write_bps)
    psi = GaugeMetricFamily(
        "gridwatch_host_pressure_some_avg10_ratio",
        "Share of the last 10 s some task stalled on the resource (PSI).",
        labels=["node", "resource"],
    )
    for resource, value in (("cpu", h.psi_cpu), ("memory", h.psi_memory), ("io", h.psi_io)):
        if value is not None:
            psi.add_metric([node, resource], value / 100.0)
    yield psi
    labels = ["node", "nic"]
    rx = GaugeMetricFamily("gridwatch_host_nic_receive_bytes_per_second", "Bytes received per second.", labels=labels)
    tx = GaugeMetricFamily("gridwatch_host_nic_transmit_bytes_per_second", "Bytes sent per second.", labels=labels)
    errors = CounterMetricFamily(
        "gridwatch_host_nic_errors", "NIC errors since boot.", labels=[*labels, "direction"]
    )
    drops = CounterMetricFamily(
        "gridwatch_host_nic_drops", "Packets dropped since boot.", labels=[*labels, "direction"]
    )
    up = GaugeMetricFamily("gridwatch_host_nic_up", "1 when the link is up.", labels=labels)
    speed = GaugeMetricFamily("gridwatch_host_nic_speed_bytes_per_second", "Link speed.", labels=labels)
    for nic in h.nics:
        key = [node, str(nic.name)]
        rx.add_metric(key, nic.rx_bps)
        tx.add_metric(key, nic.tx_bps)
        errors.add_metric([*key, "receive"], nic.rx_errors)
        errors.add_metric([*key, "transmit"], nic.tx_errors)
        drops.add_metric([*key, "receive"], nic.rx_drops)
        drops.add_metric([*key, "transmit"], nic.tx_drops)
        if nic.up is not None:
            up.add_metric(key, 1.0 if nic.up else 0.0)
        if nic.speed_mbps is not None:
            speed.add_metric(key, nic.speed_mbps * 125_000)
    yield from (rx, tx, errors, drops, up, speed)


def _agent_families(node: str, a: AgentStats) -> Iterator[Metric]:
    yield _gauge(
        "gridwatch_agent_cpu_utilization_ratio", "The agent's CPU use, in cores (1 = one core).", node,
        _ratio(a.cpu_percent),
    )
    yield _gauge("gridwatch_agent_resident_memory_bytes", "The agent's resident memory.", node, _mib(a.rss_mb))
    yield _gauge("gridwatch_agent_clients", "Consoles connected to this agent.", node, float(a.clients))
    dropped = CounterMetricFamily(
        "gridwatch_agent_dropped_frames", "Frames dropped for slow clients.", labels=["node"]
    )
    dropped.add_metric([node], a.dropped_frames)
    yield dropped
    replies = CounterMetricFamily(
        "gridwatch_agent_dropped_replies", "Replies a console that stopped reading never got (its session was closed).",
        labels=["node"],
    )
    replies.add_metric([node], a.dropped_replies)
    yield replies
    refused = CounterMetricFamily(
        "gridwatch_agent_refused_requests", "Actions and searches refused for a key over its budget.", labels=["node"]
    )
    refused.add_metric([node], a.refused_requests)
    yield refused
    yield _gauge(
        "gridwatch_agent_tick_seconds", "Time the last sampler tick took.", node,
        None if a.tick_ms is None else a.tick_ms / 1000.0,
    )


def _source_families(node: str, sources: list[SourceHealth]) -> Iterator[Metric]:
    success = GaugeMetricFamily(
        "gridwatch_agent_source_success", "1 when the source's last read answered in time, else 0.",
        labels=["node", "source"],
    )
    duration = GaugeMetricFamily(
        "gridwatch_agent_source_duration_seconds", "How long the source's last read took (a hung one: so far).",
        labels=["node", "source"],
    )
    for h in sources:
        success.add_metric([node, h.name], 1.0 if h.state is SourceState.OK else 0.0)
        if h.duration_s is not None:
            duration.add_metric([node, h.name], h.duration_s)
    yield from (success, duration)


class _Collector(Collector):
    def __init__(self, exporter: MetricsExporter) -> None:
        self._exporter = exporter

    def collect(self) -> Iterator[Metric]:
        return self._exporter.families()
