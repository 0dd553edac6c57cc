"""Classifying the job's timeline: a stretch's seconds against the incidents' windows and the typical step, and restores."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from gridwatch.console.fleet.goodput import IncidentSpan, Piece, Rollback, TimeUse
from gridwatch.console.fleet.jobstate import JobPhase

# An unfinished step counts as productive for up to this many typical steps (it may still finish).
_PENDING_STEPS = 3.0
# The phases whose time is one loss, whatever the incidents.
_BY_PHASE: dict[JobPhase, TimeUse] = {
    JobPhase.CHECKPOINTING: TimeUse.CHECKPOINT, JobPhase.RESTARTING: TimeUse.RESTORE,
    JobPhase.REFORMING: TimeUse.REFORM, JobPhase.JOINING: TimeUse.WAITING, JobPhase.STARTING: TimeUse.STARTUP,
}


@dataclass(slots=True)
class Block:
    """A settled stretch (from one step change to the next) and what its seconds were spent on."""

    start: float
    end: float
    amounts: dict[TimeUse, float]
    first_step: int | None = None  # the steps its productive time went into: (first_step, last_step]
    last_step: int | None = None
    next_index: int = 0  # the piece (absolute index) that ended it, and its step
    next_step: int | None = None


def _windows_of(span: IncidentSpan, now: float) -> tuple[tuple[float, float], tuple[float, float]]:
    detect = (span.start, span.detected_at)
    recover = (span.detected_at, span.recovered_at if span.recovered_at is not None else now)
    return detect, recover


class Windows:
    """The incidents' detection and recovery windows as one sorted run of segments, for quick overlap sums."""

    def __init__(self, spans: list[IncidentSpan], now: float) -> None:
        events: list[tuple[float, int, int]] = []  # (time, +1/-1, 0 detect | 1 recover)
        for span in spans:
            detect, recover = _windows_of(span, now)
            for (lo, hi), kind in ((detect, 0), (recover, 1)):
                if hi > lo:
                    events += [(lo, 1, kind), (hi, -1, kind)]
        events.sort()
        self.starts: list[float] = []
        self.segments: list[tuple[float, float, str]] = []
        open_ = [0, 0]
        for (t, delta, kind), nxt in zip(events, [*events[1:], None]):
            open_[kind] += delta
            if nxt is None or nxt[0] <= t:
                continue
            # A second in some incident's detection window is detection, whatever else overlaps it.
            label = "detect" if open_[0] > 0 else "recover" if open_[1] > 0 else ""
            if label:
                self.starts.append(t)
                self.segments.append((t, nxt[0], label))

    def split(self, start: float, end: float) -> dict[str, float]:
        """Seconds of ``[start, end]`` inside a detection window, a recovery window, or neither."""
        out = {"clean": end - start, "detect": 0.0, "recover": 0.0}
        index = max(bisect.bisect_right(self.starts, start) - 1, 0)
        for lo, hi, label in self.segments[index:]:
            if lo >= end:
                break
            overlap = min(hi, end) - max(lo, start)
            if overlap > 0:
                out[label] += overlap
                out["clean"] -= overlap
        out["clean"] = max(out["clean"], 0.0)
        return out


def settle(group: list[tuple[Piece, float]], forward: int, from_step: int | None, seen_step: bool,
            windows: Windows, typical: tuple[dict[int | None, float], float] | None,
            pending: bool = False) -> Block:
    amounts = dict.fromkeys(TimeUse, 0.0)
    start, stop = group[0][0].start, group[-1][1]
    train = {"clean": 0.0, "detect": 0.0, "recover": 0.0}
    world = group[-1][0].world
    for piece, piece_end in group:
        seconds = piece_end - piece.start
        if seconds <= 0:
            continue
        if not seen_step:
            amounts[TimeUse.STARTUP] += seconds  # before the first step ever: start-up, whatever the phase
            continue
        use = _BY_PHASE.get(piece.phase)
        if use is not None:
            amounts[use] += seconds
            continue
        parts = windows.split(piece.start, piece_end)
        if piece.phase is JobPhase.ABSENT:
            amounts[TimeUse.DETECTION] += parts["detect"]
            amounts[TimeUse.REFORM] += parts["recover"]
            amounts[TimeUse.WAITING] += parts["clean"]
            continue
        for kind, value in parts.items():
            train[kind] += value
    step_s = None
    if typical is not None:
        per_world, overall = typical
        step_s = per_world.get(world, overall)
    budget = forward * step_s if step_s is not None else (sum(train.values()) if forward else 0.0)
    if pending:
        # A step under way: productive while it could still be a normal step.
        budget = _PENDING_STEPS * step_s if step_s is not None else sum(train.values())
    productive = 0.0
    for kind in ("clean", "recover", "detect"):
        take = min(train[kind], max(budget - productive, 0.0))
        productive += take
        train[kind] -= take
    amounts[TimeUse.PRODUCTIVE] += productive
    amounts[TimeUse.DETECTION] += train["detect"]
    amounts[TimeUse.REFORM] += train["recover"]
    # Training time beyond the typical steps: a slow step when the step came, else a stall nothing explains.
    amounts[TimeUse.SLOW_STEPS if forward or pending else TimeUse.OTHER] += train["clean"]
    block = Block(start, stop, amounts)
    if forward and from_step is not None:
        block.first_step, block.last_step = from_step, from_step + forward
    return block


def take_back(history: list[Block], rollback: Rollback) -> dict[TimeUse, float]:
    """Move the productive time of the steps above ``rollback.to_step`` trained before it into recompute.

    Returns the seconds moved per use. Taking the same rollback back twice moves nothing the second time.
    """
    moved_total = 0.0
    for block in reversed(history):
        if block.start >= rollback.at:
            continue
        if block.first_step is None or block.last_step is None:
            continue
        if block.last_step <= rollback.to_step:
            break
        steps = block.last_step - block.first_step
        lost = block.last_step - max(block.first_step, rollback.to_step)
        moved = block.amounts[TimeUse.PRODUCTIVE] * (lost / steps if steps else 1.0)
        block.amounts[TimeUse.PRODUCTIVE] -= moved
        block.amounts[TimeUse.RECOMPUTE] += moved
        moved_total += moved
        block.last_step = max(block.first_step, rollback.to_step)  # taken back once
    return {TimeUse.PRODUCTIVE: -moved_total, TimeUse.RECOMPUTE: moved_total}
