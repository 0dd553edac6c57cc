"""Goodput broken down into named losses: a scripted run whose every second is known, over the run and its windows."""

from __future__ import annotations

import random
from typing import Any

import pytest

from gridwatch.console.fleet.goodput import LOSSES, IncidentSpan, Piece, TimeUse, reliability
from gridwatch.console.fleet.goodput_tracker import GoodputTracker
from gridwatch.console.fleet.jobstate import STALE_S, JobPhase
from gridwatch.playbooks.clock import ManualClock
from gridwatch.wire.protocol import Text, TrainerStatus

GPUS = 8
T0 = 1_700_000_000.0
# The hang of the scripted run: fault at +64 s, incident at +70 s, the job past its step at +94 s.
HANG = IncidentSpan("inc-1", fault_at=T0 + 64, detected_at=T0 + 70, recovered_at=T0 + 94)


def status(phase: str, step: int | None, world: int = 1) -> TrainerStatus:
    return TrainerStatus(job=Text("llama"), phase=Text(phase), step=step, world_size=world)


def scripted_run(spans: list[IncidentSpan] | None = None) -> tuple[GoodputTracker, ManualClock]:
    """One node, one step a second, with each kind of loss at a known time (see the expected breakdown below)."""
    clock = ManualClock(T0)
    known = [HANG] if spans is None else spans
    tracker = GoodputTracker(clock, incidents=lambda: known)

    def at(t: float, phase: str, step: int | None) -> None:
        clock.set(T0 + t)
        tracker.observe("node-1", status(phase, step), GPUS)

    at(0, "starting", None)                       # 10 s start-up
    for k in range(21):
        at(10 + k, "training", k)                 # steps 1..20, one a second
    at(30.5, "checkpointing", 20)                 # a 2 s checkpoint stall inside step 21
    at(32.5, "training", 20)
    for j in range(10):
        at(33 + j, "training", 21 + j)            # steps 21..30
    for j in range(20):
        at(45 + j, "training", 31 + j)            # step 31 takes 3 s (2 s slow), then steps 32..50
    at(75, "re-forming", 50)                      # hung at step 50 since +64 (fault), detected at +70
    at(80, "restarting", 50)                      # 3 s restoring the checkpoint of step 40
    for j in range(16):
        at(83 + j, "training", 40 + j)            # steps 41..50 again (recompute), then 51..55
    tracker.forget("node-1")                      # the node drops out at +98: 5 s with no trainer
    at(103, "joining", 55)                        # 3 s joining
    at(106, "training", 55)
    for j in range(5):
        at(107 + j, "training", 56 + j)           # steps 56..60
    clock.set(T0 + 111.5)                         # half a second into step 61
    return tracker, clock


EXPECTED = {
    TimeUse.STARTUP: 10.0, TimeUse.CHECKPOINT: 2.0, TimeUse.SLOW_STEPS: 2.0, TimeUse.DETECTION: 6.0,
    TimeUse.REFORM: 10.0, TimeUse.RESTORE: 3.0, TimeUse.RECOMPUTE: 10.0, TimeUse.WAITING: 8.0, TimeUse.OTHER: 0.0,
    TimeUse.PRODUCTIVE: 60.5,
}


def test_every_second_of_the_run_is_named_and_they_add_up_to_wall_time() -> None:
    tracker, _clock = scripted_run()
    run = tracker.breakdown()
    assert run.wall_s == pytest.approx(111.5)
    assert sum(run.seconds.values()) == pytest.approx(run.wall_s, rel=0.01)
    for use, seconds in EXPECTED.items():
        assert run.seconds[use] == pytest.approx(seconds, abs=0.01 * run.wall_s), use
    assert run.goodput == pytest.approx(60.5 / 111.5, rel=0.01)
    assert {use for use, _s in run.losses()} == {u for u in LOSSES if EXPECTED[u] > 0}


def test_rolling_windows_cover_only_their_last_minutes_and_add_up_too() -> None:
    tracker, _clock = scripted_run()
    windows = tracker.windows()
    assert set(windows) == {"run", "1m", "5m", "15m"}
    last = windows["1m"]
    assert last.wall_s == pytest.approx(60.0)
    assert sum(last.seconds.values()) == pytest.approx(60.0, rel=0.01)
    # Start-up was 100 s ago: outside the last minute; the hang and its restore are inside it.
    assert last.seconds[TimeUse.STARTUP] == 0.0
    assert last.seconds[TimeUse.DETECTION] == pytest.approx(6.0, abs=0.6)
    assert last.seconds[TimeUse.RESTORE] == pytest.approx(3.0, abs=0.6)
    # The run is shorter than 5 and 15 minutes: those windows are the whole run.
    assert windows["15m"].seconds == pytest.approx(windows["run"].seconds)


def test_a_stall_is_detection_only_once_the_incident_that_explains_it_is_known() -> None:
    spans: list[IncidentSpan] = []
    tracker, _clock = scripted_run(spans)
    before = tracker.breakdown()
    assert before.seconds[TimeUse.DETECTION] == 0.0
    assert before.seconds[TimeUse.OTHER] == pytest.approx(11.0, abs=0.2)  # the hang, unexplained
    spans.append(HANG)  # the incident opens after the stall it explains
    tracker._cache = None
    after = tracker.breakdown()
    assert after.seconds[TimeUse.DETECTION] == pytest.approx(6.0, abs=0.2)
    assert sum(after.seconds.values()) == pytest.approx(after.wall_s, rel=0.01)


def test_the_incident_costs_its_steps_and_gpu_hours_and_the_run_has_mttd_mttr_mtbf() -> None:
    tracker, clock = scripted_run()
    cost = tracker.cost(HANG)
    assert (cost.detect_s, cost.recover_s, cost.steps_lost) == (6.0, 30.0, 10)
    # Detection 6 + re-forming 10 + restore 3 while it lasted, plus the 10 steps done twice at 1 s each.
    assert cost.lost_s == pytest.approx(29.0, rel=0.01)
    assert cost.gpu_hours_lost == pytest.approx(GPUS * 29.0 / 3600, rel=0.01)
    second = IncidentSpan("inc-2", fault_at=T0 + 100, detected_at=T0 + 102, recovered_at=None)
    rel = reliability([HANG, second], wall_s=111.5)
    assert (rel.incidents, rel.mttd_s, rel.mttr_s) == (2, 4.0, 30.0)
    assert rel.mtbf_s == pytest.approx(111.5 / 2)
    assert tracker.reliability(now=clock.now()).mttd_s == 6.0


@pytest.mark.parametrize("second_says", [37, 36])
def test_a_restore_counts_every_step_done_twice_though_a_stale_summary_held_the_top_up(second_says: int) -> None:
    # Two nodes at step 40, one a second; the job restores step 36. node-1 says 36 first while node-3's last
    # summary, from before the restore, still says 40; by node-3's next one the job is at 37 (or still at 36).
    clock = ManualClock(T0)
    span = IncidentSpan("inc-1", fault_at=T0 + 40.5, detected_at=T0 + 41, recovered_at=None)
    tracker = GoodputTracker(clock, incidents=lambda: [span])

    def say(t: float, node: str, step: int) -> None:
        clock.set(T0 + t)
        tracker.observe(node, status("training", step, world=2), GPUS)

    for k in range(41):
        say(k, "node-1", k)
        say(k + 0.5, "node-3", k)
    say(45, "node-1", 36)
    assert tracker.rollbacks == []  # node-3's 40 holds the job's top
    say(46.5, "node-3", second_says)
    assert [(r.from_step, r.to_step) for r in tracker.rollbacks] == [(40, 36)]
    assert tracker.cost(span).steps_lost == 4  # steps 37..40, done twice
    # A node that went back long before is not the next rollback's restore.
    for k in range(37, 80):
        say(k + 10, "node-1", k)
        say(k + 10.5, "node-3", k)
    say(100, "node-1", 70)
    say(100 + STALE_S + 1, "node-3", 75)
    say(100 + STALE_S + 2, "node-1", 76)
    assert [(r.from_step, r.to_step) for r in tracker.rollbacks][1:] == [(79, 75)]


def test_a_console_with_no_trainer_has_no_goodput_and_a_long_run_stays_bounded() -> None:
    clock = ManualClock(T0)
    tracker = GoodputTracker(clock, max_pieces=200)
    assert tracker.breakdown().goodput is None
    for k in range(1000):
        clock.set(T0 + k)
        tracker.observe("node-1", status("training", k), GPUS)
    clock.set(T0 + 1000)
    run = tracker.breakdown()
    assert len(tracker.pieces) <= 200
    assert sum(run.seconds.values()) == pytest.approx(run.wall_s, rel=0.01)
    assert run.goodput == pytest.approx(1.0, abs=0.01)


def test_reading_as_the_run_goes_gives_the_same_breakdown_as_reading_once_at_the_end() -> None:
    # Read at every frame, the incident opening while the job hangs; against one read at the end.
    spans: list[IncidentSpan] = []
    original = GoodputTracker.observe

    def observe_and_read(self: GoodputTracker, node: str, status: TrainerStatus, gpus: int = 0,
                         at: float | None = None) -> None:
        original(self, node, status, gpus, at)
        if self.clock.now() >= T0 + 72 and not spans:
            spans.append(HANG)  # opened while the job hangs, as the console does
        self.windows()  # every frame read, as a busy screen would

    GoodputTracker.observe = observe_and_read  # type: ignore[method-assign]
    try:
        read_live, _ = scripted_run(spans)
    finally:
        GoodputTracker.observe = original  # type: ignore[method-assign]
    once, _ = scripted_run()
    assert read_live.breakdown().seconds == pytest.approx(once.breakdown().seconds, abs=1e-6)


def test_a_node_starting_behind_a_job_that_trains_on_costs_nothing() -> None:
    clock = ManualClock(T0)
    tracker = GoodputTracker(clock)
    for k in range(31):
        clock.set(T0 + k)
        tracker.observe("node-1", status("training", k, world=2), GPUS)
        # node-2's worker was restarted: it starts, then joins, with no step of its own yet.
        tracker.observe("node-2", status("starting" if k < 20 else "joining", None), GPUS)
    run = tracker.breakdown()
    assert run.goodput == pytest.approx(1.0)
    assert run.seconds[TimeUse.STARTUP] == 0.0 and run.seconds[TimeUse.WAITING] == 0.0


# ------------------------------------------------- the job's state, kept as statuses come


class WalkEveryNode:
    """The job's state computed the first way: every node's last status walked at every status (O(nodes))."""

    PRIORITY = (JobPhase.RESTARTING, JobPhase.REFORMING, JobPhase.CHECKPOINTING, JobPhase.STARTING,
                JobPhase.JOINING, JobPhase.PAUSED, JobPhase.TRAINING, JobPhase.UNKNOWN)

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[float, TrainerStatus, int]] = {}

    def state(self, now: float) -> tuple[int | None, JobPhase, int | None, int]:
        live = [(s, g) for at, s, g in self.nodes.values() if now - at <= STALE_S and str(s.phase) not in ("left", "done")]
        if not live:
            return None, JobPhase.ABSENT, None, 0
        steps = [s.step for s, _ in live if s.step is not None]
        top = max(steps) if steps else None
        leading = [s for s, _ in live if s.step == top] if top is not None else [s for s, _ in live]
        phases = set()
        for s in leading:
            try:
                phases.add(JobPhase(str(s.phase)))
            except ValueError:
                phases.add(JobPhase.UNKNOWN)
        phase = next((p for p in self.PRIORITY if p in phases), JobPhase.UNKNOWN)
        worlds = [s.world_size for s, _ in live if s.world_size is not None]
        return top, phase, (max(worlds) if worlds else None), sum(g for _, g in live)


def job_state(piece: Piece) -> tuple[int | None, JobPhase, int | None, int]:
    return piece.step, piece.phase, piece.world, piece.gpus


def test_the_job_state_kept_as_statuses_come_is_the_state_of_walking_every_node() -> None:
    # Random runs of statuses and departures: times on a half-second grid (so a node is often exactly
    # STALE_S old), gaps past STALE_S, explicit times out of order and ahead of the clock, every phase.
    phases = [*(p.value for p in JobPhase), "left", "done", "warming-up"]
    for seed in range(60):
        rng = random.Random(seed)
        clock = ManualClock(T0)
        tracker = GoodputTracker(clock)
        reference = WalkEveryNode()
        names = [f"node-{i}" for i in range(rng.randint(1, 10))]
        now = T0
        for op in range(300):
            now += rng.choice([0.0, 0.5, 0.5, 1.0, 2.5, STALE_S, STALE_S + 0.5, 40.0])
            clock.set(now)
            at = rng.choice([None, None, now, now - 0.5, now - 3.0, now - STALE_S, now - STALE_S - 0.5,
                             now - 30.0, now + 2.0])
            when = now if at is None else at
            node = rng.choice(names)
            where = f"seed {seed}, op {op}"
            if rng.random() < 0.15:
                known = node in reference.nodes
                reference.nodes.pop(node, None)
                before = len(tracker.pieces)
                tracker.forget(node, at)
                if not known:
                    assert len(tracker.pieces) == before, where
                    continue
            else:
                step = rng.choice([None, *range(max(op // 20 - 2, 0), op // 20 + 2)])
                world = rng.choice([None, 1, 2, 4, 8])
                trainer = TrainerStatus(job=Text("llama"), phase=Text(rng.choice(phases)), step=step,
                                        world_size=world)
                gpus = rng.choice([0, 4, 8])
                reference.nodes[node] = (when, trainer, gpus)
                tracker.observe(node, trainer, gpus, at)
            assert job_state(tracker.pieces[-1]) == reference.state(when), where
            probe = when + rng.choice([-40.0, -STALE_S, -1.0, 0.0, 0.5, STALE_S, STALE_S + 0.5])
            assert tracker._job_state(probe) == reference.state(probe), f"{where}, probe {probe - T0}"


def test_five_thousand_trainers_cost_the_same_few_entries_a_status_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each status moves its node's old entry out and its new one in; a node falling silent is moved once.
    # Nodes joining at one step change the job's GPUs at every status: the timeline is not classified each time.
    nodes = 5000
    clock = ManualClock(T0)
    tracker = GoodputTracker(clock)
    settles = 0
    settled = GoodputTracker._settled

    def counted(self: GoodputTracker, now: float) -> list[Any]:
        nonlocal settles
        settles += 1
        return settled(self, now)

    monkeypatch.setattr(GoodputTracker, "_settled", counted)
    reference = WalkEveryNode()
    names = [f"node-{k:04d}" for k in range(nodes)]
    for step in range(3):
        for k, name in enumerate(names):
            clock.set(T0 + step + k / nodes)
            trainer = status("training", step, world=nodes)
            tracker.observe(name, trainer, GPUS)
            reference.nodes[name] = (clock.now(), trainer, GPUS)
    assert job_state(tracker.pieces[-1]) == (2, JobPhase.TRAINING, nodes, nodes * GPUS)
    assert tracker._trainers.visits <= 4 * 3 * nodes
    # Half the nodes fall silent; the others go on, and the job's GPUs drop once the silent ones are stale.
    for k, name in enumerate(names[: nodes // 2]):
        clock.set(T0 + 3 + STALE_S + k / nodes)
        trainer = status("training", 3, world=nodes // 2)
        tracker.observe(name, trainer, GPUS)
        reference.nodes[name] = (clock.now(), trainer, GPUS)
    assert job_state(tracker.pieces[-1]) == reference.state(clock.now())
    assert tracker.pieces[-1].gpus == nodes // 2 * GPUS
    assert tracker._trainers.visits <= 4 * 3 * nodes + 4 * (nodes // 2) + 2 * nodes
    assert settles <= 2
