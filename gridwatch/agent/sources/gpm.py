"""GPU Performance Monitoring through NVML (Hopper and later): dcgm's profiling fields from two samples a tick apart."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from loguru import logger

_MIB = 1024 * 1024
# (GpuSample field, NVML_GPM_METRIC_* name, scale): ratios as dcgm reports them (0-1, GPM says %),
# rates in bytes/s (GPM says MiB/s). The same mapping DCGM uses on GPM devices.
METRICS: tuple[tuple[str, str, float], ...] = (
    ("gr_engine_active", "NVML_GPM_METRIC_GRAPHICS_UTIL", 0.01),
    ("sm_active", "NVML_GPM_METRIC_SM_UTIL", 0.01),
    ("sm_occupancy", "NVML_GPM_METRIC_SM_OCCUPANCY", 0.01),
    ("tensor_active", "NVML_GPM_METRIC_ANY_TENSOR_UTIL", 0.01),
    ("dram_active", "NVML_GPM_METRIC_DRAM_BW_UTIL", 0.01),
    ("pcie_tx_bps", "NVML_GPM_METRIC_PCIE_TX_PER_SEC", _MIB),
    ("pcie_rx_bps", "NVML_GPM_METRIC_PCIE_RX_PER_SEC", _MIB),
    ("nvlink_tx_bps", "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", _MIB),
    ("nvlink_rx_bps", "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", _MIB),
)


@dataclass
class GpmReading:
    """One interval's profiling values; ``None`` where the metric answered an error (N/A)."""

    values: dict[str, float | None] = field(default_factory=dict)
    link_tx_bps: list[float | None] = field(default_factory=list)
    link_rx_bps: list[float | None] = field(default_factory=list)


class GpmReader:
    """Two GPM samples of one GPU, swapped each tick, so each reading covers the last tick.

    No sleeping between samples: the previous tick's sample is the first of the
    pair, so a read costs two NVML calls and stays inside the source's deadline.
    ``open`` returns ``None`` where the GPU (or driver) has no GPM: those fields stay N/A.
    """

    def __init__(self, nv: ModuleType, handle: Any, links: list[int]) -> None:
        self._nv = nv
        self._handle = handle
        self._ids: list[tuple[str, int, float]] = [
            (attr, getattr(nv, name), scale) for attr, name, scale in METRICS if hasattr(nv, name)
        ]
        self._links = [
            (link, getattr(nv, f"NVML_GPM_METRIC_NVLINK_L{link}_TX_PER_SEC", None),
             getattr(nv, f"NVML_GPM_METRIC_NVLINK_L{link}_RX_PER_SEC", None))
            for link in links
        ]
        self._width = max(links, default=-1) + 1
        self._prev = nv.nvmlGpmSampleAlloc()
        self._cur = nv.nvmlGpmSampleAlloc()
        self._primed = False

    @classmethod
    def open(cls, nv: ModuleType, handle: Any, links: list[int]) -> GpmReader | None:
        """``nvmlGpmQueryDeviceSupport``; a reader with its first sample taken, or ``None`` without GPM."""
        try:
            if not nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                return None
            reader = cls(nv, handle, links)
        except (nv.NVMLError, AttributeError) as exc:  # NotSupported, FunctionNotFound, an older pynvml
            logger.debug("GPM unavailable: {}", exc)
            return None
        reader.prime()
        return reader

    def prime(self) -> None:
        """Take the first sample of a pair (at start, and after a failed read)."""
        try:
            self._nv.nvmlGpmSampleGet(self._handle, self._prev)
            self._primed = True
        except self._nv.NVMLError_GpuIsLost:
            raise
        except self._nv.NVMLError as exc:
            logger.debug("GPM sample failed: {}", exc)
            self._primed = False

    def read(self) -> GpmReading | None:
        """Metrics between the last sample and now (``nvmlGpmMetricsGet``); ``None`` for this tick on failure.

        NVML_ERROR_GPU_IS_LOST is raised to the caller, as every other NVML read does.
        """
        nv = self._nv
        if not self._primed:
            self.prime()
            return None
        try:
            nv.nvmlGpmSampleGet(self._handle, self._cur)
        except nv.NVMLError_GpuIsLost:
            raise
        except nv.NVMLError as exc:
            logger.debug("GPM sample failed: {}", exc)
            self._primed = False
            return None
        wanted: list[tuple[str, int, float]] = list(self._ids)
        for link, tx, rx in self._links:
            if tx is not None and rx is not None:
                wanted += [(f"tx{link}", tx, _MIB), (f"rx{link}", rx, _MIB)]
        request = nv.c_nvmlGpmMetricsGet_t()
        request.version = nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(wanted)
        request.sample1, request.sample2 = self._prev, self._cur
        for i, (_key, metric_id, _scale) in enumerate(wanted):
            request.metrics[i].metricId = metric_id
        # The newer sample is the first of the next pair, whatever this call says.
        self._prev, self._cur = self._cur, self._prev
        try:
            nv.nvmlGpmMetricsGet(request)
        except nv.NVMLError as exc:
            logger.debug("nvmlGpmMetricsGet failed: {}", exc)
            return None
        got: dict[str, float | None] = {}
        for i, (key, _metric_id, scale) in enumerate(wanted):
            metric = request.metrics[i]
            got[key] = float(metric.value) * scale if metric.nvmlReturn == 0 else None
        reading = GpmReading(values={attr: got.get(attr) for attr, _n, _s in self._ids})
        if self._width:
            reading.link_tx_bps = [got.get(f"tx{link}") for link in range(self._width)]
            reading.link_rx_bps = [got.get(f"rx{link}") for link in range(self._width)]
        return reading

    def close(self) -> None:
        """``nvmlGpmSampleFree`` both samples."""
        for sample in (self._prev, self._cur):
            try:
                self._nv.nvmlGpmSampleFree(sample)
            except self._nv.NVMLError as exc:
                logger.debug("nvmlGpmSampleFree: {}", exc)
