"""Build the small trace a dry-run replays: a few nodes, then the fault a playbook answers."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from gridwatch.playbooks.model import ConditionTrigger, EventTrigger, LogTrigger, MetricTrigger, Playbook
from gridwatch.playbooks.trace import record_line
from gridwatch.wire.protocol import Event, Frame, GpuSample, Hello, LogLine, Sample, StackFingerprint, TrainerPhase, TrainerStatus

_T0 = 1_000_000.0


@dataclass(frozen=True)
class Scenario:
    """The fault to pretend: on which node and GPU, and with which code, value or message."""

    nodes: tuple[str, ...] = tuple(f"node{i}" for i in range(1, 9))
    node: str = "node1"
    gpu: int = 0
    kind: str | None = None
    code: int | None = None
    value: float | None = None
    message: str = ""


def _sample(name: str, ts: float, gpu: GpuSample | None = None) -> Sample:
    return Sample(node=name, ts=ts, gpus=[gpu or GpuSample(index=0, temp_c=60.0, util=95.0)],
                  trainer=TrainerStatus(job="job", phase=TrainerPhase.TRAINING, step=int(ts - _T0) + 100))


def scenario_lines(playbook: Playbook, sc: Scenario) -> list[bytes]:
    """A trace in which ``playbook`` should fire once, as a dry-run shows it."""
    frames: list[Frame] = []
    trig = playbook.trigger
    for name in sc.nodes:
        stack = StackFingerprint(hash="other" if (isinstance(trig, ConditionTrigger)
                                                  and trig.condition == "stack_mismatch" and name == sc.node)
                                 else "same")
        frames.append(Hello(node=name, ts=_T0, interval=1.0, stack=stack))
        frames.append(_sample(name, _T0))
    t = _T0 + 1
    if isinstance(trig, EventTrigger):
        kind = sc.kind or sorted(trig.kinds)[0]
        code = sc.code if sc.code is not None else (min(trig.codes) if trig.codes else None)
        details = {"node": sc.node} if playbook.target.startswith("detail:") else {}
        reporters = [n for n in sc.nodes if n != sc.node] if playbook.target == "cause" else [sc.node]
        for i in range(trig.count):
            for name in reporters:
                frames.append(Event(node=name, ts=t + i, kind=kind, code=code, gpu=sc.gpu,
                                    severity="error", message=sc.message, details=details))
        t += trig.count
    elif isinstance(trig, LogTrigger):
        frames.append(LogLine(node=sc.node, ts=t, source="dry-run", line=sc.message or trig.pattern.pattern))
    elif isinstance(trig, MetricTrigger):
        cond = trig.condition
        value = sc.value if sc.value is not None else cond.threshold + (1 if cond.op in (">", ">=", "!=") else -1)
        if cond.op in ("==", ">=", "<=") and sc.value is None:
            value = cond.threshold
        for i in range(int(cond.hold) + 2):
            for name in sc.nodes:
                gpu = GpuSample(index=sc.gpu, temp_c=60.0)
                if name == sc.node and cond.per_gpu:
                    gpu = _gpu_with(cond.metric, sc.gpu, value)
                frames.append(_sample(name, t + i, gpu))
        t += cond.hold + 2
    # Everyone but a node whose heartbeat is to be lost keeps reporting, past any settle time.
    quiet = isinstance(trig, ConditionTrigger) and trig.condition == "heartbeat_lost"
    quiet_for = (trig.missed + 2) if quiet and isinstance(trig, ConditionTrigger) else 0
    until = t + max(playbook.settle, quiet_for) + 2
    while t <= until:
        frames.extend(_sample(n, t) for n in sc.nodes if not (quiet and n == sc.node))
        t += 1
    return [record_line(f.node, f) for f in frames]


def _gpu_with(metric: str, index: int, value: float) -> GpuSample:
    field = {"gpu.temperature": "temp_c", "gpu.util": "util", "gpu.power": "power_w", "gpu.mem_util": "mem_util",
             "gpu.memory_used": "mem_used_mb", "gpu.sm_clock": "sm_clock_mhz", "gpu.mem_clock": "mem_clock_mhz"}
    if metric in field:
        return msgspec.structs.replace(GpuSample(index=index), **{field[metric]: value})
    if metric.startswith("gpu.throttle."):
        reason = "hw_thermal_slowdown" if metric.endswith("thermal") else "sw_power_cap"
        return GpuSample(index=index, throttle=[reason] if value else [])
    if metric == "gpu.lost":
        return GpuSample(index=index, state="lost" if value else "ok")
    counters = {"gpu.ecc_sbe": "ecc_sbe", "gpu.ecc_dbe": "ecc_dbe", "gpu.retired_pages": "retired_pages",
                "gpu.pcie_replay": "pcie_replay", "gpu.nvlink_errors": "nvlink_errors"}
    if metric in counters:
        return msgspec.structs.replace(GpuSample(index=index), **{counters[metric]: int(value)})
    return GpuSample(index=index, temp_c=60.0)
