"""Replay a recorded trace through the engine on a simulated clock driven by frame times."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.model import Playbook
from gridwatch.playbooks.plans import Incident, Plan
from gridwatch.playbooks.trace import TraceStats, read_trace
from gridwatch.wire.protocol import Action, Search, Subscribe

# Frames of several nodes interleave as they arrive; a frame this much older
# than the newest one seen is out of order and skipped rather than rewinding time.
REORDER_TOLERANCE = 5.0
TICK = 1.0  # the console ticks the engine once a second; replay does the same
_MAX_TICKS_PER_GAP = 10_000


@dataclass
class ReplayResult:
    """Everything a replay planned, the incidents behind it, and what it skipped."""

    plans: list[Plan] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    stats: TraceStats = field(default_factory=TraceStats)
    replayed: int = 0  # frames fed to the engine
    start: float | None = None
    end: float | None = None


def replay(lines: Iterable[str | bytes], playbooks: Iterable[Playbook],
           reorder_tolerance: float = REORDER_TOLERANCE) -> ReplayResult:
    """Feed every usable frame, ticking the engine as the console would between them."""
    result = ReplayResult()
    clock = ManualClock()
    engine = Engine(playbooks, clock)
    last_tick: float | None = None
    for record in read_trace(lines, result.stats):
        frame = record.frame
        if isinstance(frame, (Subscribe, Action, Search)):
            result.stats.skip("console_frame", record.line_no)
            continue
        ts = frame.ts
        if result.start is None:
            result.start = ts
            clock.set(ts)
            last_tick = ts
        if ts < clock.now() - reorder_tolerance:
            result.stats.skip("out_of_order", record.line_no)
            continue
        assert last_tick is not None
        gap = ts - last_tick
        if gap >= TICK:
            step = max(TICK, gap / _MAX_TICKS_PER_GAP)
            t = last_tick + step
            while t <= ts:
                clock.set(t)
                result.plans += _done(engine, engine.tick(t))
                t += step
            last_tick = t - step
        clock.set(ts)
        result.replayed += 1
        result.plans += _done(engine, engine.observe(record.endpoint, frame))
    if result.start is not None:
        result.end = clock.now()
        result.plans += _done(engine, engine.tick(clock.now()))
    result.incidents = engine.incidents(include_closed=True)
    return result


def _done(engine: Engine, plans: list[Plan]) -> list[Plan]:
    """A replay runs no steps: what its plans remove is taken as removed, as a console whose steps worked."""
    engine.suppose_done(plans)
    return plans
