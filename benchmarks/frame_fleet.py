"""Frames of a simulated fleet, fed to a runtime as a link hands them over: the console's in-process cost per frame.

bench_console_frame.py measures it alone; bench_console_scale.py measures it again inside the running
console over its window (:class:`Gauge`), so that the running console's cost per summary is held against
the in-process figure of the same machine at the same moment: on two shared cores the agents' own load
slows every instruction of the console (a redraw of the same rows costs twice as much in a window where
the agents send twice the summaries), and a figure taken at another time is no baseline.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any


@dataclass
class FrameFleet:
    """``nodes`` simulated nodes of 8 GPUs with a trainer each: ``rounds`` rounds of full samples and of summaries."""

    names: list[str]
    hello_gpus: Any
    full: list[list[bytes]]
    summary: list[list[bytes]]
    clock: Any

    @classmethod
    def make(cls, nodes: int, rounds: int = 4, prefix: str = "node") -> FrameFleet:
        from gridwatch.agent.sources.simulated import SimulatedGpus
        from gridwatch.playbooks.clock import ManualClock
        from gridwatch.wire import protocol as p

        clock = ManualClock(1_700_000_000.0)
        names = [f"{prefix}{i:05d}" for i in range(nodes)]
        gpus = [SimulatedGpus(8, seed=i, clock=clock.now) for i in range(nodes)]
        full: list[list[bytes]] = []
        summary: list[list[bytes]] = []
        for r in range(rounds):
            clock.advance(1.0)
            row_full, row_summary = [], []
            for i, name in enumerate(names):
                sample = p.Sample(node=p.Text(name), seq=r + 2, ts=clock.now(), gpus=gpus[i].sample(),
                                  host=p.HostSample(cpu_percent=20.0, mem_used_mb=1e5, mem_total_mb=5e5,
                                                    nics=[p.NicSample(name=p.Text("ib0"), rx_bps=1e9, tx_bps=1e9)]),
                                  trainer=p.TrainerStatus(job=p.Text("llm"), phase=p.Text("training"), step=100 + r,
                                                          loss=2.0, step_time_s=0.5, world_size=nodes * 8))
                row_full.append(p.encode(sample))
                brief = p.summarize(sample)
                brief.every, brief.after = 1.0, r + 1
                row_summary.append(p.encode(brief))
            full.append(row_full)
            summary.append(row_summary)
        return cls(names, gpus[0].info(), full, summary, clock)

    def fresh(self) -> tuple[Any, list[SimpleNamespace]]:
        """A runtime of its own (engine on, not acting, in-memory SQLite) that has had every node's hello."""
        from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
        from gridwatch.wire import protocol as p

        tmp = Path(tempfile.mkdtemp(prefix="gw-frame-"))
        runtime = build_runtime(RuntimeOptions(endpoints=[], key_path=str(tmp / "k"), known_hosts=str(tmp / "kh"),
                                               db_path=":memory:", acting=False), clock=self.clock)
        links = [SimpleNamespace(endpoint=n, name=n) for n in self.names]
        for i, name in enumerate(self.names):
            runtime.store.set_link(name, "connected", name=name)
            runtime.on_frame(links[i], p.Hello(node=p.Text(name), interval=1.0, gpus=self.hello_gpus, ts=self.clock.now()))
        return runtime, links


@dataclass
class Gauge:
    """The in-process cost per summary, measured now: a few of a fleet's summaries fed to a runtime of its own.

    ``feed`` takes a couple of milliseconds; its CPU is counted apart (``cpu_s``) so that the process it runs
    in can leave it out of its own figure.
    """

    fleet: FrameFleet
    runtime: Any = None
    links: list[SimpleNamespace] = field(default_factory=list)
    cpu_s: float = 0.0
    frames: int = 0
    _next: int = 0

    @classmethod
    def make(cls, nodes: int = 200) -> Gauge:
        gauge = cls(FrameFleet.make(nodes, prefix="gauge"))
        gauge.runtime, gauge.links = gauge.fleet.fresh()
        gauge.feed(2 * nodes * len(gauge.fleet.summary), count=False)  # the histories filled: not measured
        return gauge

    def feed(self, frames: int, count: bool = True) -> None:
        from gridwatch.wire import protocol as p

        rows, nodes = self.fleet.summary, len(self.fleet.names)
        t0 = time.process_time()
        for _ in range(frames):
            k = self._next
            self._next += 1
            i, r = k % nodes, (k // nodes) % len(rows)
            if i == 0:
                self.fleet.clock.advance(1.0)
            self.runtime.on_frame(self.links[i], p.decode_agent_frame(rows[r][i]))
        if count:
            self.cpu_s += time.process_time() - t0
            self.frames += frames
