"""Who was heard from longest ago, read from the front: the silence checks' one order."""

from __future__ import annotations

from gridwatch.wire.heard import HeardOrder


def test_the_quiet_are_those_heard_before_the_floor_oldest_first() -> None:
    order: HeardOrder[str, str] = HeardOrder()
    for i, name in enumerate(["a", "b", "c", "d"]):
        order.heard(name, name.upper(), 100.0 + i)
    order.heard("b", "B", 110.0)  # heard again: to the end
    assert order.quiet(110.0, 7.5) == ["A", "C"]
    assert order.oldest() == (100.0, "A")
    assert order.quiet(110.0, 20.0) == [] and len(order) == 4


def test_a_time_earlier_than_the_newest_keeps_the_order_exact() -> None:
    """A clock that ran back (a replay, a test) puts a node behind ones heard later than it: it is still found."""
    order: HeardOrder[str, int] = HeardOrder()
    order.heard("a", 1, 100.0)
    order.heard("b", 2, 101.0)
    order.heard("c", 3, 50.0)
    assert order.quiet(102.0, 1.5) == [3, 1]
    assert order.oldest() == (50.0, 3)
    order.heard("c", 3, 103.0)
    assert order.quiet(104.0, 2.5) == [1, 2]


def test_an_empty_order_has_no_oldest() -> None:
    assert HeardOrder[str, int]().oldest() is None


def test_the_shortest_interval_follows_each_keys_latest() -> None:
    order: HeardOrder[str, str] = HeardOrder()
    assert order.shortest(1.0) == 1.0 and not order.counted("a")  # none given: the caller's default
    order.every("a", 5.0)
    order.every("b", 5.0)
    order.every("c", 2.0)
    assert order.shortest(1.0) == 2.0 and order.counted("c")
    order.every("c", 5.0)  # back on summaries
    assert order.shortest(1.0) == 5.0
    order.every("a", 0.5)
    order.every("a", 0.5)  # said twice: counted once
    order.every("a", 5.0)
    assert order.shortest(1.0) == 5.0
