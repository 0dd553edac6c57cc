"""Many simulated agents in one process, each a real SSH server on its own loopback port.

    .venv/bin/python benchmarks/swarm.py --count 250 --base-port 20000 --keys DIR (from `gridwatch keys init --shared-host-key`) [--gpus 8] [--interval 1] [--control] [--lean]

Prints "ready N" once every agent listens; runs until terminated. With
``--control`` it reads commands on stdin, one a line, and answers each with one
line: ``pause`` (stop sampling, write out everything published, answer the
frames each node sent to each kind of subscriber as JSON), ``resume``, and
``xid PORT GPU CODE`` (inject an XID on that agent's simulated GPU, answer the
wall-clock time it was injected).

With ``--lean`` the swarm spends less per agent without changing a byte of what
a console receives, so that more agents fit on the same cores: one tick
scheduler per process instead of a timer per agent (a tick later than its
interval is skipped and counted, as an agent's own loop skips it), the
process's CPU and RSS (every agent's ``agent`` block: one process) read once a
round, each agent's healthy GPU readings drawn from the simulation for its
first ``REPLAY_ROUNDS`` ticks and replayed after (once a fault is injected that
agent reads the simulation again), and a ring of ``LEAN_RING`` frames. ``pause`` then also answers, per node, the
samples that were due since the last ``resume`` and those ticked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REPLAY_ROUNDS = 16  # --lean: distinct rounds of GPU readings per agent before they repeat
# --lean: frames each agent keeps for a console to resume from (two minutes at 1 s, against ten): at
# thousands of agents in a few processes the rings are most of the memory; a console further behind sees a gap.
LEAN_RING = 120


def lean_gpus(count: int, seed: int):  # noqa: ANN201 - a SimulatedGpus
    """Simulated GPUs whose healthy readings repeat after ``REPLAY_ROUNDS`` ticks; faulted ones are simulated again."""
    import msgspec

    from gridwatch.agent.sources.simulated import SimulatedGpus

    class ReplayedGpus(SimulatedGpus):
        def __init__(self) -> None:
            super().__init__(count, seed=seed)
            self._rounds: list[list] = []
            self._next = 0
            self._faulted = False

        def sample(self) -> list:
            if self._faulted:
                return super().sample()
            if len(self._rounds) < REPLAY_ROUNDS:
                # Kept as frames carry them (per-link NVLink rates stay on /metrics, which the swarm does not serve).
                self._rounds.append([msgspec.structs.replace(g, nvlink_link_tx_bps=[], nvlink_link_rx_bps=[])
                                     for g in super().sample()])
                return self._rounds[-1]
            self._next += 1
            return self._rounds[self._next % REPLAY_ROUNDS]

        def inject(self, kind: str, gpu: int | None = None, code: int | None = None) -> str:
            self._faulted = True
            return super().inject(kind, gpu, code)

    return ReplayedGpus()


class SharedProcess:
    """The swarm process's CPU % and RSS, read once per ``every`` seconds for all its agents (they are one process)."""

    def __init__(self, every: float) -> None:
        import psutil

        self._proc = psutil.Process()
        self._proc.cpu_percent(None)
        self._every = every
        self._at = -1e9
        self._cpu = 0.0
        self._mem = self._proc.memory_info()

    def _read(self) -> None:
        now = time.monotonic()
        if now - self._at >= self._every:
            self._at, self._cpu, self._mem = now, self._proc.cpu_percent(None), self._proc.memory_info()

    def cpu_percent(self, interval: None = None) -> float:
        self._read()
        return self._cpu

    def memory_info(self):  # noqa: ANN201 - psutil's pmem
        self._read()
        return self._mem


class Ticker:
    """--lean: one scheduler ticks every agent of the process on its staggered slot; a late tick is skipped."""

    def __init__(self, agents: list, interval: float) -> None:
        self.agents = agents
        self.interval = interval
        self.ticked = [0] * len(agents)
        self.skipped = [0] * len(agents)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        n, interval = len(self.agents), self.interval
        start = loop.time()
        k = 0  # the slot: agent k % n, its round k // n
        while True:
            due = start + (k // n) * interval + (k % n) * interval / n
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            i = k % n
            if loop.time() - due > interval:
                self.skipped[i] += 1  # this round's tick for this agent came too late: an overrun
            else:
                try:
                    self.agents[i].tick()
                except Exception:  # a source bug must not stop the others' heartbeat
                    pass
                self.ticked[i] += 1
            k += 1

    def reset(self) -> None:
        self.ticked = [0] * len(self.agents)
        self.skipped = [0] * len(self.agents)


async def start_agents(count: int, base_port: int, keys: str, gpus: int, interval: float, prefix: str,
                       lean: bool = False) -> list:
    """``count`` agents serving SSH on consecutive loopback ports, not yet sampling (call their ``run``)."""
    from loguru import logger

    from gridwatch.agent.agent import Agent
    from gridwatch.agent.config import AgentConfig
    from gridwatch.agent.server import serve
    from gridwatch.agent.sources.simulated import SimulatedGpus

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    k = Path(keys)
    agents = []
    shared = SharedProcess(interval / 2) if lean else None
    for port in range(base_port, base_port + count):
        cfg = AgentConfig(
            node_name=f"{prefix}{port}", listen=f"127.0.0.1:{port}", host_key=str(k / "agent_host_key"),
            authorized_viewers=str(k / "authorized_viewers"), authorized_operators=str(k / "authorized_operators"),
            interval=interval, ring_frames=LEAN_RING if lean else 600,
            jobs_every=0,  # simulated nodes of one host: the host's jobs are no node's
        )
        agent = Agent(cfg, gpus=lean_gpus(gpus, port) if lean else SimulatedGpus(gpus, seed=port))
        if shared is not None:
            agent._proc = shared  # type: ignore[assignment]
        await serve(agent, "127.0.0.1", port)
        agents.append(agent)
    return agents


async def run(count: int, base_port: int, keys: str, gpus: int, interval: float, prefix: str) -> None:
    agents = await start_agents(count, base_port, keys, gpus, interval, prefix)
    print(f"ready {count}", flush=True)
    loop = asyncio.get_running_loop()
    # Stagger the agents across the interval, as independent nodes would be.
    for i, agent in enumerate(agents):
        loop.call_later(interval * i / count, lambda a=agent: asyncio.ensure_future(a.run()))
    await asyncio.Event().wait()


async def run_controlled(count: int, base_port: int, keys: str, gpus: int, interval: float, prefix: str,
                         lean: bool = False) -> None:
    """The swarm, driven on stdin (see the module's text): a benchmark counts what was sent against what arrived."""
    from gridwatch.wire.protocol import StreamMode

    agents = await start_agents(count, base_port, keys, gpus, interval, prefix, lean)
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []
    starts: list[asyncio.TimerHandle] = []
    ticker = Ticker(agents, interval) if lean else None

    def resume() -> None:
        if ticker is not None:
            ticker.reset()
            tasks.append(asyncio.ensure_future(ticker.run()))
            return
        starts[:] = [loop.call_later(interval * i / count, lambda a=agent: tasks.append(asyncio.ensure_future(a.run())))
                     for i, agent in enumerate(agents)]

    async def pause() -> str:
        for start in starts:
            start.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        tasks.clear()
        deadline = time.monotonic() + 60
        while any(c.subscribed and c.cursor < a.ring.last_seq for a in agents for c in a.clients):
            if time.monotonic() > deadline:
                return json.dumps({"error": "subscribers still behind after 60 s"})
            await asyncio.sleep(0.05)
        sent = {}
        for port, agent in enumerate(agents, base_port):
            by_mode = {str(m): 0 for m in StreamMode}
            for client in agent.clients:
                by_mode[str(client.mode)] += client.sent
            sent[port] = by_mode
        ticks = {}
        if ticker is not None:
            # Since the last resume: the ticks each agent was due (ticked or skipped as too late) and those ticked.
            ticks = {"due": sum(ticker.ticked) + sum(ticker.skipped), "ticked": sum(ticker.ticked),
                     "agents_short": sum(1 for s in ticker.skipped if s)}
        return json.dumps({"sent": sent, "ticks": ticks, "dropped": sum(a.dropped_frames for a in agents),
                           "published": sum(a.ring.last_seq for a in agents),
                           "clients": sum(1 for a in agents for c in a.clients if c.subscribed)})

    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(f"ready {count}", flush=True)
    resume()
    while line := (await reader.readline()).decode().strip():
        words = line.split()
        if words[0] == "pause":
            print(await pause(), flush=True)
        elif words[0] == "resume":
            resume()
            print("resumed", flush=True)
        elif words[0] == "xid":
            port, gpu, code = map(int, words[1:4])
            agents[port - base_port].gpus.inject("xid", gpu=gpu, code=code)  # type: ignore[union-attr]
            print(f"injected {time.time():.6f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=250)
    ap.add_argument("--base-port", type=int, default=20000)
    ap.add_argument("--keys", required=True, help="a directory made by `gridwatch keys init --shared-host-key` (every swarm agent serves that one host key)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--prefix", default="swarm-")
    ap.add_argument("--control", action="store_true", help="take pause/resume/xid commands on stdin")
    ap.add_argument("--lean", action="store_true",
                    help="with --control: spend less per agent, the frames unchanged (see the module's text)")
    args = ap.parse_args()
    if args.lean:
        asyncio.run(run_controlled(args.count, args.base_port, args.keys, args.gpus, args.interval, args.prefix, lean=True))
        return 0
    runner = run_controlled if args.control else run
    asyncio.run(runner(args.count, args.base_port, args.keys, args.gpus, args.interval, args.prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
