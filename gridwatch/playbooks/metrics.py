"""Metric names a playbook may use, and how each is read from a ``Sample`` frame.

``gpu.*`` metrics are read per GPU (one value per GPU index), ``host.*`` and
``trainer.*`` once per node. A reading the hardware cannot give is ``None`` and
never satisfies a condition: N/A is not zero.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

from gridwatch.playbooks.durations import parse_duration
from gridwatch.wire.protocol import GpuSample, Sample


def _throttled(words: tuple[str, ...]) -> Callable[[GpuSample], float | None]:
    def read(gpu: GpuSample) -> float | None:
        return 1.0 if any(w in r.lower() for r in gpu.throttle for w in words) else 0.0

    return read


def _mem_percent(used: float | None, total: float | None) -> float | None:
    if used is None or not total:
        return None
    return 100.0 * used / total


GPU_METRICS: dict[str, Callable[[GpuSample], float | None]] = {
    "gpu.temperature": lambda g: g.temp_c,
    "gpu.util": lambda g: g.util,
    "gpu.mem_util": lambda g: g.mem_util,
    "gpu.memory_used": lambda g: g.mem_used_mb,
    "gpu.memory_percent": lambda g: _mem_percent(g.mem_used_mb, g.mem_total_mb),
    "gpu.power": lambda g: g.power_w,
    "gpu.sm_clock": lambda g: g.sm_clock_mhz,
    "gpu.mem_clock": lambda g: g.mem_clock_mhz,
    "gpu.pcie_replay": lambda g: None if g.pcie_replay is None else float(g.pcie_replay),
    "gpu.ecc_sbe": lambda g: None if g.ecc_sbe is None else float(g.ecc_sbe),
    "gpu.ecc_dbe": lambda g: None if g.ecc_dbe is None else float(g.ecc_dbe),
    "gpu.retired_pages": lambda g: None if g.retired_pages is None else float(g.retired_pages),
    "gpu.nvlink_errors": lambda g: None if g.nvlink_errors is None else float(g.nvlink_errors),
    # NVML names thermal reasons sw_thermal_slowdown / hw_thermal_slowdown and
    # power ones sw_power_cap / hw_power_brake: matching on the word covers both.
    "gpu.throttle.thermal": _throttled(("thermal",)),
    "gpu.throttle.power": _throttled(("power",)),
    "gpu.lost": lambda g: 1.0 if g.state == "lost" else 0.0,
}

NODE_METRICS: dict[str, Callable[[Sample], float | None]] = {
    "host.cpu": lambda s: s.host.cpu_percent,
    "host.mem_used": lambda s: s.host.mem_used_mb,
    "host.mem_percent": lambda s: _mem_percent(s.host.mem_used_mb, s.host.mem_total_mb),
    "host.load1": lambda s: s.host.load1,
    "host.psi_cpu": lambda s: s.host.psi_cpu,
    "host.psi_memory": lambda s: s.host.psi_memory,
    "host.psi_io": lambda s: s.host.psi_io,
    "host.nic_errors": lambda s: float(sum(n.rx_errors + n.tx_errors for n in s.host.nics)),
    "trainer.loss": lambda s: s.trainer.loss if s.trainer else None,
    "trainer.grad_norm": lambda s: s.trainer.grad_norm if s.trainer else None,
    "trainer.step_time": lambda s: s.trainer.step_time_s if s.trainer else None,
    "trainer.tokens_per_s": lambda s: s.trainer.tokens_per_s if s.trainer else None,
}

METRIC_NAMES: tuple[str, ...] = tuple(sorted([*GPU_METRICS, *NODE_METRICS]))

OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}

_CONDITION = re.compile(
    r"^\s*(?P<metric>[a-z_.]+)\s*(?P<op>>=|<=|==|!=|>|<)\s*(?P<value>-?\d+(?:\.\d+)?)"
    r"(?:\s+for\s+(?P<hold>\S+))?\s*$"
)


@dataclass(frozen=True)
class MetricCondition:
    """``gpu.temperature > 90 for 60s``: true once the comparison has held ``hold`` seconds."""

    metric: str
    op: str
    threshold: float
    hold: float = 0.0

    @property
    def per_gpu(self) -> bool:
        return self.metric in GPU_METRICS

    def holds(self, value: float | None) -> bool:
        return value is not None and OPERATORS[self.op](value, self.threshold)

    def readings(self, sample: Sample) -> list[tuple[int | None, float | None]]:
        """(gpu index or None, value) for every reading this condition looks at."""
        if self.per_gpu:
            read = GPU_METRICS[self.metric]
            return [(g.index, read(g)) for g in sample.gpus]
        return [(None, NODE_METRICS[self.metric](sample))]

    def __str__(self) -> str:
        text = f"{self.metric} {self.op} {self.threshold:g}"
        return f"{text} for {self.hold:g}s" if self.hold else text


def parse_condition(text: str, hold: float | None = None) -> MetricCondition:
    """Parse ``metric op number [for duration]``; ValueError says what is wrong."""
    match = _CONDITION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a condition: write it as 'gpu.temperature > 90 for 60s'")
    metric = match.group("metric")
    if metric not in GPU_METRICS and metric not in NODE_METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRIC_NAMES)}")
    window = parse_duration(match.group("hold")) if match.group("hold") else 0.0
    if hold is not None:
        window = hold
    return MetricCondition(metric, match.group("op"), float(match.group("value")), window)
