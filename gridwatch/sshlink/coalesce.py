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
nap ends at the next timer), what another thread hands the loop ends the nap at once (a key: Textual
reads the terminal in a thread of its own), and a loop busy for longer than ``period`` does not nap at all.
"""

from __future__ import annotations

import asyncio
import math
import os
import selectors
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from gridwatch.sshlink.collector import collect_less_often

# A console's. Keys and redraws do not wait for it (a key ends the nap, a timer bounds it); a node's frame
# waits 0.1 s more at most, an XID reaching the engine within 0.1 s more of the fault (against a target of a
# second). Against 25 ms, the direct console spends about a fifth less per node at 1,000 nodes
# (bench_console_scale.py, BENCHMARKS.md).
READ_EVERY_S = 0.1
# A relay's: no one types at it and its summaries wait for its flush (0.5 s) anyway; an event waits 0.25 s
# more at most. Each wake-up costs, and at a slower cadence it carries fewer frames: against 0.1 s, 21.7
# against 25.0 µs per node carried in one run each at 1,000 nodes (BENCHMARKS.md, issue 25's fifth round).
RELAY_READ_EVERY_S = 0.25
# A console that holds this many agents' links itself reads them as a relay does: at 1,000 nodes (summaries
# every 4 s) its CPU per node was 0.85x the 0.1 s figure (22.8 against 26.8 µs, two alternated runs each), the
# XID median unchanged (0.51-0.58 s) and the slowest of five 1.07 s against 0.92. Below it the console's CPU is
# small either way and a frame is not held longer than it must be. (A console behind relays holds a few links.)
LARGE_FLEET_LINKS = 1000


def console_period(direct_links: int) -> float:
    """How often a console holding ``direct_links`` agents' links reads its sockets, unless the operator says."""
    return RELAY_READ_EVERY_S if direct_links >= LARGE_FLEET_LINKS else READ_EVERY_S


# An operator's override (seconds, 0 for a loop that reads each socket as it becomes readable), and the most
# it may be: an event waits that much more before the engine sees it.
READ_EVERY_ENV = "GRIDWATCH_READ_EVERY_S"
READ_EVERY_MAX_S = 0.25

_T = TypeVar("_T")


class CoalescingSelector(selectors.DefaultSelector):
    """The platform's selector, that naps before a wait until ``period`` has passed since it last woke."""

    def __init__(self, period: float = READ_EVERY_S, clock: Callable[[], float] = time.monotonic,
                 nap: Callable[[float], None] | None = None) -> None:
        super().__init__()
        self.period = period
        self._clock = clock
        self._urgent = selectors.DefaultSelector()  # what ends a nap at once (see urgent)
        self._nap = nap if nap is not None else self._nap_watching
        self._woke = clock()

    def urgent(self, fd: int) -> None:
        """Let ``fd`` becoming readable end a nap at once (the loop's self-pipe: a key, a thread's answer, a signal)."""
        self._urgent.register(fd, selectors.EVENT_READ)

    def _nap_watching(self, seconds: float) -> None:
        if self._urgent.get_map():
            self._urgent.select(seconds)
        else:
            time.sleep(seconds)

    def close(self) -> None:
        self._urgent.close()
        super().close()

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
    """A new event loop whose selector reads the sockets at most every ``period`` seconds (0: as they come).

    Whatever another thread hands the loop ends its nap at once: ``call_soon_threadsafe`` writes to the loop's
    self-pipe (Textual's input thread posts each key so, a worker thread its answer, a signal its number).
    """
    selector = CoalescingSelector(period)
    loop = asyncio.SelectorEventLoop(selector)
    self_pipe = getattr(loop, "_ssock", None)  # asyncio's own socket pair: no public name for it
    if self_pipe is not None:
        selector.urgent(self_pipe.fileno())
    return loop


def run_coalesced(main: Coroutine[Any, Any, _T], period: float | None = None) -> _T:
    """``asyncio.run(main)`` on a loop that reads its sockets at most every ``period`` seconds (:func:`read_every`),
    in a process whose garbage collector walks its young objects less often (:mod:`gridwatch.sshlink.collector`)."""
    every = read_every() if period is None else period
    collect_less_often()
    with asyncio.Runner(loop_factory=lambda: coalescing_loop(every)) as runner:
        return runner.run(main)
