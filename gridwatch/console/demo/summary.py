"""What a demo run shows at the end: faults, detection and recovery times, steps lost, goodput and where time went."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from gridwatch.console.demo.progress import StepPoint
from gridwatch.console.demo.trust import TrustSummary
from gridwatch.console.demo.trust import render as render_trust
from gridwatch.console.fleet.goodput import Breakdown, TimeUse
from gridwatch.console.fleet.goodput_tracker import GoodputTracker
from gridwatch.playbooks.incident_times import time_to_detect, time_to_recover

if TYPE_CHECKING:
    from gridwatch.console.runtime.core import ConsoleRuntime

# An incident is the answer to a fault on its node if it opened within this long after it.
MATCH_WINDOW_S = 60.0


@dataclass(frozen=True)
class FaultRecord:
    node: str
    kind: str
    at: float
    code: int | None = None
    gpu: int | None = None

    @property
    def label(self) -> str:
        return f"xid {self.code}" if self.kind == "xid" and self.code is not None else self.kind


@dataclass(frozen=True)
class IncidentFacts:
    """One incident as the store holds it, reduced to what the summary needs."""

    id: str
    node: str
    kind: str
    playbook: str
    detected_at: float
    actions: list[str]
    acted_until: float | None  # when the last step of its plan finished


class IncidentSummary(msgspec.Struct, kw_only=True):
    id: str
    node: str
    kind: str
    playbook: str
    fault: str | None
    detected_s: float | None
    recovered_s: float | None
    actions: list[str]
    steps_lost: int | None = None  # steps done again because of it, as the console saw the job
    gpu_hours_lost: float | None = None  # the job's GPUs times the training time it lost
    # How far the fault time the console measured (the kernel's stamp, torchrun's record) is from when the
    # fault was injected: what says the detection and recovery figures are counted from the fault's own clock.
    fault_clock_error_s: float | None = None


class WindowSummary(msgspec.Struct, kw_only=True):
    """Where a stretch of the run went: seconds per use (productive and each loss), adding up to ``wall_s``."""

    wall_s: float
    goodput: float | None
    seconds: dict[str, float]


class GoodputSummary(WindowSummary, kw_only=True):
    """The run's breakdown, as the console saw the trainers, and its last 1, 5 and 15 minutes."""

    windows: dict[str, WindowSummary] = {}


class DemoSummary(msgspec.Struct, kw_only=True):
    steps: int | None
    goodput: float | None
    wall_s: float
    paced_goodput: float | None = None  # the stricter figure: see paced_goodput()
    # The trainer's own metrics, slow steps counted productive (goodput()): the figure of earlier rounds,
    # kept beside the console's ``goodput`` (which counts a slow step as a loss) so runs stay comparable.
    metrics_goodput: float | None = None
    steps_lost: int
    faults: int
    faults_detected: int
    incidents: list[IncidentSummary]
    detect_median_s: float | None = None
    detect_worst_s: float | None = None
    recover_median_s: float | None = None
    recover_worst_s: float | None = None
    notes: list[str] = []
    goodput_breakdown: GoodputSummary | None = None
    mttd_s: float | None = None  # mean time to detect, over the console's incidents
    mttr_s: float | None = None  # mean time to recover
    mtbf_s: float | None = None  # the run's wall time over its incidents
    trust: TrustSummary | None = None  # which nodes were taken out, on what evidence, and whether they stayed out


def steps_lost(points: list[StepPoint]) -> int:
    """Steps done twice: each time the step goes back, the ones between are redone."""
    lost = 0
    for before, after in zip(points, points[1:]):
        if after.step <= before.step:
            lost += before.step - after.step + 1
    return lost


# An interval between two steps longer than this many typical steps is the job stalled
# (re-forming, restoring, hung), not a slow step.
STALL_STEPS = 3.0


def _typical(points: list[StepPoint]) -> tuple[dict[int | None, float], float] | None:
    """Median step time per world size (and overall): a job on fewer nodes steps at its own pace."""
    per_world: dict[int | None, list[float]] = {}
    for a, b in zip(points, points[1:]):
        if b.step > a.step:
            per_world.setdefault(b.world, []).append((b.at - a.at) / (b.step - a.step))
    if not per_world:
        return None
    overall = statistics.median(t for times in per_world.values() for t in times)
    return {w: statistics.median(times) if len(times) >= 10 else overall for w, times in per_world.items()}, overall


def _productive_share(points: list[StepPoint], end: float, stall_steps: float | None) -> float | None:
    """Productive time over wall time from the first step to ``end``; each forward interval counts as
    long as it took, capped at ``stall_steps`` typical steps (None: exactly the typical steps)."""
    typical = _typical(points) if len(points) >= 3 else None
    wall = end - points[0].at if points else 0.0
    if typical is None or wall <= 0:
        return None
    pace, overall = typical
    productive = 0.0
    for a, b in zip(points, points[1:]):
        if b.step > a.step:
            at_pace = (b.step - a.step) * pace.get(b.world, overall)
            productive += at_pace if stall_steps is None else min(b.at - a.at, stall_steps * at_pace)
        else:  # a restore: the steps about to be redone were counted once already
            productive -= (a.step - b.step) * pace.get(a.world, overall)
    return max(0.0, min(1.0, productive / wall))


def goodput(points: list[StepPoint], end: float) -> float | None:
    """Productive time over wall time, from the first step to ``end``.

    Productive time is the time spent in steps that count: every interval
    between two steps, up to ``STALL_STEPS`` typical steps of its world size
    (beyond that the job was stalled: re-forming, restoring, hung). Steps done
    again after a restore count once. Training on fewer nodes after one is taken
    out is productive, as in Llama 3's "effective training time"; a slow step
    (a checkpoint written beside it, a busy machine) is too.
    """
    return _productive_share(points, end, STALL_STEPS)


def paced_goodput(points: list[StepPoint], end: float) -> float | None:
    """Net steps gained, each at the typical step time of its world size, over wall time.

    Stricter than :func:`goodput`: every step slower than the median counts
    against it too (stragglers, checkpoint writes, a busy machine).
    """
    return _productive_share(points, end, None)


# Training counts as resumed once it has gained this many steps after the plan ended.
RESUMED_AFTER_STEPS = 3


def _first_progress(points: list[StepPoint], after: float) -> float | None:
    """When training had gained RESUMED_AFTER_STEPS steps in a row after ``after``."""
    base: int | None = None
    for point in points:
        if point.at <= after:
            continue
        if base is None or point.step <= base:
            base = point.step  # the first step seen, or a restart: count again from here
            continue
        if point.step - base >= RESUMED_AFTER_STEPS:
            return point.at
    return None


def summarize(faults: list[FaultRecord], incidents: list[IncidentFacts], points: list[StepPoint],
              started: float, end: float, notes: list[str] | None = None) -> DemoSummary:
    rows: list[IncidentSummary] = []
    answered: set[int] = set()
    for inc in sorted(incidents, key=lambda i: i.detected_at):
        fault_index = None
        for index, candidate in enumerate(faults):
            if candidate.node == inc.node and 0 <= inc.detected_at - candidate.at <= MATCH_WINDOW_S:
                fault_index = index  # the latest fault before it on that node
        fault = faults[fault_index] if fault_index is not None else None
        detected = inc.detected_at - fault.at if fault else None
        recovered = None
        if fault is not None and points:
            resumed = _first_progress(points, max(inc.acted_until or inc.detected_at, inc.detected_at))
            recovered = resumed - fault.at if resumed is not None else None
        if fault_index is not None:
            answered.add(fault_index)
        rows.append(IncidentSummary(id=inc.id, node=inc.node, kind=inc.kind, playbook=inc.playbook,
                                    fault=fault.label if fault else None,
                                    detected_s=round(detected, 3) if detected is not None else None,
                                    recovered_s=round(recovered, 3) if recovered is not None else None,
                                    actions=inc.actions))
    detect = [r.detected_s for r in rows if r.detected_s is not None]
    recover = [r.recovered_s for r in rows if r.recovered_s is not None]
    return DemoSummary(
        steps=points[-1].step if points else None,
        goodput=round(g, 4) if (g := goodput(points, end)) is not None else None,
        metrics_goodput=round(g, 4) if (g := goodput(points, end)) is not None else None,
        paced_goodput=round(g, 4) if (g := paced_goodput(points, end)) is not None else None,
        wall_s=round(end - started, 3), steps_lost=steps_lost(points), faults=len(faults),
        faults_detected=len(answered), incidents=rows,
        detect_median_s=statistics.median(detect) if detect else None, detect_worst_s=max(detect) if detect else None,
        recover_median_s=statistics.median(recover) if recover else None,
        recover_worst_s=max(recover) if recover else None, notes=list(notes or []),
    )


def _window(breakdown: Breakdown) -> WindowSummary:
    good = breakdown.goodput
    return WindowSummary(wall_s=round(breakdown.wall_s, 3), goodput=round(good, 4) if good is not None else None,
                         seconds={use.value: round(breakdown.seconds[use], 3) for use in TimeUse})


def breakdown_summary(tracker: GoodputTracker, now: float | None = None) -> GoodputSummary | None:
    """The tracker's run and windows for the summary; None when no trainer ever reported."""
    windows = tracker.windows(now)
    run = windows.pop("run")
    if run.goodput is None:
        return None
    whole = _window(run)
    return GoodputSummary(wall_s=whole.wall_s, goodput=whole.goodput, seconds=whole.seconds,
                          windows={name: _window(b) for name, b in windows.items()})


def with_goodput(summary: DemoSummary, runtime: ConsoleRuntime, faults: list[FaultRecord] | None = None) -> DemoSummary:
    """``summary`` told with the console's own definitions, so the run's figures and the database agree:
    each incident's time to detect and to recover (from the fault's own clock, as the incident store has
    them), its cost, the goodput breakdown, MTTD, MTTR, MTBF and the steps lost (the incidents' sum)."""
    tracker = runtime.goodput
    spans = {span.id: span for span in runtime.incident_spans()}
    injected = {f"{f.node}/{f.label}": f.at for f in faults or []}
    rows = []
    for row in summary.incidents:
        span = spans.get(row.id)
        if span is None:
            rows.append(row)
            continue
        cost = tracker.cost(span)
        at = injected.get(f"{row.node}/{row.fault}") if row.fault else None
        rows.append(msgspec.structs.replace(
            row, steps_lost=cost.steps_lost, gpu_hours_lost=round(cost.gpu_hours_lost, 6),
            detected_s=_round(time_to_detect(span.fault_at, span.detected_at)),
            recovered_s=_round(time_to_recover(span.fault_at, span.recovered_at)),
            fault_clock_error_s=_round(span.fault_at - at) if span.fault_at is not None and at is not None else None))
    rel = tracker.reliability(list(spans.values()))
    detect = [r.detected_s for r in rows if r.detected_s is not None]
    recover = [r.recovered_s for r in rows if r.recovered_s is not None]
    breakdown = breakdown_summary(tracker)
    costs = [r.steps_lost for r in rows if r.steps_lost is not None]
    return msgspec.structs.replace(
        summary, incidents=rows, goodput_breakdown=breakdown,
        goodput=breakdown.goodput if breakdown is not None else summary.goodput,
        steps_lost=sum(costs) if costs else summary.steps_lost,
        detect_median_s=statistics.median(detect) if detect else None, detect_worst_s=max(detect) if detect else None,
        recover_median_s=statistics.median(recover) if recover else None,
        recover_worst_s=max(recover) if recover else None,
        mttd_s=_round(rel.mttd_s), mttr_s=_round(rel.mttr_s), mtbf_s=_round(rel.mtbf_s))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def render(summary: DemoSummary) -> list[str]:
    """The summary as lines for a terminal."""
    lines = [f"ran {summary.wall_s:.0f} s: {summary.faults} faults injected, {summary.faults_detected} detected, "
             f"{len(summary.incidents)} incidents"]
    for row in summary.incidents:
        lines.append(f"  {row.id} {row.node} {row.kind} ({row.playbook}) fault={row.fault or '-'} "
                     f"detected={_s(row.detected_s)} recovered={_s(row.recovered_s)} "
                     f"actions={','.join(row.actions) or '-'}")
    lines.append(f"detect median {_s(summary.detect_median_s)} worst {_s(summary.detect_worst_s)}; "
                 f"recover median {_s(summary.recover_median_s)} worst {_s(summary.recover_worst_s)}")
    good = "-" if summary.goodput is None else f"{summary.goodput * 100:.1f} %"
    paced = "" if summary.paced_goodput is None else f" ({summary.paced_goodput * 100:.1f} % at the typical step pace)"
    lines.append(f"training: last step {summary.steps if summary.steps is not None else '-'}, "
                 f"steps lost {summary.steps_lost}, goodput {good}{paced}")
    if summary.goodput_breakdown is not None:
        gb = summary.goodput_breakdown
        spent = ", ".join(f"{use} {seconds:.0f} s" for use, seconds in
                          sorted(gb.seconds.items(), key=lambda item: -item[1]) if seconds > 0)
        lines.append(f"where the time went ({gb.wall_s:.0f} s, goodput "
                     f"{'-' if gb.goodput is None else f'{gb.goodput * 100:.1f} %'}): {spent}")
        lines.append(f"MTTD {_s(summary.mttd_s)}, MTTR {_s(summary.mttr_s)}, MTBF {_s(summary.mtbf_s)}")
    if summary.trust is not None:
        lines.extend(render_trust(summary.trust))
    lines.extend(f"note: {note}" for note in summary.notes)
    return lines
