"""Guards inside the training loop: bad loss, loss spikes, stragglers, and a progress deadline."""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
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


@dataclass(slots=True)
class StragglerEpisode:
    """One node slower than its peers over a window: when it began and how it stands."""

    node: str
    first_step: int
    last_step: int
    flagged: int  # slow steps in the window
    span_s: float  # from the first slow step in the window to the last
    ratio: float  # its slowest step in the window against that step's median
    flags: deque[tuple[float, int, float]] = field(default_factory=deque)  # (time, step, ratio) of each slow step
    told: bool = False
    quiet_steps: int = 0  # steps at pace since its last slow one


class StragglerEpisodes:
    """A straggler is a node, not a step: told once when it has been slow for a while, again only after a rest.

    A slow step now and then is noise (a GC pause, a checkpoint write, a busy machine where every rank is
    late once in a while); a slow node (thermal, a bad NIC, a noisy neighbour) is late on most steps, for
    minutes. An episode begins once a node was flagged on at least ``min_flags`` steps within ``within_s``,
    spanning at least ``min_span_s`` (not one burst) and covering at least ``share`` of the steps between
    its first and last flag (not scattered one-offs); it ends after ``rest_steps`` steps at pace. Runs on
    the injected ``clock``.
    """

    def __init__(self, clock: Clock, min_flags: int = 5, within_s: float = 900.0, min_span_s: float = 120.0,
                 share: float = 0.5, rest_steps: int = 50) -> None:
        self.clock = clock
        self.min_flags = max(1, min_flags)
        self.within_s = within_s
        self.min_span_s = min_span_s
        self.share = share
        self.rest_steps = rest_steps
        self.episodes: dict[str, StragglerEpisode] = {}

    def update(self, step: int, slow: dict[str, float]) -> list[StragglerEpisode]:
        """Feed one step: ``slow`` maps each node flagged on it to its step time over the median.

        Returns the episodes that begin with this step (each node once per episode), as they stand now.
        """
        now = self.clock()
        begun: list[StragglerEpisode] = []
        for node, ratio in slow.items():
            ep = self.episodes.get(node)
            if ep is None:
                ep = self.episodes[node] = StragglerEpisode(node, step, step, 0, 0.0, ratio)
            ep.flags.append((now, step, ratio))
            ep.quiet_steps = 0
        for node, ep in list(self.episodes.items()):
            if node not in slow:
                ep.quiet_steps += 1
                if ep.quiet_steps >= self.rest_steps or (not ep.told and now - ep.flags[-1][0] > self.within_s):
                    del self.episodes[node]  # at pace again: its next slowness is a new episode
                continue
            while ep.flags and now - ep.flags[0][0] > self.within_s:
                ep.flags.popleft()
            if not ep.told:
                # Sparse old flags are not part of a run that is going on now.
                while len(ep.flags) >= self.min_flags and self._share(ep) < self.share:
                    ep.flags.popleft()
            ep.flagged = len(ep.flags)
            ep.first_step, ep.last_step = ep.flags[0][1], ep.flags[-1][1]
            ep.span_s = ep.flags[-1][0] - ep.flags[0][0]
            ep.ratio = max(r for _, _, r in ep.flags)
            if (not ep.told and ep.flagged >= self.min_flags and ep.span_s >= self.min_span_s
                    and self._share(ep) >= self.share):
                ep.told = True
                begun.append(replace(ep, flags=deque()))  # as it stood when told
        return begun

    @staticmethod
    def _share(ep: StragglerEpisode) -> float:
        steps = [s for _, s, _ in ep.flags]
        return len(steps) / (max(steps) - min(steps) + 1)


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
