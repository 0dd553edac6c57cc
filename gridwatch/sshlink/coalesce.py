"""The event loop of a process that reads many links: it reads its sockets at most every ``period`` seconds.

A console on a thousand links (or a relay on its rack's) receives a few hundred small messages a
second, each on a socket of its own. A plain loop wakes for each one and runs it alone through SSH's
decryption, the framing, the decode, the store and the engine; between two messages the rest of the
process has pushed that code and its data out of the CPU's caches, and each message pays for bringing
them back (a summary's decode is three times dearer than in a loop over many). This loop lets the
sockets that became readable within ``period`` of its last wake-up gather, and reads them in one pass
(interrupt coalescing, as a NIC does): measured with benchmarks/bench_ssh_message.py, the SSH layer alone
spends about a fifth less per message at 25 ms and nearly half less at 0.1 s (BENCHMARKS.md, third round).

What it costs: a message waits up to ``period`` longer to be read. Timers are never late for it (the
nap ends at the next timer), and a loop busy for longer than ``period`` does not nap at all.
"""

from __future__ import annotations

import asyncio
import math
import os
import selectors
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

# The console's: keys and redraws answer within a frame of a 40 Hz screen, XIDs reach the engine within
# 25 ms more of the fault (against a target of a second).
READ_EVERY_S = 0.025
# A relay's: no one types at it, and its summaries wait for its flush (0.5 s) anyway; an event waits 0.1 s
# more at most, and the relay spends about half as much per frame as at 25 ms (bench_console_scale.py).
RELAY_READ_EVERY_S = 0.1
# An operator's override (seconds, 0 for a loop that reads each socket as it becomes readable), and the most
# it may be: past a quarter of a second keys lag visibly.
READ_EVERY_ENV = "GRIDWATCH_READ_EVERY_S"
READ_EVERY_MAX_S = 0.25

_T = TypeVar("_T")


class CoalescingSelector(selectors.DefaultSelector):
    """The platform's selector, that naps before a wait until ``period`` has passed since it last woke."""

    def __init__(self, period: float = READ_EVERY_S, clock: Callable[[], float] = time.monotonic,
                 nap: Callable[[float], None] = time.sleep) -> None:
        super().__init__()
        self.period = period
        self._clock = clock
        self._nap = nap
        self._woke = clock()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        # timeout 0: callbacks are ready to run, the loop only looks; never held up.
        if self.period > 0 and (timeout is None or timeout > 0):
            wait = self.period - (self._clock() - self._woke)
            if wait > 0:
                if timeout is not None:
                    wait = min(wait, timeout)
                    timeout -= wait
                self._nap(wait)  # the sockets that become readable meanwhile are read together below
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(timeout)
        self._woke = self._clock()
        return ready


def read_every(default: float = READ_EVERY_S, environ: dict[str, str] | None = None) -> float:
    """The period to read sockets at: ``GRIDWATCH_READ_EVERY_S`` when set, else ``default``; ValueError in one line."""
    text = (os.environ if environ is None else environ).get(READ_EVERY_ENV, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= READ_EVERY_MAX_S:  # NaN fails too
        raise ValueError(f"{READ_EVERY_ENV}: expected seconds from 0 to {READ_EVERY_MAX_S:g}, got {text!r}")
    return value


def coalescing_loop(period: float = READ_EVERY_S) -> asyncio.AbstractEventLoop:
    """A new event loop whose selector reads the sockets at most every ``period`` seconds (0: as they come)."""
    return asyncio.SelectorEventLoop(CoalescingSelector(period))


def run_coalesced(main: Coroutine[Any, Any, _T], period: float | None = None) -> _T:
    """``asyncio.run(main)`` on a loop that reads its sockets at most every ``period`` seconds (:func:`read_every`)."""
    every = read_every() if period is None else period
    with asyncio.Runner(loop_factory=lambda: coalescing_loop(every)) as runner:
        return runner.run(main)
