"""The goodput tracker: follows one job's trainers and says where its time went (the uses in ``goodput``).

The tracker is fed one trainer status at a time (O(1): the job's state
is kept up to date as trainers come, change and fall silent); a breakdown
is computed on demand from the compact timeline it keeps (one piece per
change of the job's step or phase), with the incidents known by then, since
an incident is often opened after the stall it explains. Time comes from an
injected clock; nothing here imports textual.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Callable, Iterable

from gridwatch.console.fleet.goodput import (
    Breakdown,
    IncidentCost,
    IncidentSpan,
    Piece,
    Reliability,
    Rollback,
    TimeUse,
    reliability,
)
from gridwatch.console.fleet.goodput_settle import Block, Windows, settle, take_back
from gridwatch.console.fleet.jobstate import STALE_S, JobPhase, Trainers
from gridwatch.playbooks.clock import Clock, SystemClock
from gridwatch.wire.protocol import TrainerStatus

# Rolling windows every breakdown is also given over, in seconds.
WINDOWS: tuple[float, ...] = (60.0, 300.0, 900.0)
# Pieces of timeline kept (one per change of step or phase); older ones are folded into fixed totals.
MAX_PIECES = 50_000
# A restore this soon after an incident's recovery is still the incident's (see GoodputTracker.cost).
ROLLBACK_GRACE_S = 60.0
# Pieces of ended stretches left unclassified at most before the tracker settles them without being asked.
_SETTLE_EVERY = 500
# Step times remembered per world size for its typical step (the recent pace).
_PACE_MEMORY = 2000
# A world size needs this many step times of its own before its median is its typical step.
_OWN_MEDIAN = 5


class GoodputTracker:
    """Follows one job's trainers; says where its time went, over the run and the last 1, 5 and 15 minutes.

    Settled stretches (from one change of step to the next) are classified
    once and kept with running totals; only the stretch under way is classified
    on every read, and a new or changed incident reclassifies from its start.
    """

    def __init__(self, clock: Clock | None = None, incidents: Callable[[], Iterable[IncidentSpan]] | None = None,
                 max_pieces: int = MAX_PIECES) -> None:
        self.clock: Clock = clock or SystemClock()
        self.incidents = incidents or (lambda: ())  # asked at each breakdown: incidents often open after the stall
        self.max_pieces = max_pieces
        self.pieces: list[Piece] = []
        self.rollbacks: list[Rollback] = []
        self._trainers = Trainers()  # every node's last status, and the job's state they make
        self._last_step: int | None = None
        self._restore: tuple[float, int] | None = None  # when a trainer's own step went back, and to which
        self._folded = Breakdown(0.0, 0.0)  # stretches dropped for memory, already classified
        self._base = 0  # absolute index of pieces[0]
        self._base_step: int | None = None  # the step known at it
        self._closed: list[Block] = []  # settled stretches, oldest first
        self._closed_ends: list[float] = []
        self._totals = dict.fromkeys(TimeUse, 0.0)  # over self._closed
        self._resume = 0  # absolute index of the first piece of the stretch under way
        self._stretch = 0  # absolute index of the piece that began the newest stretch (its step changed)
        self._resume_step: int | None = None
        self._applied = 0  # rollbacks already taken back from the settled stretches
        self._sig: dict[str, tuple[float, float, float | None]] = {}
        self._cache: tuple[float, int, list[Block]] | None = None
        # Typical step times per world size (recent ones), from stretches of pure training.
        self._step_times: dict[int | None, deque[float]] = {}
        self._typ: tuple[int, float, bool, int | None] | None = None  # step, since, clean, world
        self._typ_version = 0
        self._typ_cache: tuple[int, tuple[dict[int | None, float], float] | None] = (-1, None)

    # ----------------------------------------------------------------- feeding

    def observe(self, node: str, status: TrainerStatus, gpus: int = 0, at: float | None = None) -> None:
        """One trainer status from ``node`` (with its GPU count); O(1), plus a piece when the job's state changed."""
        now = self.clock.now() if at is None else at
        before = self._trainers.reports.get(node)
        self._trainers.put(node, now, status, gpus)
        step = status.step
        if before is not None and before.step is not None and step is not None and step < before.step:
            self._restored_to(now, step)
        self._note(now)

    def forget(self, node: str, at: float | None = None) -> None:
        """``node`` is gone (its link is down, it was isolated): its last status no longer speaks for the job."""
        if self._trainers.drop(node):
            self._note(self.clock.now() if at is None else at)

    def _job_state(self, now: float) -> tuple[int | None, JobPhase, int | None, int]:
        return self._trainers.state(now)

    def _note(self, now: float) -> None:
        step, phase, world, gpus = self._job_state(now)
        last = self.pieces[-1] if self.pieces else None
        if last is not None and (last.step, last.phase, last.world, last.gpus) == (step, phase, world, gpus):
            return
        if last is not None and now < last.start:
            now = last.start  # clocks of two nodes interleave: time never runs backwards here
        if step is not None and step != self._last_step:
            if self._last_step is not None and step < self._last_step:
                back = self._recent_restore(now)
                to = back if back is not None and back < step else step  # a node is back further than the top shows
                self._restore = None
                self.rollbacks.append(Rollback(now, self._last_step, to))
            self._last_step = step
            self._stretch = self._base + len(self.pieces)
        self._learn_pace(now, step, phase, world)
        self.pieces.append(Piece(now, step, phase, world, gpus))
        self._cache = None
        if len(self.pieces) > self.max_pieces:
            self._fold(now)
        elif self._stretch - self._resume > _SETTLE_EVERY:
            # A console nobody reads still classifies as it goes, in small bites: the stretches that ended.
            # The one under way is classified when read; settling it here at every piece (thousands of
            # nodes joining at one step) would cost its length each time.
            self._settled(now)

    def _restored_to(self, now: float, step: int) -> None:
        """A trainer's own step went back to ``step``: the restore it made, which the job's top may not show.

        The top is the highest step any live trainer last said, so after a restore to 36 a node whose last
        summary from before it still says 40 holds the top at 40 until it speaks again, by which time the
        others may be at 37: the top goes 40 -> 37, three steps, where four were done twice. The lowest step
        a trainer went back to within STALE_S (the longest a stale summary can hold the top) is the restore.
        """
        back = self._recent_restore(now)
        if back is None or step < back:
            self._restore = (now, step)

    def _recent_restore(self, now: float) -> int | None:
        """The step of the restore noted within STALE_S of ``now``, if any."""
        restore = self._restore
        return restore[1] if restore is not None and now - restore[0] <= STALE_S else None

    def _learn_pace(self, now: float, step: int | None, phase: JobPhase, world: int | None) -> None:
        typ = self._typ
        if step is not None and (typ is None or step != typ[0]):
            if typ is not None and step > typ[0] and typ[2] and now > typ[1]:
                times = self._step_times.setdefault(typ[3], deque(maxlen=_PACE_MEMORY))
                times.append((now - typ[1]) / (step - typ[0]))
                self._typ_version += 1
            typ = (step, now, True, world)
        if typ is not None:
            self._typ = (typ[0], typ[1], typ[2] and phase is JobPhase.TRAINING, world)

    def _typical(self) -> tuple[dict[int | None, float], float] | None:
        if self._typ_cache[0] != self._typ_version:
            per_world = {w: list(t) for w, t in self._step_times.items() if t}
            typical = None
            if per_world:
                overall = statistics.median(x for times in per_world.values() for x in times)
                typical = ({w: statistics.median(t) if len(t) >= _OWN_MEDIAN else overall
                            for w, t in per_world.items()}, overall)
            self._typ_cache = (self._typ_version, typical)
        return self._typ_cache[1]

    def _fold(self, now: float) -> None:
        """Fold the oldest settled stretches into fixed totals and drop their pieces.

        Hours of timeline lie behind the folded ones: a restore reaching back past
        them is not counted as recompute (checkpoints are minutes apart).
        """
        self._settled(now)
        keep = len(self.pieces) - self.max_pieces + self.max_pieces // 5
        cut = 0
        while cut < len(self._closed) and self._closed[cut].next_index - self._base <= keep:
            cut += 1
        if not cut:
            return
        if not self._folded.start:
            self._folded.start = self.pieces[0].start
        for block in self._closed[:cut]:
            self._folded.add(block.amounts)
            for use, seconds in block.amounts.items():
                self._totals[use] -= seconds
        last = self._closed[cut - 1]
        self._folded.end = last.end
        del self.pieces[:last.next_index - self._base]
        self._base, self._base_step = last.next_index, last.next_step
        del self._closed[:cut]
        del self._closed_ends[:cut]
        self._applied = len(self.rollbacks)
        self._cache = None

    # --------------------------------------------------------------- reading

    @property
    def started_at(self) -> float | None:
        """When the first trainer status came."""
        if self._folded.start:
            return self._folded.start
        return self.pieces[0].start if self.pieces else None

    def breakdown(self, window: float | None = None, now: float | None = None) -> Breakdown:
        """Where the time went over the whole run (``window`` None) or its last ``window`` seconds."""
        now = self.clock.now() if now is None else now
        start = self.started_at
        if start is None or now <= start:
            return Breakdown(now, now)
        blocks = self._settled(now)
        lo = start if window is None else max(start, now - window)
        out = Breakdown(lo, now)
        if window is None:
            out.add(self._folded.seconds)
            out.add(self._totals)
            recent = blocks[len(self._closed):]
        else:
            recent = blocks[bisect.bisect_right(self._closed_ends, lo):]
        for block in recent:
            span = block.end - block.start
            if block.end <= lo or span <= 0:
                continue
            out.add(block.amounts, (block.end - max(block.start, lo)) / span)
        return out

    def windows(self, now: float | None = None) -> dict[str, Breakdown]:
        """The run and each rolling window, keyed ``run``, ``1m``, ``5m``, ``15m``."""
        now = self.clock.now() if now is None else now
        out = {"run": self.breakdown(None, now)}
        for seconds in WINDOWS:
            out[f"{seconds / 60:g}m"] = self.breakdown(seconds, now)
        return out

    def ideal_step_s(self, world: int | None = None) -> float | None:
        """The typical step time (median) of ``world`` nodes, or of any world size; None before two steps."""
        typical = self._typical()
        if typical is None:
            return None
        per_world, overall = typical
        return per_world.get(world, overall)

    # ------------------------------------------------------------- incidents

    def cost(self, span: IncidentSpan, now: float | None = None) -> IncidentCost:
        """What ``span`` cost the job: steps redone because of it and GPU-hours lost (its GPUs times lost time)."""
        now = self.clock.now() if now is None else now
        end = span.recovered_at if span.recovered_at is not None else now
        # The restore an incident's plan causes can come after the job already trained past the fault
        # (a peer reported the old step a little longer): a restore soon after is its own, unless
        # another incident began in between.
        later = [s.start for s in self.incidents() if s.id != span.id and s.start > span.start]
        horizon = min([end + ROLLBACK_GRACE_S, *later])
        lost_steps = sum(r.from_step - r.to_step for r in self.rollbacks if span.start <= r.at <= horizon)
        lost = 0.0
        if end > span.start:
            blocks = self._settled(now)
            for block in blocks[max(bisect.bisect_right(self._closed_ends, span.start) - 1, 0):]:
                if block.end <= span.start or block.start >= end or block.end <= block.start:
                    continue
                overlap = min(block.end, end) - max(block.start, span.start)
                unproductive = sum(s for u, s in block.amounts.items()
                                   if u not in (TimeUse.PRODUCTIVE, TimeUse.RECOMPUTE))
                lost += unproductive * overlap / (block.end - block.start)
        ideal = self.ideal_step_s()
        lost += lost_steps * (ideal or 0.0)
        gpus = self._gpus_before(span.start)
        fault = span.fault_at
        detect = None if fault is None else max(span.detected_at - fault, 0.0)
        recover = None if fault is None or span.recovered_at is None else max(span.recovered_at - fault, 0.0)
        return IncidentCost(span.id, detect, recover, lost_steps, lost, gpus * lost / 3600.0)

    def _gpus_before(self, at: float) -> int:
        """GPUs the job trained on just before ``at``."""
        index = bisect.bisect_right([p.start for p in self.pieces], at)
        for piece in reversed(self.pieces[:index]):
            if piece.gpus:
                return piece.gpus
        return max((p.gpus for p in self.pieces), default=0)

    def reliability(self, spans: Iterable[IncidentSpan] | None = None, now: float | None = None) -> Reliability:
        """MTTD, MTTR and MTBF over the run (MTBF: the run's wall time over its incidents)."""
        now = self.clock.now() if now is None else now
        items = list(self.incidents() if spans is None else spans)
        start = self.started_at
        return reliability(items, (now - start) if start is not None else None)

    # -------------------------------------------------------------- classify

    def _settled(self, now: float) -> list[Block]:
        """Every stretch classified: the settled ones (kept) and the one under way (fresh each tick)."""
        total = self._base + len(self.pieces)
        if self._cache is not None and self._cache[0] == now and self._cache[1] == total:
            return self._cache[2]
        spans = list(self.incidents())
        sig = {span.id: (span.start, span.detected_at, span.recovered_at) for span in spans}
        if sig != self._sig:
            changed = [times[0] for key in set(sig) | set(self._sig) if sig.get(key) != self._sig.get(key)
                       for times in (sig.get(key), self._sig.get(key)) if times is not None]
            self._rewind(min(changed))
            self._sig = sig
        windows = Windows(spans, now)
        typical = self._typical()
        self._close(windows, typical)
        # The steps a restore takes back: their productive time was recompute.
        resume_at = self.pieces[self._resume - self._base].start if self._resume < total else now
        while self._applied < len(self.rollbacks) and self.rollbacks[self._applied].at <= resume_at:
            for use, seconds in take_back(self._closed, self.rollbacks[self._applied]).items():
                self._totals[use] += seconds
            self._applied += 1
        blocks = list(self._closed)
        if self._resume < total:
            group = self._group(self._resume, total, now)
            blocks.append(settle(group, 0, self._resume_step, self._resume_step is not None, windows, typical,
                                  pending=True))
        self._cache = (now, total, blocks)
        return blocks

    def _group(self, first: int, stop: int, now: float) -> list[tuple[Piece, float]]:
        pieces = self.pieces[first - self._base:stop - self._base]
        ends = [p.start for p in self.pieces[first - self._base + 1:stop - self._base + 1]]
        ends += [now] * (len(pieces) - len(ends))
        return [(piece, max(end, piece.start)) for piece, end in zip(pieces, ends)]

    def _rewind(self, at: float) -> None:
        """Settled stretches that end after ``at`` are classified again (an incident there changed)."""
        keep = bisect.bisect_right(self._closed_ends, at)
        for block in self._closed[keep:]:
            for use, seconds in block.amounts.items():
                self._totals[use] -= seconds
        del self._closed[keep:]
        del self._closed_ends[keep:]
        if self._closed:
            self._resume, self._resume_step = self._closed[-1].next_index, self._closed[-1].next_step
        else:
            self._resume, self._resume_step = self._base, self._base_step
        restart = self.pieces[self._resume - self._base].start if self._resume - self._base < len(self.pieces) else at
        self._applied = min(self._applied, bisect.bisect_left([r.at for r in self.rollbacks], restart))

    def _close(self, windows: Windows, typical: tuple[dict[int | None, float], float] | None) -> None:
        """Classify each stretch that a change of step has ended since the last read."""
        current = self._resume_step
        start = self._resume
        total = self._base + len(self.pieces)
        for index in range(self._resume, total):
            piece = self.pieces[index - self._base]
            if piece.step is None or piece.step == current:
                continue
            if index > start:
                group = self._group(start, index, piece.start)
                if current is None:
                    block = settle(group, 0, None, False, windows, typical)
                else:
                    block = settle(group, max(piece.step - current, 0), current, True, windows, typical)
                block.next_index, block.next_step = index, piece.step
                self._closed.append(block)
                self._closed_ends.append(block.end)
                for use, seconds in block.amounts.items():
                    self._totals[use] += seconds
            start, current = index, piece.step
        self._resume, self._resume_step = start, current
