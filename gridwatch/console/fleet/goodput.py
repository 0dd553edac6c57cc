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
window. This module holds the uses of time and the records that carry them;
``goodput_tracker`` measures them, from the job's state that ``jobstate``
keeps and the stretches of timeline that ``goodput_settle`` classifies.
Nothing here imports textual.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from enum import StrEnum

from gridwatch.console.fleet.jobstate import JobPhase


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
