"""Clocks the engine, executor and console ask for the time, so tests can advance it.

Both clocks are also callables (``clock()`` is ``clock.now()``): code that takes a
``Callable[[], float]`` (the agent's sources, the trainer's guards) accepts them, so
one :class:`ManualClock` drives every part of a test.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Anything that says what time it is, in seconds since the epoch."""

    def now(self) -> float: ...


class SystemClock:
    """The wall clock: what the console uses."""

    def now(self) -> float:
        return time.time()

    def __call__(self) -> float:
        return self.now()


class ManualClock:
    """A clock that moves only when told: replay and tests drive it."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def __call__(self) -> float:
        return self._now

    def set(self, when: float) -> None:
        # Replay feeds frames from several nodes whose stamps interleave; the
        # simulated time must never run backwards or windows would reopen.
        self._now = max(self._now, when)

    def advance(self, seconds: float) -> float:
        self._now += seconds
        return self._now
