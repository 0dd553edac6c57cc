"""Pre-flight end to end: real agents on loopback SSH, injected faults, the table and the exit code."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest

from gridwatch.agent.preflight import latest_gpu_samples
from gridwatch.agent.stack import fingerprint, stack_hash
from gridwatch.console.cli import main
from gridwatch.console.fleet.preflight import PreflightOptions, PreflightReport, load_baseline, run_preflight_async
from gridwatch.sshlink.hostlist import parse_endpoints
from gridwatch.wire import protocol as p
from tests.conftest import free_port, start_agent, stop_agent, wait_until

FAST = dict(write_test_mb=1.0, net_sample_s=0.05, connect_timeout=5.0, action_timeout=30.0)


def _other_torch(base: p.StackFingerprint) -> p.StackFingerprint:
    fp = msgspec.structs.replace(base, packages={**base.packages, "torch": p.Text("2.12.0")})
    fp.hash = p.Text(stack_hash(fp))
    return fp


async def _fleet(keys, tmp_path: Path) -> list:
    """node-1 healthy, node-2 with an uncorrected ECC error, node-3 on another torch, node-4 with a skewed clock."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    base = fingerprint(nvml=False)
    agents = []
    for i in range(1, 5):
        ra = await start_agent(keys, name=f"node-{i}", interval=0.2, nics=["lo"], checkpoint_paths=[str(ckpt)], kernel_log=False)
        ra.agent.stack = base
        agents.append(ra)
    agents[1].agent.gpus.inject("ecc-dbe", gpu=0)
    agents[2].agent.stack = _other_torch(base)
    agents[3].agent.clock = lambda: time.time() + 5.0
    await wait_until(lambda: (latest_gpu_samples(agents[1].agent) or [p.GpuSample(index=0)])[0].ecc_dbe, what="the ECC error sampled")
    return agents


async def test_faulty_nodes_fail_and_healthy_node_passes(keys, tmp_path: Path) -> None:
    agents = await _fleet(keys, tmp_path)
    try:
        endpoints = parse_endpoints(",".join(ra.spec for ra in agents))
        progress: list[tuple[int, int]] = []
        options = PreflightOptions(gpus=2, comm=False, on_progress=lambda d, t: progress.append((d, t)), **FAST)
        report = await run_preflight_async(endpoints, str(keys.viewer_key), str(keys.known_hosts), options)
    finally:
        for ra in agents:
            await stop_agent(ra)
    assert report.passed_nodes == ["node-1"]
    assert set(report.failed) == {"node-2", "node-3", "node-4"}
    assert any("uncorrected ECC" in r and r.startswith("gpus:") for r in report.failed["node-2"])
    assert len(report.failed["node-3"]) == 1 and report.failed["node-3"][0].startswith("stack: differs: torch 2.12.0 (baseline ")
    assert len(report.failed["node-4"]) == 1 and report.failed["node-4"][0].startswith("time: clock off by +5.0")
    assert progress[-1] == (4, 4)
    node1 = report.node("node-1")
    assert node1 is not None and node1.checks["storage"].ok and node1.checks["network"].ok
    # The report survives a round trip through JSON, for the console to show later.
    again = PreflightReport.from_json(msgspec.json.decode(msgspec.json.encode(report.to_json())))
    assert again.passed_nodes == report.passed_nodes and again.failed == report.failed


async def test_cli_prints_table_and_exits_1(keys, tmp_path: Path, capsys) -> None:
    agents = await _fleet(keys, tmp_path)
    baseline = tmp_path / "stack.json"
    try:
        spec = ",".join(ra.spec for ra in agents)
        argv = ["preflight", "--nodes", spec, "--key", str(keys.viewer_key), "--known-hosts", str(keys.known_hosts)]
        code = await asyncio.to_thread(main, [*argv, "--gpus", "2", "--no-comm", "--write-test-mb", "1", "--save-baseline", str(baseline)])
    finally:
        for ra in agents:
            await stop_agent(ra)
    out = capsys.readouterr().out
    assert code == 1
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("node-")}
    assert rows["node-1"] == ["node-1", "ok", "ok", "ok", "ok", "ok", "-", "PASS"]
    assert rows["node-2"][1] == "FAIL" and rows["node-2"][-1] == "FAIL"
    assert rows["node-3"][2] == "FAIL"
    assert rows["node-4"][5] == "FAIL"
    assert "node-3  stack: differs: torch 2.12.0" in out
    assert "1 of 4 nodes passed" in out
    # The majority's stack was saved: the next run can be judged against it.
    saved = load_baseline(str(baseline))
    assert saved.packages["torch"] != "2.12.0"


async def test_baseline_file_names_every_differing_node(keys, tmp_path: Path) -> None:
    base = fingerprint(nvml=False)
    agents = [await start_agent(keys, name=f"node-{i}", interval=0.2, kernel_log=False) for i in (1, 2)]
    for ra in agents:
        ra.agent.stack = base
    try:
        options = PreflightOptions(comm=False, baseline=_other_torch(base), baseline_name="baseline stack.json", **FAST)
        endpoints = parse_endpoints(",".join(ra.spec for ra in agents))
        report = await run_preflight_async(endpoints, str(keys.viewer_key), str(keys.known_hosts), options)
    finally:
        for ra in agents:
            await stop_agent(ra)
    assert report.passed_nodes == []
    for name in ("node-1", "node-2"):
        assert "(baseline 2.12.0)" in report.failed[name][0]


def test_cli_no_reachable_node_exits_2(keys, capsys) -> None:
    argv = ["preflight", "--nodes", f"127.0.0.1:{free_port()}", "--key", str(keys.viewer_key), "--known-hosts", str(keys.known_hosts)]
    assert main([*argv, "--no-comm"]) == 2
    captured = capsys.readouterr()
    assert "UNREACHABLE" in captured.out
    assert "no node could be reached" in captured.err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gpus", "-1"], "--gpus must be 0 or more"),
        (["--baseline", "/nonexistent/stack.json"], "cannot read"),
        (["--comm-port", "70000"], "--comm-port must be a TCP port"),
        (["--write-test-mb", "100000"], "--write-test-mb must be at most 64"),
        (["--comm-mb", "2000"], "--comm-mb must be at most"),
    ],
)
def test_cli_bad_args_exit_2_with_one_line(keys, capsys, extra: list[str], message: str) -> None:
    argv = ["preflight", "--nodes", "127.0.0.1:1", "--key", str(keys.viewer_key), "--known-hosts", str(keys.known_hosts)]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bad_baseline_file_is_one_line(keys, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "stack.json"
    bad.write_text("{not json")
    argv = ["preflight", "--nodes", "127.0.0.1:1", "--key", str(keys.viewer_key), "--known-hosts", str(keys.known_hosts)]
    assert main([*argv, "--baseline", str(bad)]) == 2
    assert "not a stack fingerprint" in capsys.readouterr().err
