"""What an agent reads each tick (GPUs, the host, logs, the trainer), each source behind one interface.

As node_exporter's collectors: every source implements :class:`Source`
(``read()`` returns a :class:`Reading`), and :class:`GuardedSource` runs it
once per tick, times it and isolates it. A source that raises or hangs is an
event naming it (once per failure streak, and once when it answers again); the
rest of the sample still goes out. A blocking source (NVML, ``/proc``, log
files) is read off the loop under its own deadline (the agent's tick reads
them one after another in one shared thread, :mod:`gridwatch.agent.sources.batch`;
a read past its deadline keeps that thread as its own), and a read that is
still hung is never joined by a second one.

Within a reading, a field the hardware cannot give is N/A (``None``), never an
exception out of ``read()``.
"""

from __future__ import annotations

import asyncio
import enum
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from loguru import logger

from gridwatch.wire.protocol import Event, GpuInfo, GpuSample, HostSample, Text, TrainerStatus, clean_text

if TYPE_CHECKING:
    # Only a type here: gridwatch.agent.logs imports the detectors, which import gridwatch.agent.sources.pci.
    from gridwatch.agent.logs import LogEntry


class FaultNotSupported(Exception):
    """This source cannot take injected faults (real hardware)."""


@dataclass
class Reading:
    """What one source said in one tick; each source fills its own part (node_exporter's channel)."""

    gpus: list[GpuSample] | None = None
    host: HostSample | None = None
    trainer: TrainerStatus | None = None
    events: list[Event] = field(default_factory=list)
    lines: list[LogEntry] = field(default_factory=list)


class Source(Protocol):
    """One thing the agent reads each tick."""

    name: str  # in events and in /metrics: nvml, simulated_gpus, host, logs, trainer
    blocking: bool  # may block in the kernel or a driver: read in a thread, under a deadline

    def read(self) -> Reading:
        """One reading; may raise or hang: :class:`GuardedSource` copes with both."""
        ...


class GpuSource(Protocol):
    """NVML and the simulator both look like this to the sampler."""

    name: str
    blocking: bool
    simulated: bool

    def info(self) -> list[GpuInfo]:
        """Static facts, read once at start."""
        ...

    def sample(self) -> list[GpuSample]:
        """One reading of every GPU; unreadable fields are ``None``."""
        ...

    def poll_events(self) -> list[Event]:
        """Events (XIDs, ECC, thermal, fell off the bus) since the last call; non-blocking."""
        ...

    def read(self) -> Reading:
        """The sampler's view: one reading of every GPU and the events since the last one."""
        return Reading(gpus=self.sample(), events=self.poll_events())

    def inject(self, kind: str, gpu: int | None = None, code: int | None = None) -> str:
        """Inject a fault (simulated GPUs only); returns a one-line description.

        Raises :class:`FaultNotSupported` on real hardware, ``ValueError`` for a
        bad kind or GPU index.
        """
        ...

    def clear_faults(self) -> None:
        ...

    def close(self) -> None:
        ...


class SourceState(enum.Enum):
    OK = "ok"
    FAILED = "failed"  # its last read raised
    HUNG = "hung"  # a read has not answered within the deadline (and may still be running)


@dataclass(frozen=True)
class SourceHealth:
    """How a source's last read went: what /metrics exports (``node_scrape_collector_*``)."""

    name: str
    state: SourceState
    duration_s: float | None  # of the last finished read; for a hung one, how long it has run
    failures: int  # reads in the current failure streak (0 when OK)


class _Worker:
    """One daemon thread that runs a source's reads, one at a time.

    A daemon: a read hung in a driver must not keep the agent from exiting.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]] | None]
        self._jobs = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.stopped = False  # told to end: a later read needs a new worker

    def rename(self, name: str) -> None:
        """Name the thread for what it reads now (``source-host+logs``; a hung read's source alone after)."""
        self._name = name
        if self._thread is not None:
            self._thread.name = f"source-{name}"

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"source-{self._name}", daemon=True)
            self._thread.start()
        self._jobs.put((fn, loop, fut))
        return fut

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, loop, fut = job
            try:
                result, error = fn(), None
            except BaseException as exc:  # handed to the loop, which decides what it means
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:  # the loop closed while this read was hung
                return

    def stop(self) -> None:
        """End the thread once the read in hand (if any) is done; it takes no more."""
        if not self.stopped:
            self.stopped = True
            self._jobs.put(None)

    def join(self, timeout: float) -> bool:
        """After :meth:`stop`, wait up to ``timeout`` s for the thread to end; True when it has (or never started)."""
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    async def end(self, timeout: float) -> bool:
        """Stop, waiting in the loop (not blocking it) up to ``timeout`` s for the read in hand; True when the thread ended."""
        if self.stopped or self._thread is None or not self._thread.is_alive():
            self.stop()
            return self.join(0)
        last = self.submit(_nothing)  # queued behind the read in hand: answered once that one is done
        self.stop()
        done, _ = await asyncio.wait({last}, timeout=timeout)
        # Answered: the thread is past its last read, with only the stop left to take.
        return self.join(timeout if done else 0)


def _nothing() -> None:
    return None


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


@dataclass
class Outcome:
    """A guarded read: the reading if it answered in time, and events to publish either way."""

    reading: Reading | None
    events: list[Event] = field(default_factory=list)


class GuardedSource:
    """One source behind its deadline: timed, isolated, never read twice at once.

    ``read()`` (in the agent's loop) runs a blocking source in its own thread
    and waits at most ``timeout`` seconds; ``read_now()`` reads inline, for
    callers that drive an agent by hand. A read that finishes after its
    deadline keeps its events (an XID is news however late), not its
    readings (they are stale).
    """

    def __init__(self, source: Source, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.name = str(getattr(source, "name", type(source).__name__))
        self.blocking = bool(getattr(source, "blocking", False))
        self.timeout = timeout
        self.clock = clock
        self.state = SourceState.OK
        self.failures = 0
        self.duration_s: float | None = None
        self._failed_at: float | None = None
        self._pending: asyncio.Future[Any] | None = None
        self._started = 0.0
        self._worker: _Worker | None = None
        self._log = logger.bind(source=self.name)

    @property
    def busy(self) -> bool:
        """A read is still running (hung past its deadline)."""
        return self._pending is not None and not self._pending.done()

    def health(self) -> SourceHealth:
        duration = self.clock() - self._started if self.busy else self.duration_s
        return SourceHealth(self.name, self.state, duration, self.failures)

    async def read(self) -> Outcome:
        """One read under the deadline; ``reading`` is None when the source failed or hung."""
        still_hung, events = self.resume()
        if still_hung is not None:
            return still_hung
        if not self.blocking:
            return self._inline(events)
        return await self.read_alone(events)

    def resume(self) -> tuple[Outcome | None, list[Event]]:
        """Before a read: the tick's outcome when a read past its deadline is still running (no second read
        is started behind it), else None and the events of one that has since answered."""
        if self._pending is None:
            return None, []
        if not self._pending.done():
            self.failures += 1
            return Outcome(None), []  # still hung: a second read would only pile up behind it
        events = self._late(self._pending)
        self._pending = None
        return None, events

    async def read_alone(self, events: list[Event]) -> Outcome:
        """One read in this source's own thread under its deadline (after :meth:`resume` said it may)."""
        if self._worker is None or self._worker.stopped:
            self._worker = _Worker(self.name)
        self._started = self.clock()
        fut = self._worker.submit(self.source.read)
        done, _ = await asyncio.wait({fut}, timeout=self.timeout)
        if not done:
            self._pending = fut
            self.duration_s = None
            events += self._fail(SourceState.HUNG, f"no answer within {self.timeout:g} s")
            return Outcome(None, events)
        return self._finished(fut, events)

    def answered(self, started: float, ended: float, result: Any, error: BaseException | None,
                 events: list[Event]) -> Outcome:
        """A read another thread ran for this source (:mod:`gridwatch.agent.sources.batch`) that answered in time."""
        self._started, self.duration_s = started, ended - started
        if error is not None:
            return Outcome(None, events + self._fail(SourceState.FAILED, _why(error), error))
        return Outcome(result, events + self._ok())

    def hung_in(self, worker: _Worker, pending: asyncio.Future[Any], started: float, events: list[Event]) -> Outcome:
        """A read another thread ran for this source that is past its deadline: the thread, stuck in it, is now
        this source's own (ended, or closed under, as its own), and ``pending`` answers when the read does."""
        self._pending, self._started, self.duration_s = pending, started, None
        if self._worker is not None and self._worker is not worker:
            self._worker.stop()
        self._worker = worker
        worker.rename(self.name)
        return Outcome(None, events + self._fail(SourceState.HUNG, f"no answer within {self.timeout:g} s"))

    def retire_thread(self) -> None:
        """This source is read in a shared thread again: its own (the one a past hang left it) ends."""
        if self._worker is not None and not self.busy:
            self._worker.stop()
            # Idle (its read answered): it ends at once; waited for, so no thread outlives its reads.
            self._worker.join(1.0)
            self._worker = None

    def read_now(self) -> Outcome:
        """One read in the caller's thread, without a deadline (a hung source is skipped)."""
        if self.busy:
            self.failures += 1
            return Outcome(None)
        return self._inline([])

    def _inline(self, events: list[Event]) -> Outcome:
        self._started = self.clock()
        try:
            reading = self.source.read()
        except Exception as exc:  # a source bug costs its own part of the sample, nothing more
            self.duration_s = self.clock() - self._started
            return Outcome(None, events + self._fail(SourceState.FAILED, _why(exc), exc))
        self.duration_s = self.clock() - self._started
        return Outcome(reading, events + self._ok())

    def _finished(self, fut: asyncio.Future[Any], events: list[Event]) -> Outcome:
        self.duration_s = self.clock() - self._started
        exc = fut.exception()
        if exc is not None:
            return Outcome(None, events + self._fail(SourceState.FAILED, _why(exc), exc))
        return Outcome(fut.result(), events + self._ok())

    def _late(self, fut: asyncio.Future[Any]) -> list[Event]:
        """A hung read that has since answered: its events still count."""
        if fut.cancelled() or fut.exception() is not None:
            return []
        reading = fut.result()
        return list(reading.events) if isinstance(reading, Reading) else []

    def _fail(self, state: SourceState, why: str, exc: BaseException | None = None) -> list[Event]:
        self.failures += 1
        first = self.state is SourceState.OK
        self.state = state
        if not first:
            return []
        self._failed_at = self.clock()
        verb = "hung" if state is SourceState.HUNG else "failed"
        message = f"source {self.name} {verb}: {why}; samples go out without it until it answers"
        self._log.opt(exception=exc).warning("{}", message)
        return [_event("source_failed", "error" if state is SourceState.HUNG else "warning", message, self.name, state)]

    def _ok(self) -> list[Event]:
        if self.state is SourceState.OK:
            return []
        lasted = self.clock() - (self._failed_at or self.clock())
        message = f"source {self.name} answers again after {self.failures} failed reads ({lasted:.0f} s)"
        self.state, self.failures = SourceState.OK, 0
        self._log.info("{}", message)
        return [_event("source_recovered", "info", message, self.name, SourceState.OK)]

    async def stop_reading(self) -> bool:
        """End the thread this source is read in; a read in hand gets up to the deadline to answer first.

        False when it is still hung then: its daemon thread is left to it, and
        ends once the read answers. A later read starts a new thread.
        """
        if self._worker is None or await self._worker.end(self.timeout):
            return True
        self._log.warning("source {} still hung at stop: its thread ends when the read answers", self.name)
        return False

    def close(self) -> None:
        """Close the source once its thread has ended, waiting up to the deadline for a read in hand.

        A read still hung then keeps the source open (closing under it could crash the driver).
        """
        if self._worker is not None:
            waited = self._worker.stopped  # :meth:`stop_reading` has already given it the deadline
            self._worker.stop()
            if not self._worker.join(0 if waited else self.timeout):
                self._log.warning("source {} left open: a read is still hung in it", self.name)
                return
        close = getattr(self.source, "close", None)
        if close is not None:
            close()


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _event(kind: str, severity: str, message: str, name: str, state: SourceState) -> Event:
    return Event(
        kind=Text(kind), severity=Text(severity), message=Text(clean_text(message)), source=Text("agent"),
        details={Text("source"): Text(name), Text("state"): Text(state.value)},
    )
