"""The job's state as its trainers report it: the top step, the phase that holds it back, its world size and GPUs."""

from __future__ import annotations

from collections import OrderedDict
from enum import StrEnum
from typing import NamedTuple, TypeVar

from gridwatch.wire.protocol import TrainerStatus

# A trainer silent for this long no longer says what the job is doing.
STALE_S = 15.0


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
_RANKED = frozenset(_PRIORITY)
_GONE = frozenset({"left", "done"})
_K = TypeVar("_K")


# A trainer's phase text to the job phase it names: a lookup, so no enum is built per frame.
_PHASES: dict[str, JobPhase] = {phase.value: phase for phase in JobPhase}


def _phase(text: str) -> JobPhase:
    return _PHASES.get(text, JobPhase.UNKNOWN)


class _Report(NamedTuple):
    """A node's last trainer status, reduced to what the job's state needs (a tuple: made at every status)."""

    at: float
    step: int | None
    phase: JobPhase
    world: int | None
    gpus: int


class Trainers:
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
        said = str(status.phase)
        live, quiet = self._live, self._quiet
        last = self.reports.get(node)
        if last is not None and said not in _GONE and node in live and at >= live[next(reversed(live))].at:
            report = _Report(at, status.step, _phase(said), status.world_size, gpus)
            del live[node]
            live[node] = report  # the newest of all: to the end of the live ones
            self.reports[node] = report
            if report[1:] != last[1:]:  # its step, phase, world or GPUs changed: the counts follow
                self._remove(last)
                self._add(report)
            self.visits += 1
            return
        self.drop(node)
        if said in _GONE:
            self.reports[node] = None
            return
        report = _Report(at, status.step, _phase(said), status.world_size, gpus)
        self.reports[node] = report
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
        if len(phases) == 1:  # the trainers at the top step agree (the common case)
            phase = next(iter(phases))
            if phase not in _RANKED:
                phase = JobPhase.UNKNOWN
        else:
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
