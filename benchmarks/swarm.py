"""Many simulated agents in one process, each a real SSH server on its own loopback port.

    .venv/bin/python benchmarks/swarm.py --count 250 --base-port 20000 --keys DIR (from `gridwatch keys init --shared-host-key`) [--gpus 8] [--interval 1] [--control]

Prints "ready N" once every agent listens; runs until terminated. With
``--control`` it reads commands on stdin, one a line, and answers each with one
line: ``pause`` (stop sampling, write out everything published, answer the
frames each node sent to each kind of subscriber as JSON), ``resume``, and
``xid PORT GPU CODE`` (inject an XID on that agent's simulated GPU, answer the
wall-clock time it was injected).
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


async def start_agents(count: int, base_port: int, keys: str, gpus: int, interval: float, prefix: str) -> list:
    """``count`` agents serving SSH on consecutive loopback ports, not yet sampling (call their ``run``)."""
    from loguru import logger

    from agents.agent import Agent
    from agents.config import AgentConfig
    from agents.server import serve
    from agents.sources.simulated import SimulatedGpus

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    k = Path(keys)
    agents = []
    for port in range(base_port, base_port + count):
        cfg = AgentConfig(
            node_name=f"{prefix}{port}", listen=f"127.0.0.1:{port}", host_key=str(k / "agent_host_key"),
            authorized_viewers=str(k / "authorized_viewers"), authorized_operators=str(k / "authorized_operators"),
            interval=interval, ring_frames=600,
        )
        agent = Agent(cfg, gpus=SimulatedGpus(gpus, seed=port))
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


async def run_controlled(count: int, base_port: int, keys: str, gpus: int, interval: float, prefix: str) -> None:
    """The swarm, driven on stdin (see the module's text): a benchmark counts what was sent against what arrived."""
    from agents.protocol import StreamMode

    agents = await start_agents(count, base_port, keys, gpus, interval, prefix)
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []
    starts: list[asyncio.TimerHandle] = []

    def resume() -> None:
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
        return json.dumps({"sent": sent, "dropped": sum(a.dropped_frames for a in agents),
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
    args = ap.parse_args()
    runner = run_controlled if args.control else run
    asyncio.run(runner(args.count, args.base_port, args.keys, args.gpus, args.interval, args.prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
