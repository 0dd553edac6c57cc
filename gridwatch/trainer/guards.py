"""Guards inside the training loop: bad loss, loss spikes, stragglers, and a progress deadline."""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def __call__(self) -> float: ...


class LossGuard:
    """Flags a non-finite loss, or one over ``factor`` times the median of the recent ones."""

    def __init__(self, factor: float, window: int = 20, warmup: int = 5) -> None:
        self.factor = factor
        self.warmup = warmup
        self._recent: deque[float] = deque(maxlen=window)

    def check(self, loss: float) -> str | None:
        """``"nan_loss"``, ``"loss_spike"`` or None; only good losses join the baseline."""
        if not math.isfinite(loss):
            return "nan_loss"
        spike = (
            self.factor > 0
            and len(self._recent) >= self.warmup
            and loss > self.factor * statistics.median(self._recent)
        )
        if not spike:
            self._recent.append(loss)
        return "loss_spike" if spike else None


class StragglerGuard:
    """Ranks whose step took over ``factor`` times the running median of all ranks' steps."""

    def __init__(self, factor: float, window: int = 20, min_excess_s: float = 0.05, warmup: int = 3) -> None:
        self.factor = factor
        self.min_excess_s = min_excess_s
        self.warmup = warmup
        self._recent: deque[float] = deque(maxlen=window)

    def check(self, times: list[float]) -> list[int]:
        times = [t for t in times]
        out: list[int] = []
        if len(self._recent) >= self.warmup and self.factor > 0:
            median = statistics.median(self._recent)
            out = [r for r, t in enumerate(times) if t > self.factor * median and t - median > self.min_excess_s]
        self._recent.extend(t for r, t in enumerate(times) if t > 0 and r not in out)
        return out


class ProgressDeadline:
    """Calls ``on_expire`` once if :meth:`feed` is not called for ``deadline_s`` (injected ``clock``).

    A peer frozen with its sockets open leaves collectives waiting for the
    backend's timeout (30 minutes for gloo); this deadline ends the wait.
    """

    def __init__(self, deadline_s: float, on_expire: Callable[[float], None], clock: Clock) -> None:
        self.deadline_s = deadline_s
        self._on_expire = on_expire
        self._clock = clock
        self._last = clock()
        self._fired = False
        self._lock = threading.Lock()

    def feed(self, deadline_s: float | None = None) -> None:
        with self._lock:
            self._last = self._clock()
            if deadline_s is not None:
                self.deadline_s = deadline_s

    def check(self) -> bool:
        """True (and ``on_expire`` called, once) when the deadline has passed."""
        with self._lock:
            idle = self._clock() - self._last
            expired = idle > self.deadline_s and not self._fired
            if expired:
                self._fired = True
        if expired:
            self._on_expire(idle)
        return expired

    def watch(self, interval: float = 0.5) -> threading.Thread:
        """Check every ``interval`` seconds of real time from a daemon thread."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval):
                if self.check():
                    return

        thread = threading.Thread(target=loop, name="progress-deadline", daemon=True)
        thread.start()
        return thread
