"""Sources fail alone: an NVML call that hangs or raises is one event naming it, and samples keep going out."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from gridwatch.agent.agent import Agent
from gridwatch.agent.config import AgentConfig
from gridwatch.agent.logs import LogTailer
from gridwatch.agent.metrics import MetricsExporter
from gridwatch.agent.server import serve
from gridwatch.agent.sources import GuardedSource, Reading, SourceState
from gridwatch.agent.sources.host import HostSource
from gridwatch.agent.sources.nvml import NvmlSource, open_gpu_source
from gridwatch.wire import protocol as p
from tests import fake_pynvml
from tests.conftest import wait_until

INTERVAL = 0.1
DEADLINE = 0.4


class Stuck:
    """Makes one pynvml function block (as a call on a degrading GPU does) or raise, while armed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str, raises: Exception | None = None) -> None:
        self.armed = False
        self.calls = 0  # calls made while armed
        self.release = threading.Event()
        real = getattr(module, name)

        def stuck(*args: Any) -> Any:
            if self.armed:
                self.calls += 1
                if raises is not None:
                    raise raises
                self.release.wait(30)
            return real(*args)

        monkeypatch.setattr(module, name, stuck)


@dataclass
class Node:
    agent: Agent
    state: fake_pynvml.FakeNvml
    log: Path
    frames: list[p.Frame] = field(default_factory=list)

    def events(self, kind: str) -> list[p.Event]:
        return [f for f in self.frames if isinstance(f, p.Event) and f.kind == kind]

    def samples_after(self, frame: p.Frame) -> list[p.Sample]:
        return [f for f in self.frames if isinstance(f, p.Sample) and f.seq > frame.seq]


@pytest.fixture
async def node(keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    """A real agent over real NVML code (a fake pynvml under it), the host, a log file, /metrics; a console reading it over SSH."""
    state = fake_pynvml.install(monkeypatch, 2)
    gpus, notes = open_gpu_source(0)
    assert isinstance(gpus, NvmlSource), notes
    log = tmp_path / "train.log"
    log.write_text("")
    config = AgentConfig(
        node_name="gpu-07", listen="127.0.0.1:0", host_key=str(keys.host_key),
        authorized_viewers=str(keys.authorized_viewers), authorized_operators=str(keys.authorized_operators),
        interval=INTERVAL, source_timeout=DEADLINE,
    )
    agent = Agent(config, gpus=gpus, host=HostSource(), tailer=LogTailer([str(log)], kernel=False),
                  metrics=MetricsExporter())
    acceptor = await serve(agent, "127.0.0.1", 0)
    port = acceptor.sockets[0].getsockname()[1]
    running = asyncio.create_task(agent.run())
    conn = await asyncssh.connect("127.0.0.1", port, username="ops", client_keys=[str(keys.viewer_key)],
                                  known_hosts=str(keys.known_hosts))
    proc = await conn.create_process(subsystem="gridwatch", encoding=None)
    proc.stdin.write(p.encode(p.Subscribe()))
    view = Node(agent, state, log)

    async def read() -> None:
        while raw := await proc.stdout.readline():
            view.frames.append(p.decode_agent_frame(raw))

    reader = asyncio.create_task(read())
    try:
        yield view
    finally:
        reader.cancel()
        conn.close()
        agent.stop()
        acceptor.close()
        await asyncio.wait_for(running, 10)  # stops even with a read still hung
        agent.close_sources()


def _healthy(sample: p.Sample) -> bool:
    return len(sample.gpus) == 2 and all(g.util == 97 and g.temp_c == 66 for g in sample.gpus)


def _metric(agent: Agent, name: str, source: str) -> float:
    prefix = f'{name}{{node="gpu-07",source="{source}"}} '
    for line in agent.metrics.render().decode().splitlines():  # type: ignore[attr-defined]
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise AssertionError(f"{prefix!r} not in /metrics")


async def test_a_hung_nvml_call_is_one_event_and_the_rest_of_the_sample_goes_out(node: Node, monkeypatch) -> None:
    hang = Stuck(monkeypatch, node.agent.gpus._nv, "nvmlDeviceGetTemperature")  # type: ignore[union-attr]
    await wait_until(lambda: any(_healthy(s) for s in node.frames if isinstance(s, p.Sample)), what="a healthy sample")
    hang.armed = True
    failed = (await wait_until(lambda: node.events("source_failed"), what="the source_failed event"))[0]
    assert failed.details == {"source": "nvml", "state": "hung"} and failed.severity == "error"
    assert "source nvml hung: no answer within 0.4 s" in failed.message

    # The host and the logs still report; the GPUs are there, their readings N/A.
    node.log.write_text("[rank3]:[E ProcessGroupNCCL.cpp:607] [Rank 3] Watchdog caught collective operation timeout\n")
    await wait_until(lambda: node.events("nccl_timeout"), what="the log's event while NVML hangs")
    after = await wait_until(lambda: len(node.samples_after(failed)) >= 5 and node.samples_after(failed), what="samples")
    for sample in after:
        assert sample.host.mem_total_mb is not None and sample.host.cpu_percent is not None
        assert [g.index for g in sample.gpus] == [0, 1] and all(g.util is None and g.temp_c is None for g in sample.gpus)
    assert hang.calls == 1, "a second read was started while the first was still hung"
    assert len(node.events("source_failed")) == 1
    assert _metric(node.agent, "gridwatch_agent_source_success", "nvml") == 0
    assert _metric(node.agent, "gridwatch_agent_source_success", "host") == 1
    assert _metric(node.agent, "gridwatch_agent_source_duration_seconds", "nvml") > DEADLINE

    # An XID that arrives meanwhile is not lost with the stale readings of the late read.
    node.state.queue_xid(1, 79)
    hang.armed = False
    hang.release.set()
    recovered = (await wait_until(lambda: node.events("source_recovered"), what="the recovery event"))[0]
    assert recovered.details == {"source": "nvml", "state": "ok"} and "source nvml answers again" in recovered.message
    await wait_until(lambda: any(_healthy(s) for s in node.samples_after(recovered)), what="healthy samples again")
    xids = node.events("xid")
    assert [(e.code, e.gpu) for e in xids] == [(79, 1)]
    assert len(node.events("source_failed")) == 1 and len(node.events("source_recovered")) == 1
    assert _metric(node.agent, "gridwatch_agent_source_success", "nvml") == 1


async def test_an_nvml_call_that_raises_is_one_event_per_streak(node: Node, monkeypatch) -> None:
    broken = Stuck(monkeypatch, node.agent.gpus._nv, "nvmlEventSetWait_v2", raises=RuntimeError("driver returned garbage"))  # type: ignore[union-attr]
    await wait_until(lambda: any(_healthy(s) for s in node.frames if isinstance(s, p.Sample)), what="a healthy sample")
    broken.armed = True
    failed = (await wait_until(lambda: node.events("source_failed"), what="the source_failed event"))[0]
    assert failed.details == {"source": "nvml", "state": "failed"} and failed.severity == "warning"
    assert "source nvml failed: RuntimeError: driver returned garbage" in failed.message
    after = await wait_until(lambda: len(node.samples_after(failed)) >= 5 and node.samples_after(failed), what="samples")
    assert all(s.host.mem_total_mb is not None and len(s.gpus) == 2 for s in after)
    assert broken.calls >= 5 and len(node.events("source_failed")) == 1  # every tick tries; one event per streak
    broken.armed = False
    await wait_until(lambda: node.events("source_recovered"), what="the recovery event")
    # A second streak is news again.
    broken.armed = True
    await wait_until(lambda: len(node.events("source_failed")) == 2, what="a second source_failed event")


async def test_the_agent_stops_while_an_nvml_call_is_still_hung(node: Node, monkeypatch) -> None:
    hang = Stuck(monkeypatch, node.agent.gpus._nv, "nvmlDeviceGetUtilizationRates")  # type: ignore[union-attr]
    hang.armed = True
    await wait_until(lambda: node.events("source_failed"), what="the source_failed event")
    node.agent.stop()  # the fixture then waits for the loop to end: it must not wait for NVML
    guard = next(g for g in node.agent.sources() if g.name == "nvml")
    assert guard.busy
    node.agent.close_sources()  # NVML is not shut down under a call still running in it
    assert node.state.shutdowns == 0
    hang.release.set()


def test_a_source_that_raises_when_driven_by_hand_costs_only_its_part() -> None:
    class Flaky:
        name = "flaky"
        blocking = False

        def __init__(self) -> None:
            self.fail = True

        def read(self) -> Reading:
            if self.fail:
                raise OSError("no such device")
            return Reading(host=p.HostSample(load1=1.5))

    source = Flaky()
    guard = GuardedSource(source, timeout=1.0)
    out = guard.read_now()
    assert out.reading is None and [e.kind for e in out.events] == ["source_failed"]
    assert guard.read_now().events == [] and guard.health().state is SourceState.FAILED and guard.failures == 2
    source.fail = False
    out = guard.read_now()
    assert out.reading is not None and out.reading.host.load1 == 1.5
    assert [e.kind for e in out.events] == ["source_recovered"] and guard.health().state is SourceState.OK
