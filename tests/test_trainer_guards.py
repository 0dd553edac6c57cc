"""Loop guards and the sampler: bad losses, stragglers, a frozen peer's deadline, world-size-free batches."""

from __future__ import annotations

import torch

from gridwatch.trainer.guards import LossGuard, ProgressDeadline, StragglerGuard
from gridwatch.trainer.sampler import BatchSampler, my_slots


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_loss_guard_flags_nan_and_spikes_but_not_a_falling_loss() -> None:
    guard = LossGuard(factor=3.0, warmup=3)
    assert [guard.check(x) for x in (5.0, 4.8, 4.6, 4.4)] == [None] * 4
    assert guard.check(float("nan")) == "nan_loss"
    assert guard.check(float("inf")) == "nan_loss"
    assert guard.check(20.0) == "loss_spike"
    assert guard.check(4.3) is None


def test_straggler_guard_names_the_slow_rank() -> None:
    guard = StragglerGuard(factor=3.0, warmup=2)
    for _ in range(3):
        assert guard.check([0.1, 0.1]) == []
    assert guard.check([0.1, 0.9]) == [1]
    assert guard.check([0.1, 0.11]) == []


def test_progress_deadline_fires_once_without_sleeping() -> None:
    clock = FakeClock()
    fired: list[float] = []
    deadline = ProgressDeadline(10.0, fired.append, clock)
    clock.now += 9
    assert not deadline.check()
    deadline.feed()
    clock.now += 9
    assert not deadline.check() and fired == []
    clock.now += 2
    assert deadline.check() and fired == [11.0]
    clock.now += 50
    assert not deadline.check() and len(fired) == 1


def test_global_batch_is_the_same_for_any_world_size() -> None:
    data = torch.arange(10_000, dtype=torch.int64) % 256
    a = BatchSampler(data.to(torch.uint8), seq_len=16, micro_batch=4, micro_batches=6, seed=3)
    b = BatchSampler(data.to(torch.uint8), seq_len=16, micro_batch=4, micro_batches=6, seed=3)
    for _ in range(200):  # crosses epoch boundaries
        ga, gb = a.next_global_batch(), b.next_global_batch()
        assert all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))
    assert a.state.epoch >= 1
    for world in (1, 2, 3, 4):
        slots = [s for r in range(world) for s in my_slots(r, world, 6)]
        assert sorted(slots) == list(range(6)), "every micro-batch computed exactly once"


def test_a_slow_node_is_told_once_per_episode_and_one_off_slow_steps_never() -> None:
    from gridwatch.trainer.guards import StragglerEpisodes

    clock = FakeClock()
    episodes = StragglerEpisodes(clock, min_flags=5, min_span_s=120.0, rest_steps=50)
    told = []
    # One-off slow steps minutes apart (a GC pause, a checkpoint, a busy machine): never an episode.
    for step in range(0, 600):
        clock.now += 1.0
        told += episodes.update(step, {"node4": 3.5} if step % 97 == 0 else {})
    assert told == []
    # node2 slow on most steps for minutes: told once, when the slowness has lasted two minutes.
    for step in range(600, 900):
        clock.now += 1.0
        told += episodes.update(step, {"node2": 4.0} if step % 3 else {})
    assert [(e.node, e.told) for e in told] == [("node2", True)]
    assert 120.0 <= told[0].span_s < 125.0 and told[0].flagged >= 5 and told[0].ratio == 4.0
    # At pace for a while, then slow again: a new episode, told again.
    for step in range(900, 960):
        clock.now += 1.0
        told += episodes.update(step, {})
    for step in range(960, 1200):
        clock.now += 1.0
        told += episodes.update(step, {"node2": 4.0})
    assert [e.node for e in told] == ["node2", "node2"]
