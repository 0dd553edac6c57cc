"""Agents and relays for relay tests: an agent's address, its record of actions, stopping it, a relay as a real process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from pathlib import Path

from gridwatch.sshlink.hostlist import Endpoint
from gridwatch.wire import protocol as p
from tests.conftest import PYTHON, ROOT, RunningAgent


def endpoint(ra: RunningAgent) -> Endpoint:
    return Endpoint("127.0.0.1", ra.port)


def action_events(ra: RunningAgent, action: str) -> list[p.Event]:
    """The agent's own record of what it did: an ``action`` event per action that changed something."""
    frames, _ = ra.agent.ring.since(0)
    events = [p.decode_agent_frame(data) for data in frames]
    return [e for e in events if isinstance(e, p.Event) and e.kind == "action" and e.details.get("action") == action]


async def stop(ra: RunningAgent) -> None:
    ra.agent.stop()
    ra.acceptor.close()
    with contextlib.suppress(asyncio.CancelledError):
        await ra.task


def spawn_relay(keys, port: int, nodes: str, log: Path) -> subprocess.Popen:
    cmd = [PYTHON, "-m", "gridwatch", "relay", "--listen", f"127.0.0.1:{port}", "--nodes", nodes,
           "--name", "rack1", "--keys", str(keys.dir)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
