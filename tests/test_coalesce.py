"""The loop that reads many links together: sockets that become readable close together are read in one pass,
timers are never late for it, a busy loop never naps, and a bad setting is refused in one line."""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading

import pytest

from gridwatch.sshlink.coalesce import CoalescingSelector, console_period, read_every


class FakeTime:
    """A clock that only the naps move."""

    def __init__(self) -> None:
        self.now = 100.0
        self.naps: list[float] = []

    def clock(self) -> float:
        return self.now

    def nap(self, seconds: float) -> None:
        self.naps.append(round(seconds, 6))
        self.now += seconds


def test_a_wait_naps_until_the_period_has_passed_since_the_last_wake_and_never_past_a_timer() -> None:
    t = FakeTime()
    sel = CoalescingSelector(0.025, clock=t.clock, nap=t.nap)
    reader, writer = socket.socketpair()
    writer.send(b"x")  # always readable: the selector never really waits, only the fake naps count
    sel.register(reader, selectors.EVENT_READ)
    try:
        assert len(sel.select(None)) == 1  # woke just now: naps the whole period before looking
        t.now += 0.010  # 10 ms of work after the wake
        sel.select(None)
        sel.select(0.005)  # a timer due in 5 ms: the nap ends there
        t.now += 0.030  # a loop busy for longer than the period
        sel.select(None)
        sel.select(0)  # callbacks ready: it only looks
        assert t.naps == [0.025, 0.015, 0.005]
    finally:
        sel.close()
        reader.close()
        writer.close()


def test_sockets_readable_within_the_period_are_read_in_one_pass() -> None:
    pairs = [socket.socketpair() for _ in range(3)]
    passes: list[list[int]] = []
    naps: list[float] = []

    def nap(seconds: float) -> None:
        # The agents' lines arrive one after another while the loop naps (no time passes in this test).
        if not naps:
            for _, writer in pairs:
                writer.send(b"x")
        naps.append(seconds)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        seen: list[int] = []
        done = asyncio.Event()
        for i, (reader, _) in enumerate(pairs):
            reader.setblocking(False)

            def readable(i: int = i, reader: socket.socket = pairs[i][0]) -> None:
                reader.recv(64)
                seen.append(i)
                loop.call_soon(lambda: passes.append(list(seen)))  # runs after this pass's readers
                if len(seen) == len(pairs):
                    done.set()

            loop.add_reader(reader.fileno(), readable)
        loop.call_later(5, done.set)  # a bound on the wait: the assertion below says what went wrong
        await done.wait()

    loop = asyncio.SelectorEventLoop(CoalescingSelector(0.5, nap=nap))
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
        for a, b in pairs:
            a.close()
            b.close()
    assert passes[0] == [0, 1, 2]  # all three handled before anything else ran


def test_the_setting_is_read_from_the_environment_and_a_bad_one_is_refused_in_one_line() -> None:
    assert read_every(environ={}) == 0.1 and read_every(0.025, environ={}) == 0.025  # the default, a caller's
    assert read_every(0.1, environ={"GRIDWATCH_READ_EVERY_S": "0"}) == 0.0
    assert read_every(environ={"GRIDWATCH_READ_EVERY_S": " 0.05 "}) == 0.05
    for bad in ("fast", "-1", "nan", "2"):
        with pytest.raises(ValueError, match=r"^GRIDWATCH_READ_EVERY_S: expected seconds from 0 to 0.25, got") as err:
            read_every(environ={"GRIDWATCH_READ_EVERY_S": bad})
        assert "\n" not in str(err.value)


def test_what_another_thread_hands_the_loop_ends_its_nap_at_once() -> None:
    # Textual's input thread posts each key with call_soon_threadsafe, as a worker thread posts its answer: a
    # loop set to nap for a minute runs it at once, not when its next timer (5 s on) ends the nap.
    from gridwatch.sshlink.coalesce import coalescing_loop

    async def main() -> float:
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[float] = loop.create_future()
        loop.call_later(5, lambda: None)  # the nap's bound
        sent = loop.time()

        def key() -> None:
            loop.call_soon_threadsafe(lambda: answered.done() or answered.set_result(loop.time() - sent))

        loop.call_soon(lambda: threading.Timer(0.05, key).start())  # while the loop naps
        return await answered

    loop = coalescing_loop(60.0)
    try:
        assert loop.run_until_complete(main()) < 4  # at once (about 0.05 s), not at the timer
    finally:
        loop.close()


def test_a_process_that_reads_many_links_walks_its_young_objects_every_10000_not_700() -> None:
    # The console and the relay run on run_coalesced: the collector's setting comes with it (a process of its own,
    # so this test's worker keeps CPython's default).
    import subprocess
    import sys

    code = ("import asyncio, gc\n"
            "from gridwatch.sshlink.coalesce import run_coalesced\n"
            "async def main(): return gc.get_threshold()\n"
            "print(gc.get_threshold(), run_coalesced(main(), 0))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.split() == ["(700,", "10,", "10)", "(10000,", "10,", "10)"]


def test_a_console_holding_a_thousand_links_reads_them_as_a_relay_does_unless_the_operator_says() -> None:
    """From 1,000 agents' links held directly, every 0.25 s; fewer (or behind relays), every 0.1 s; the
    environment wins either way."""
    assert console_period(0) == console_period(999) == 0.1
    assert console_period(1000) == console_period(12_500) == 0.25
    assert read_every(console_period(2500), environ={}) == 0.25
    assert read_every(console_period(2500), environ={"GRIDWATCH_READ_EVERY_S": "0.1"}) == 0.1
