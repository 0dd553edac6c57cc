"""The job's state from its trainers' statuses, kept up to date a status at a time, against the same state
recomputed whole from the last status of each node (what the counts must always equal)."""

from __future__ import annotations

import random

import pytest

from gridwatch.console.fleet.jobstate import _PRIORITY, _RANKED, STALE_S, JobPhase, Trainers
from gridwatch.wire.protocol import TrainerPhase, TrainerStatus

PHASES = ("training", "training", "training", "checkpointing", "re-forming", "paused", "gone", "left", "done")


def _whole(reports: dict[str, tuple[float, int | None, str, int | None, int] | None],
           now: float) -> tuple[int | None, JobPhase, int | None, int]:
    live = [r for r in reports.values() if r is not None and now - r[0] <= STALE_S]
    if not live:
        return None, JobPhase.ABSENT, None, 0
    steps = [r[1] for r in live if r[1] is not None]
    top = max(steps) if steps else None
    at_top = {JobPhase(r[2]) if r[2] in set(JobPhase) else JobPhase.UNKNOWN for r in live if r[1] == top}
    if len(at_top) == 1:
        phase = next(iter(at_top))
        phase = phase if phase in _RANKED else JobPhase.UNKNOWN
    else:
        phase = next((p for p in _PRIORITY if p in at_top), JobPhase.UNKNOWN)
    worlds = [r[3] for r in live if r[3] is not None]
    return top, phase, max(worlds) if worlds else None, sum(r[4] for r in live)


@pytest.mark.parametrize("seed", range(5))
def test_the_counts_kept_a_status_at_a_time_equal_the_state_made_whole(seed: int) -> None:
    # Mostly the steady case (a node's step moves on, the rest stands), with phases, worlds and GPUs
    # changing, nodes leaving, falling silent and coming back, and a status heard out of order.
    rng = random.Random(seed)
    trainers = Trainers()
    reports: dict[str, tuple[float, int | None, str, int | None, int] | None] = {}
    steps = {f"n{i}": rng.randrange(5) for i in range(6)}
    now = 1000.0
    for _ in range(3000):
        now += rng.choice((0.1, 0.5, 1.0, 4.0, STALE_S / 2))
        node = rng.choice(sorted(steps))
        steps[node] += rng.choice((0, 1, 1, 3, -2))
        step = None if rng.random() < 0.05 else steps[node]
        phase = rng.choice(PHASES) if rng.random() < 0.2 else "training"
        world = rng.choice((2, 4, None)) if rng.random() < 0.1 else 4
        gpus = rng.choice((4, 8)) if rng.random() < 0.1 else 8
        at = now - (rng.choice((1.0, 20.0)) if rng.random() < 0.05 else 0.0)
        trainers.put(node, at, TrainerStatus(phase=TrainerPhase(phase), step=step, world_size=world), gpus)
        reports[node] = None if phase in ("left", "done") else (at, step, phase, world, gpus)
        assert trainers.state(now) == _whole(reports, now)
