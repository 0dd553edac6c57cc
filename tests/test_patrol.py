"""The patrol: cheap checks on a schedule of an injected clock, events only when health changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from gridwatch.agent.agent import Agent
from gridwatch.agent.config import AgentConfig
from gridwatch.agent.patrol import Patrol, start_patrol
from gridwatch.agent.preflight import NicCounters, NicLink
from gridwatch.agent.sources.simulated import SimulatedGpus
from gridwatch.sshlink.server import Caller
from gridwatch.wire import protocol as p
from tests.conftest import start_agent, stop_agent, wait_until

OPERATOR = Caller(username="op", role="operator", key="SHA256:test")


def _events(agent: Agent, kind: str) -> list[p.Event]:
    frames, _ = agent.ring.since(0)
    decoded = (p.decode_agent_frame(f) for f in frames)
    return [f for f in decoded if isinstance(f, p.Event) and f.kind == kind]


async def test_patrol_raises_failed_once_then_recovered(tmp_path: Path) -> None:
    agent = Agent(AgentConfig(node_name="n1", checkpoint_paths=[str(tmp_path)]), gpus=SimulatedGpus(2, seed=1))
    patrol = Patrol(agent, interval=60.0, clock=lambda: 0.0)
    agent.tick()
    assert patrol.step(0.0).ok
    agent.gpus.inject("ecc-dbe", gpu=1)
    agent.tick()
    assert patrol.step(30.0) is None  # not due yet
    result = patrol.step(60.0)
    assert result is not None and list(result.failures) == ["gpus"]
    patrol.step(120.0)  # still failing the same way: no second event
    failed = _events(agent, "patrol_failed")
    assert len(failed) == 1
    assert failed[0].severity == "error" and failed[0].details["checks"] == "gpus"
    assert "GPU 1: 1 uncorrected ECC error(s)" in failed[0].message
    assert (await agent.act(OPERATOR, p.Action(id=p.Text("1"), action=p.Text("clear_faults")))).ok
    agent.tick()
    assert patrol.step(180.0).ok
    recovered = _events(agent, "patrol_recovered")
    assert len(recovered) == 1 and recovered[0].message == "patrol: checks pass again (were failing: gpus)"


async def test_patrol_sees_nic_errors_climbing_between_rounds() -> None:
    counters = {"eth0": NicCounters(0, 0)}
    agent = Agent(AgentConfig(node_name="n1", nics=["eth0"]), gpus=None)
    patrol = Patrol(
        agent, interval=10.0, clock=lambda: 0.0, nic_counters=lambda: dict(counters), nic_links=lambda: {"eth0": NicLink(True, None)}
    )
    assert patrol.step(0.0).ok
    counters["eth0"] = NicCounters(12, 0)
    result = patrol.step(10.0)
    assert result.failures == {"network": "eth0 errors climbing (+12 rx, +0 tx in 10.0 s)"}
    assert patrol.step(20.0).ok  # the counter stopped climbing
    assert len(_events(agent, "patrol_failed")) == 1 and len(_events(agent, "patrol_recovered")) == 1


async def test_patrol_during_training_ignores_busy_gpus() -> None:
    agent = Agent(AgentConfig(node_name="n1"), gpus=SimulatedGpus(2, seed=1))
    agent.tick()
    assert Patrol(agent, interval=1.0).step(0.0).ok


async def test_started_patrol_publishes_on_a_running_agent(keys) -> None:
    ra = await start_agent(keys, name="node-1", interval=0.05, patrol_interval=0.05, kernel_log=False)
    assert start_patrol(Agent(AgentConfig(node_name="off"))) is None
    patrol = start_patrol(ra.agent)
    try:
        assert patrol is not None
        ra.agent.gpus.inject("fell-off-bus", gpu=0)
        await wait_until(lambda: _events(ra.agent, "patrol_failed"), what="a patrol_failed event")
    finally:
        patrol.stop()
        await stop_agent(ra)
    assert "GPU 0 fell off the bus" in _events(ra.agent, "patrol_failed")[0].message


def test_patrol_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="patrol interval must be positive"):
        Patrol(Agent(AgentConfig(node_name="n1")), interval=0.0)


async def test_every_sample_says_whether_the_patrol_passes(tmp_path: Path) -> None:
    agent = Agent(AgentConfig(node_name="n1", checkpoint_paths=[str(tmp_path)]), gpus=SimulatedGpus(2, seed=1))

    def last_sample() -> p.Sample:
        frames, _ = agent.ring.since(0)
        return [f for f in map(p.decode_agent_frame, frames) if isinstance(f, p.Sample)][-1]

    agent.tick()
    assert last_sample().patrol_failing is None  # no patrol on this node
    agent.patrol = Patrol(agent, interval=60.0, clock=lambda: 0.0)
    agent.patrol.step(0.0)
    agent.tick()
    assert last_sample().patrol_failing == []
    agent.gpus.inject("ecc-dbe", gpu=1)
    agent.tick()
    agent.patrol.step(60.0)
    agent.tick()
    assert last_sample().patrol_failing == ["gpus"]
