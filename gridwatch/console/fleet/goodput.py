"""Where the run's time went: goodput and its named losses, from the trainer phases, steps and incidents the console sees.

The losses follow Google's ML goodput taxonomy (the ``ml-goodput-measurement``
package's ``BadputType``), in a GPU job's words:

=================  ==========================================================
``detection``      from a fault until the console opened its incident
                   (part of ``INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION``)
``reform``         from the incident until the job trains again: acting,
                   re-forming the group (the rest of that category)
``recompute``      steps done again after a restore: the time first spent on
                   them (``WASTED_PROGRESS_FROM_DISRUPTION``)
``checkpoint``     training stalled while a checkpoint is taken
                   (``UNPRODUCTIVE_CHECKPOINT_SAVE_TIME``)
``restore``        loading a checkpoint (``UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME``)
``waiting``        no trainer of the job ready: nodes joining, none running
``startup``        before the first step (``PROGRAM_STARTUP``, ``TRAINING_PREP``)
``slow_steps``     steps slower than the typical step of their world size
                   (the package's step-time deviation)
``other``          what none of the above explains (``OTHER``)
=================  ==========================================================

Productive time is the typical step time of each step kept. Productive time
and the losses add up to wall time exactly, over the run and over every
window. The tracker is fed one trainer status at a time (O(1): the job's state
is kept up to date as trainers come, change and fall silent); a breakdown
is computed on demand from the compact timeline it keeps (one piece per
change of the job's step or phase), with the incidents known by then, since
an incident is often opened after the stall it explains. Time comes from an
injected clock; nothing here imports textual.
"""

from __future__ import annotations

import bisect
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

from gridwatch.playbooks.clock import Clock, SystemClock
from gridwatch.wire.protocol import TrainerStatus


class TimeUse(StrEnum):
    """What a second of the run was spent on: productive training or one named loss."""

    PRODUCTIVE = "productive"
    DETECTION = "detection"
    REFORM = "reform"
    RECOMPUTE = "recompute"
    CHECKPOINT = "checkpoint"
    RESTORE = "restore"
    WAITING = "waiting"
    STARTUP = "startup"
    SLOW_STEPS = "slow_steps"
    OTHER = "other"


LOSSES: tuple[TimeUse, ...] = tuple(u for u in TimeUse if u is not TimeUse.PRODUCTIVE)
# What each use is called on screen and in the summary.
LABELS: dict[TimeUse, str] = {
    TimeUse.PRODUCTIVE: "productive", TimeUse.DETECTION: "detection", TimeUse.REFORM: "re-forming",
    TimeUse.RECOMPUTE: "recompute", TimeUse.CHECKPOINT: "checkpoint save", TimeUse.RESTORE: "restore",
    TimeUse.WAITING: "waiting for nodes", TimeUse.STARTUP: "start-up", TimeUse.SLOW_STEPS: "slow steps",
    TimeUse.OTHER: "other",
}
# Rolling windows every breakdown is also given over, in seconds.
WINDOWS: tuple[float, ...] = (60.0, 300.0, 900.0)
# A trainer silent for this long no longer says what the job is doing.
STALE_S = 15.0
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
# An unfinished step counts as productive for up to this many typical steps (it may still finish).
_PENDING_STEPS = 3.0


class JobPhase(StrEnum):
    """The job's phase, as the most telling of its trainers reports it."""

    TRAINING = "training"
    CHECKPOINTING = "checkpointing"
    RESTARTING = "restarting"  # loading a checkpoint
    REFORMING = "re-forming"
    JOINING = "joining"
    STARTING = "starting"
    PAUSED = "paused"
    ABSENT = "absent"  # no trainer of the job reports (all restarting, or gone)
    UNKNOWN = "unknown"


# When the trainers at the job's step disagree, the phase that holds the job back wins.
_PRIORITY: tuple[JobPhase, ...] = (JobPhase.RESTARTING, JobPhase.REFORMING, JobPhase.CHECKPOINTING,
                                   JobPhase.STARTING, JobPhase.JOINING, JobPhase.PAUSED, JobPhase.TRAINING,
                                   JobPhase.UNKNOWN)
_BY_PHASE: dict[JobPhase, TimeUse] = {
    JobPhase.CHECKPOINTING: TimeUse.CHECKPOINT, JobPhase.RESTARTING: TimeUse.RESTORE,
    JobPhase.REFORMING: TimeUse.REFORM, JobPhase.JOINING: TimeUse.WAITING, JobPhase.STARTING: TimeUse.STARTUP,
}
_GONE = frozenset({"left", "done"})
_K = TypeVar("_K")


@dataclass(frozen=True, slots=True)
class IncidentSpan:
    """An incident's times: the fault, the console's detection, the job training past it (None: not yet)."""

    id: str
    fault_at: float | None
    detected_at: float
    recovered_at: float | None = None

    @property
    def start(self) -> float:
        return self.fault_at if self.fault_at is not None and self.fault_at <= self.detected_at else self.detected_at


@dataclass(frozen=True, slots=True)
class Piece:
    """A stretch of the job's timeline with one step, phase and world size; ``start`` to the next piece's."""

    start: float
    step: int | None
    phase: JobPhase
    world: int | None
    gpus: int = 0  # GPUs of the nodes training the job then


@dataclass(frozen=True, slots=True)
class Rollback:
    """The job went back from ``from_step`` to ``to_step`` at ``at`` (a restore): the steps between are redone."""

    at: float
    from_step: int
    to_step: int


@dataclass(slots=True)
class Breakdown:
    """Seconds per use over ``[start, end]``; they add up to ``wall_s``."""

    start: float
    end: float
    seconds: dict[TimeUse, float] = field(default_factory=lambda: dict.fromkeys(TimeUse, 0.0))

    @property
    def wall_s(self) -> float:
        return max(self.end - self.start, 0.0)

    @property
    def goodput(self) -> float | None:
        """Productive time over wall time; None before any time has passed."""
        wall = self.wall_s
        return None if wall <= 0 else self.seconds[TimeUse.PRODUCTIVE] / wall

    def share(self, use: TimeUse) -> float:
        wall = self.wall_s
        return 0.0 if wall <= 0 else self.seconds[use] / wall

    def losses(self) -> list[tuple[TimeUse, float]]:
        """The losses with time in them, largest first."""
        return sorted(((u, s) for u, s in self.seconds.items() if u is not TimeUse.PRODUCTIVE and s > 0),
                      key=lambda item: -item[1])

    def add(self, amounts: dict[TimeUse, float], fraction: float = 1.0) -> None:
        for use, seconds in amounts.items():
            self.seconds[use] += seconds * fraction


@dataclass(frozen=True, slots=True)
class IncidentCost:
    """What one incident cost: its times, the steps done again because of it, and the GPU time lost."""

    id: str
    detect_s: float | None
    recover_s: float | None
    steps_lost: int
    lost_s: float  # the job's unproductive time in the incident plus the first run of its lost steps
    gpu_hours_lost: float


@dataclass(frozen=True, slots=True)
class Reliability:
    """Per run: mean time to detect, to recover, and between failures (None where there is nothing to average)."""

    incidents: int
    mttd_s: float | None
    mttr_s: float | None
    mtbf_s: float | None


@dataclass(slots=True)
class _Block:
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
        self._trainers = _Trainers()  # every node's last status, and the job's state they make
        self._last_step: int | None = None
        self._folded = Breakdown(0.0, 0.0)  # stretches dropped for memory, already classified
        self._base = 0  # absolute index of pieces[0]
        self._base_step: int | None = None  # the step known at it
        self._closed: list[_Block] = []  # settled stretches, oldest first
        self._closed_ends: list[float] = []
        self._totals = dict.fromkeys(TimeUse, 0.0)  # over self._closed
        self._resume = 0  # absolute index of the first piece of the stretch under way
        self._stretch = 0  # absolute index of the piece that began the newest stretch (its step changed)
        self._resume_step: int | None = None
        self._applied = 0  # rollbacks already taken back from the settled stretches
        self._sig: dict[str, tuple[float, float, float | None]] = {}
        self._cache: tuple[float, int, list[_Block]] | None = None
        # Typical step times per world size (recent ones), from stretches of pure training.
        self._step_times: dict[int | None, deque[float]] = {}
        self._typ: tuple[int, float, bool, int | None] | None = None  # step, since, clean, world
        self._typ_version = 0
        self._typ_cache: tuple[int, tuple[dict[int | None, float], float] | None] = (-1, None)

    # ----------------------------------------------------------------- feeding

    def observe(self, node: str, status: TrainerStatus, gpus: int = 0, at: float | None = None) -> None:
        """One trainer status from ``node`` (with its GPU count); O(1), plus a piece when the job's state changed."""
        now = self.clock.now() if at is None else at
        self._trainers.put(node, now, status, gpus)
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
                self.rollbacks.append(Rollback(now, self._last_step, step))
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

    def _settled(self, now: float) -> list[_Block]:
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
        windows = _Windows(spans, now)
        typical = self._typical()
        self._close(windows, typical)
        # The steps a restore takes back: their productive time was recompute.
        resume_at = self.pieces[self._resume - self._base].start if self._resume < total else now
        while self._applied < len(self.rollbacks) and self.rollbacks[self._applied].at <= resume_at:
            for use, seconds in _take_back(self._closed, self.rollbacks[self._applied]).items():
                self._totals[use] += seconds
            self._applied += 1
        blocks = list(self._closed)
        if self._resume < total:
            group = self._group(self._resume, total, now)
            blocks.append(_settle(group, 0, self._resume_step, self._resume_step is not None, windows, typical,
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

    def _close(self, windows: _Windows, typical: tuple[dict[int | None, float], float] | None) -> None:
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
                    block = _settle(group, 0, None, False, windows, typical)
                else:
                    block = _settle(group, max(piece.step - current, 0), current, True, windows, typical)
                block.next_index, block.next_step = index, piece.step
                self._closed.append(block)
                self._closed_ends.append(block.end)
                for use, seconds in block.amounts.items():
                    self._totals[use] += seconds
            start, current = index, piece.step
        self._resume, self._resume_step = start, current


def reliability(spans: list[IncidentSpan], wall_s: float | None) -> Reliability:
    """MTTD and MTTR as the mean over incidents whose times are known; MTBF as wall time over incidents."""
    detects = [s.detected_at - s.fault_at for s in spans if s.fault_at is not None]
    recovers = [s.recovered_at - s.fault_at for s in spans if s.fault_at is not None and s.recovered_at is not None]
    return Reliability(
        incidents=len(spans),
        mttd_s=statistics.fmean(max(d, 0.0) for d in detects) if detects else None,
        mttr_s=statistics.fmean(max(r, 0.0) for r in recovers) if recovers else None,
        mtbf_s=(wall_s / len(spans)) if spans and wall_s else None,
    )


# A trainer's phase text to the job phase it names: a lookup, so no enum is built per frame.
_PHASES: dict[str, JobPhase] = {phase.value: phase for phase in JobPhase}


def _phase(text: str) -> JobPhase:
    return _PHASES.get(text, JobPhase.UNKNOWN)


@dataclass(frozen=True, slots=True)
class _Report:
    """A node's last trainer status, reduced to what the job's state needs."""

    at: float
    step: int | None
    phase: JobPhase
    world: int | None
    gpus: int


class _Trainers:
    """The job's trainers by their last status, and the job's state they make, kept up to date in O(1) a status.

    A trainer is live while heard within ``STALE_S`` of the time the state is
    asked for and not left or done. Live trainers are counted by step, by phase
    at each step and by world size, and their GPUs summed; the top step and the
    largest world are recomputed (over their distinct values) only when their
    last holder leaves. Live and silent trainers are each kept in order of when
    they were heard, the silent ones all earlier, so one falls silent (or, when
    an earlier time is asked for, counts again) by crossing the boundary
    between the two: each status moves only the trainers that cross it.
    """

    def __init__(self) -> None:
        self.reports: dict[str, _Report | None] = {}  # node -> its last status (None: left or done)
        self._live: OrderedDict[str, _Report] = OrderedDict()  # heard recently, oldest first
        self._quiet: OrderedDict[str, _Report] = OrderedDict()  # silent too long, oldest first
        self._count = 0
        self._gpus = 0
        self._steps: dict[int, int] = {}  # step -> live trainers at it
        self._phases: dict[int | None, dict[JobPhase, int]] = {}  # step -> phase -> live trainers
        self._worlds: dict[int, int] = {}  # world size -> live trainers reporting it
        self._top: int | None = None
        self._world: int | None = None
        self.visits = 0  # trainer entries added, removed or moved: the work the statuses cost

    def put(self, node: str, at: float, status: TrainerStatus, gpus: int) -> None:
        """``node``'s status, heard at ``at``, replaces its last one."""
        self.drop(node)
        if str(status.phase) in _GONE:
            self.reports[node] = None
            return
        report = _Report(at, status.step, _phase(str(status.phase)), status.world_size, gpus)
        self.reports[node] = report
        live, quiet = self._live, self._quiet
        # Usually the newest of all: appended at the end. Times passed out of order are put in their place.
        if live and at >= live[next(iter(live))].at:
            _insert(live, node, report)
            self._add(report)
        else:
            _insert(quiet, node, report)  # the boundary is judged again when the state is asked for
        self.visits += 1

    def drop(self, node: str) -> bool:
        """Forget ``node``'s last status; False if it had none."""
        if node not in self.reports:
            return False
        report = self.reports.pop(node)
        if report is not None:
            if self._live.pop(node, None) is not None:
                self._remove(report)
            else:
                del self._quiet[node]
            self.visits += 1
        return True

    def state(self, now: float) -> tuple[int | None, JobPhase, int | None, int]:
        """The job at ``now``: its top step, the phase of the trainers at it, its largest world and its GPUs."""
        self._judge(now)
        if not self._count:
            return None, JobPhase.ABSENT, None, 0
        # The trainers at the job's step carry it: one node starting or joining behind them holds nothing back.
        # With no step yet, every live trainer is at step None.
        phases = self._phases[self._top]
        phase = next((p for p in _PRIORITY if p in phases), JobPhase.UNKNOWN)
        return self._top, phase, self._world, self._gpus

    def _judge(self, now: float) -> None:
        """Move the trainers that fell silent by ``now`` out of the live ones, and those heard again back in."""
        live, quiet = self._live, self._quiet
        while live:
            node = next(iter(live))
            report = live[node]
            if now - report.at <= STALE_S:
                break
            del live[node]
            quiet[node] = report
            self._remove(report)
        while quiet:
            node = next(reversed(quiet))
            report = quiet[node]
            if now - report.at > STALE_S:
                break
            del quiet[node]
            live[node] = report
            live.move_to_end(node, last=False)
            self._add(report)

    def _add(self, report: _Report) -> None:
        self.visits += 1
        self._count += 1
        self._gpus += report.gpus
        step, world = report.step, report.world
        if step is not None:
            self._steps[step] = self._steps.get(step, 0) + 1
            if self._top is None or step > self._top:
                self._top = step
        at_step = self._phases.setdefault(step, {})
        at_step[report.phase] = at_step.get(report.phase, 0) + 1
        if world is not None:
            self._worlds[world] = self._worlds.get(world, 0) + 1
            if self._world is None or world > self._world:
                self._world = world

    def _remove(self, report: _Report) -> None:
        self.visits += 1
        self._count -= 1
        self._gpus -= report.gpus
        step, world = report.step, report.world
        if step is not None:
            if _decrement(self._steps, step) and step == self._top:
                self._top = max(self._steps, default=None)
        at_step = self._phases[step]
        if _decrement(at_step, report.phase) and not at_step:
            del self._phases[step]
        if world is not None:
            if _decrement(self._worlds, world) and world == self._world:
                self._world = max(self._worlds, default=None)


def _insert(order: OrderedDict[str, _Report], node: str, report: _Report) -> None:
    """Put ``node`` into ``order`` (oldest first) after every entry heard no later than it."""
    later: list[tuple[str, _Report]] = []
    while order and order[next(reversed(order))].at > report.at:
        later.append(order.popitem())
    order[node] = report
    for key, value in reversed(later):
        order[key] = value


def _decrement(counts: dict[_K, int], key: _K) -> bool:
    """One fewer of ``key``; True when none is left (the key is gone)."""
    left = counts[key] - 1
    if left:
        counts[key] = left
        return False
    del counts[key]
    return True


class _Windows:
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


def _settle(group: list[tuple[Piece, float]], forward: int, from_step: int | None, seen_step: bool,
            windows: _Windows, typical: tuple[dict[int | None, float], float] | None,
            pending: bool = False) -> _Block:
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
    block = _Block(start, stop, amounts)
    if forward and from_step is not None:
        block.first_step, block.last_step = from_step, from_step + forward
    return block


def _take_back(history: list[_Block], rollback: Rollback) -> dict[TimeUse, float]:
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
