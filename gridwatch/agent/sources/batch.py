"""The blocking sources of one tick read one after another in one shared thread, each still under its own deadline.

A thread per source cost each tick a wake-up and a hand-back per source (about
as much CPU as the host's whole reading on a busy node); one thread for all of
them costs one. Isolation stays: a read past its deadline is that source's
failure alone. The thread, stuck in that read, becomes the source's own (as if
it had always been read alone), and the reads queued behind it are taken out
of that thread and read at once, each in its own thread under its own
deadline, as before the batching: the tick that finds a hang still reports the
rest, at the cost of up to one more deadline that tick.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any

from gridwatch.agent.sources import GuardedSource, Outcome, _settle, _Worker
from gridwatch.wire.protocol import Event


@dataclass
class _Slot:
    """One source's read in a batch, written by the reader thread (``done`` last), read by the loop."""

    guard: GuardedSource
    started: float | None = None  # on the guard's clock (what its health reports)
    began: float | None = None  # on the real monotonic clock (what its deadline counts from)
    ended: float = 0.0
    result: Any = None
    error: BaseException | None = None
    done: bool = False
    withdrawn: bool = False  # taken out before it started: the thread skips it


class _Batch:
    def __init__(self, guards: list[GuardedSource]) -> None:
        self.slots = [_Slot(g) for g in guards]
        self.lock = threading.Lock()  # between the thread starting a read and the loop withdrawing it

    def run(self) -> None:
        """In the reader thread: each read in turn, unless withdrawn first."""
        for slot in self.slots:
            with self.lock:
                if slot.withdrawn:
                    continue
                slot.started, slot.began = slot.guard.clock(), time.monotonic()
            try:
                slot.result = slot.guard.source.read()
            except BaseException as exc:  # handed to the loop, which decides what it means
                slot.error = exc
            slot.ended = slot.guard.clock()
            slot.done = True


class BatchedReads:
    """Reads the blocking sources of each tick in one shared thread (see the module's docstring)."""

    def __init__(self) -> None:
        self._worker: _Worker | None = None
        self._batch: _Batch | None = None  # the last one handed to the thread

    async def read(self, guards: list[GuardedSource]) -> list[Outcome]:
        """One read of each of ``guards`` (blocking ones), in their order, each within its own deadline."""
        outcomes: dict[int, Outcome] = {}
        late: dict[int, list[Event]] = {}
        ready: list[int] = []
        for i, guard in enumerate(guards):
            still_hung, events = guard.resume()
            if still_hung is not None:
                outcomes[i] = still_hung
                continue
            guard.retire_thread()
            late[i] = events
            ready.append(i)
        if ready:
            alone = await self._read_batch(guards, ready, late, outcomes)
            if alone:
                found = await asyncio.gather(*(guards[i].read_alone(late[i]) for i in alone))
                outcomes.update(zip(alone, found))
        return [outcomes[i] for i in range(len(guards))]

    async def _read_batch(self, guards: list[GuardedSource], ready: list[int], late: dict[int, list[Event]],
                          outcomes: dict[int, Outcome]) -> list[int]:
        """Read ``ready`` in the shared thread; fills ``outcomes``; the indices withdrawn behind a hung read."""
        names = "+".join(guards[i].name for i in ready)
        if self._worker is None or self._worker.stopped:
            self._worker = _Worker(names)
        worker = self._worker
        batch = self._batch = _Batch([guards[i] for i in ready])
        # Deadlines in real time (as asyncio's waits are), whatever clock the guards report with.
        deadline = time.monotonic() + guards[ready[0]].timeout
        fut = worker.submit(batch.run)
        while True:
            delay = deadline - time.monotonic()
            if delay > 0:
                done, _ = await asyncio.wait({fut}, timeout=delay)
                if done:
                    break
            with batch.lock:
                running = next((s for s in batch.slots if s.began is not None and not s.done), None)
                if running is not None and running.began is not None:
                    own = running.began + running.guard.timeout
                    if own > time.monotonic():
                        deadline = own  # it started late, behind slower reads: its own deadline counts
                        continue
                for slot in batch.slots:  # what has not started leaves this thread
                    if slot.started is None:
                        slot.withdrawn = True
            break
        alone: list[int] = []
        for i, slot in zip(ready, batch.slots):
            if slot.done and slot.started is not None:
                outcomes[i] = slot.guard.answered(slot.started, slot.ended, slot.result, slot.error, late[i])
            elif slot.withdrawn:
                alone.append(i)
            else:  # still in its read past its deadline: hung, and the thread is its own from now on
                pending: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                fut.add_done_callback(functools.partial(_hand_over, pending, slot))
                started = slot.started if slot.started is not None else slot.guard.clock()
                outcomes[i] = slot.guard.hung_in(worker, pending, started, late[i])
                self._worker = None
        return alone

    async def stop(self, timeout: float) -> bool:
        """End the shared thread once the batch in hand (if any) is done, waiting up to ``timeout`` s in the loop."""
        if self._worker is None:
            return True
        return await self._worker.end(timeout)

    def close(self, timeout: float) -> set[GuardedSource]:
        """End the shared thread, waiting up to ``timeout`` s; the sources a read is still running in (not to be
        closed under it)."""
        if self._worker is None:
            return set()
        waited = self._worker.stopped
        self._worker.stop()
        if self._worker.join(0 if waited else timeout) or self._batch is None:
            return set()
        return {s.guard for s in self._batch.slots if not s.done and not s.withdrawn}


def _hand_over(pending: asyncio.Future[Any], slot: _Slot, _batch: asyncio.Future[Any]) -> None:
    """The batch ended, so the hung read in it answered: its source's pending read settles with what it gave."""
    _settle(pending, slot.result, slot.error)
