"""The checks a node runs on itself: GPUs, NICs, storage, bad args, and torch kept out of the agent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gridwatch.agent.agent import Agent
from gridwatch.agent.config import AgentConfig
from gridwatch.agent.preflight import NicCounters, NicLink, PreflightArgs, check_gpus, check_storage, judge_nics, run_checks
from gridwatch.agent.sources.simulated import SimulatedGpus
from gridwatch.sshlink.server import Caller
from gridwatch.wire import protocol as p
from tests.conftest import ROOT

OPERATOR = Caller(username="op", role="operator", key="SHA256:test")


def _agent(gpus: int = 2, **cfg: object) -> Agent:
    return Agent(AgentConfig(node_name="n1", **cfg), gpus=SimulatedGpus(gpus, seed=1) if gpus else None)


def _action(name: str, **args: object) -> p.Action:
    return p.Action(id=p.Text("1"), action=p.Text(name), args=args)


def test_healthy_gpus_pass_and_a_missing_gpu_count_fails() -> None:
    agent = _agent(gpus=2)
    agent.tick()
    assert check_gpus(agent, PreflightArgs(gpus=2), agent.clock()).ok
    short = check_gpus(agent, PreflightArgs(gpus=8), agent.clock())
    assert not short.ok and short.detail == "2 GPUs found, expected 8"
    none = check_gpus(_agent(gpus=0), PreflightArgs(gpus=1), 0.0)
    assert not none.ok and "no GPUs on this node" in none.detail


async def test_pending_xid_fails_until_faults_are_cleared() -> None:
    agent = _agent(gpus=2)
    agent.gpus.inject("xid", gpu=1, code=48)
    agent.tick()
    out = check_gpus(agent, PreflightArgs(), agent.clock())
    assert not out.ok and out.detail.startswith("XID 48 on GPU 1 at ") and out.detail.endswith("not cleared")
    assert (await agent.act(OPERATOR, _action("clear_faults"))).ok
    agent.tick()
    assert check_gpus(agent, PreflightArgs(), agent.clock()).ok


def test_thermal_throttle_and_lost_gpu_are_named() -> None:
    agent = _agent(gpus=2)
    agent.gpus.inject("thermal", gpu=0)
    agent.gpus.inject("fell-off-bus", gpu=1)
    agent.tick()
    out = check_gpus(agent, PreflightArgs(), agent.clock())
    assert out.values["problems"] == ["GPU 0 throttled (hw_thermal, sw_thermal)", "GPU 1 fell off the bus"]


def test_nics_down_missing_slow_or_with_climbing_errors_fail() -> None:
    links = {"eth0": NicLink(True, 100000.0), "eth1": NicLink(False, None), "eth2": NicLink(True, 25000.0)}
    before = {"eth0": NicCounters(0, 0), "eth2": NicCounters(5, 0)}
    after = {"eth0": NicCounters(0, 0), "eth2": NicCounters(9, 1)}
    ok = judge_nics(["eth0"], links, before, after, 0.5, speed_mbps=100000.0)
    assert ok.ok
    bad = judge_nics(["eth0", "eth1", "eth2", "ib9"], links, before, after, 0.5, speed_mbps=100000.0)
    assert bad.values["nics"]["eth2"]["rx_errors"] == 9
    assert not bad.ok
    assert bad.values["problems"] == [
        "eth1 is down",
        "eth2 at 25000 Mb/s, expected 100000",
        "eth2 errors climbing (+4 rx, +1 tx in 0.5 s)",
        "ib9: no such interface",
    ]
    assert bad.detail.endswith("(+1 more)")  # the table's line stays one line


def test_storage_space_and_write_test(tmp_path: Path) -> None:
    ok = check_storage([str(tmp_path)], need_gb=0.001, write_mb=1.0, min_write_mbps=0.0)
    assert ok.ok and ok.values["paths"][str(tmp_path)]["write_mbps"] > 0
    assert list(tmp_path.iterdir()) == []  # the test file is gone
    short = check_storage([str(tmp_path)], need_gb=1e9, write_mb=0.0, min_write_mbps=0.0)
    assert not short.ok and "a checkpoint needs 1e+09 GB" in short.detail
    missing = check_storage([str(tmp_path / "nope")], need_gb=0.0, write_mb=1.0, min_write_mbps=0.0)
    assert not missing.ok and missing.detail.endswith("nope does not exist or is not a directory")


async def test_bad_args_are_refused_in_one_line() -> None:
    agent = _agent()
    res = await run_checks(agent, _action("preflight", checks=["gpus", "vibes"]))
    assert not res.ok and res.message == "unknown check(s) vibes; known: gpus, stack, network, storage, time, comm"
    res = await run_checks(agent, _action("preflight", gpus="two"))
    assert not res.ok and res.message.startswith("bad preflight args: Expected `int | null`")
    res = await run_checks(agent, _action("preflight", checks=["comm"]), "operator")
    assert not res.ok and "needs comm args" in res.message


def test_agent_checks_do_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import asyncio, sys\n"
        "from gridwatch.wire import protocol as p\n"
        "from gridwatch.agent.agent import Agent\n"
        "from gridwatch.agent.config import AgentConfig\n"
        "from gridwatch.agent.preflight import run_checks\n"
        f"a = Agent(AgentConfig(node_name='n', checkpoint_paths=[{str(tmp_path)!r}], nics=['lo']))\n"
        "r = asyncio.run(run_checks(a, p.Action(id=p.Text('1'), action=p.Text('preflight'), args={'net_sample_s': 0.01, 'write_test_mb': 1})))\n"
        "print(r.ok, sorted(r.data), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True ['gpus', 'network', 'stack', 'storage', 'time'] False", out.stderr[-500:]
