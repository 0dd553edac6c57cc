"""The console's collector baseline: long-lived objects frozen, and what a dropped link leaves freed at the next baseline."""

from __future__ import annotations

import gc
import weakref

from gridwatch.console.runtime.collector import CollectorBaseline


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _counting(links: int, clock: _Clock) -> tuple[CollectorBaseline, list[str]]:
    calls: list[str] = []
    baseline = CollectorBaseline(clock=clock, links=links, unfreeze=lambda: calls.append("unfreeze"),
                                 collect=lambda: calls.append("collect") or 0, freeze=lambda: calls.append("freeze"))
    return baseline, calls


def test_a_tenth_of_the_links_coming_up_takes_a_new_baseline_at_most_once_per_gap() -> None:
    clock = _Clock()
    baseline, calls = _counting(2500, clock)
    baseline.settled()  # every link tried once
    assert calls == ["collect", "freeze"] and baseline.baselines == 1  # what is not frozen yet: no full walk
    for _ in range(249):
        baseline.link_up()
    assert baseline.baselines == 1  # 249 of 2,500 came up: not yet a tenth
    baseline.link_up()
    assert baseline.baselines == 1  # a tenth, but within 5 s of the last baseline: held back
    clock.t += 5.0
    baseline.tick()
    assert baseline.baselines == 2 and baseline.ups == 0
    baseline.tick()
    assert baseline.baselines == 2  # nothing asked since


def test_a_small_fleet_needs_fifty_links_up_before_another_baseline() -> None:
    clock = _Clock()
    baseline, _ = _counting(100, clock)
    for _ in range(49):
        baseline.link_up()
    assert baseline.baselines == 0
    baseline.link_up()
    assert baseline.baselines == 1


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_a_whole_fleet_of_reconnects_takes_the_baseline_afresh() -> None:
    clock = _Clock()
    baseline, calls = _counting(100, clock)
    for _ in range(2):  # two baselines of 50 ups: 100 links came up, as many as the console holds
        for _ in range(50):
            baseline.link_up()
        clock.t += 5
        baseline.tick()
    assert calls == ["collect", "freeze", "unfreeze", "collect", "freeze"] and baseline.fresh == 1


def test_what_was_frozen_and_died_is_freed_once_a_fleet_of_links_came_up_again() -> None:
    clock = _Clock()
    baseline = CollectorBaseline(clock=clock, links=10)
    try:
        node = _Node()
        gone = weakref.ref(node)
        baseline.settled()  # node is alive: frozen with the rest
        del node
        gc.collect()
        assert gone() is not None  # frozen: a full collection does not see it
        clock.t += 60
        for _ in range(50):  # the links flapped: as many came up again as the console holds (and the minimum)
            baseline.link_up()
        assert baseline.fresh == 1 and gone() is None  # unfrozen, collected, and the rest frozen again
    finally:
        gc.unfreeze()
