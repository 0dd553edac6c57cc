"""Many simulated agents in one process, each a real SSH server on its own loopback port.

    .venv/bin/python benchmarks/swarm.py --count 250 --base-port 20000 --keys DIR (from `gridwatch keys init --shared-host-key`) [--gpus 8] [--interval 1]

Prints "ready N" once every agent listens; runs until terminated.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=250)
    ap.add_argument("--base-port", type=int, default=20000)
    ap.add_argument("--keys", required=True, help="a directory made by `gridwatch keys init --shared-host-key` (every swarm agent serves that one host key)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--prefix", default="swarm-")
    args = ap.parse_args()
    asyncio.run(run(args.count, args.base_port, args.keys, args.gpus, args.interval, args.prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
