"""The blocking sources of a tick share one reader thread, and a read that hangs there is still that source's alone."""

from __future__ import annotations

import asyncio
import threading
import time

from gridwatch.agent.sources import GuardedSource, Reading, SourceState
from gridwatch.agent.sources.batch import BatchedReads
from gridwatch.wire import protocol as p

DEADLINE = 0.3


class Blocking:
    """A blocking source that says which thread read it, and can be told to hang or take its time."""

    blocking = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.threads: list[int] = []
        self.hang = threading.Event()  # set: the next read waits for release
        self.release = threading.Event()
        self.takes = 0.0
        self.calls = 0

    def read(self) -> Reading:
        self.calls += 1
        self.threads.append(threading.get_ident())
        if self.hang.is_set():
            self.release.wait(30)
            return Reading(events=[p.Event(kind=p.Text("late_news"), source=p.Text(self.name))])
        if self.takes:
            time.sleep(self.takes)
        return Reading(host=p.HostSample(cpu_percent=1.0))


def kinds(outcome_events: list[p.Event]) -> list[str]:
    return [str(e.kind) for e in outcome_events]


async def test_every_blocking_source_of_a_tick_is_read_in_one_thread() -> None:
    sources = [Blocking("nvml"), Blocking("host"), Blocking("logs")]
    guards = [GuardedSource(s, DEADLINE) for s in sources]
    readers = BatchedReads()
    for _ in range(3):
        outcomes = await readers.read(guards)
        assert all(o.reading is not None and o.events == [] for o in outcomes)
    threads = {t for s in sources for t in s.threads}
    assert len(threads) == 1 and threads != {threading.get_ident()}
    assert [t.name for t in threading.enumerate() if t.ident in threads] == ["source-nvml+host+logs"]
    assert await readers.stop(DEADLINE)


async def test_a_read_behind_a_slow_one_gets_its_own_deadline() -> None:
    first, second = Blocking("nvml"), Blocking("host")
    first.takes = second.takes = DEADLINE * 0.6  # together past one deadline, each well within its own
    readers = BatchedReads()
    outcomes = await readers.read([GuardedSource(first, DEADLINE), GuardedSource(second, DEADLINE)])
    assert [o.reading is not None for o in outcomes] == [True, True]
    assert all(o.events == [] for o in outcomes)
    assert await readers.stop(DEADLINE)


async def test_a_hung_read_is_its_sources_alone_and_the_reads_behind_it_still_report() -> None:
    nvml, host, logs = Blocking("nvml"), Blocking("host"), Blocking("logs")
    guards = [GuardedSource(s, DEADLINE) for s in (nvml, host, logs)]
    readers = BatchedReads()
    await readers.read(guards)
    shared = host.threads[-1]
    host.hang.set()
    outcomes = await readers.read(guards)
    # The hang is the host's: one event naming it; nvml read before it, logs after it in a thread of its own.
    assert kinds(outcomes[1].events) == ["source_failed"] and outcomes[1].reading is None
    assert outcomes[1].events[0].details == {"source": "host", "state": "hung"}
    assert outcomes[0].reading is not None and outcomes[2].reading is not None
    assert outcomes[0].events == outcomes[2].events == []
    assert logs.threads[-1] != shared and guards[1].health().state is SourceState.HUNG
    assert [t.name for t in threading.enumerate() if t.ident == shared] == ["source-host"]

    # While it hangs it is not read again; the others go on in a new shared thread.
    host.hang.clear()
    for _ in range(2):
        outcomes = await readers.read(guards)
        assert outcomes[1].reading is None and outcomes[1].events == []
        assert outcomes[0].reading is not None and outcomes[2].reading is not None
    assert host.calls == 2 and guards[1].failures == 3
    assert nvml.threads[-1] == logs.threads[-1] != shared

    # It answers: its late events still count, it recovers, and it is read with the others again.
    host.release.set()
    for _ in range(100):  # the loop takes the answer from the thread
        if not guards[1].busy:
            break
        await asyncio.sleep(0.01)
    outcomes = await readers.read(guards)
    assert kinds(outcomes[1].events) == ["late_news", "source_recovered"] and outcomes[1].reading is not None
    assert host.threads[-1] == nvml.threads[-1]
    assert not any(t.ident == shared and t.is_alive() for t in threading.enumerate()), "the hung read's thread lives on"
    assert await readers.stop(DEADLINE)


async def test_deadlines_run_in_real_time_whatever_clock_the_guards_report_with() -> None:
    """An agent's injected clock (a test's, frozen) reports durations; it never stretches a deadline."""
    stuck, fine = Blocking("nvml"), Blocking("host")
    stuck.hang.set()
    guards = [GuardedSource(stuck, DEADLINE, clock=lambda: 5.0), GuardedSource(fine, DEADLINE, clock=lambda: 5.0)]
    readers = BatchedReads()
    began = time.monotonic()
    outcomes = await readers.read(guards)
    assert time.monotonic() - began < DEADLINE * 3
    assert kinds(outcomes[0].events) == ["source_failed"] and outcomes[1].reading is not None
    stuck.release.set()
    assert await readers.stop(DEADLINE)
