"""`gridwatch train --agents ...` runs pre-flight first and launches only on what passed."""

from __future__ import annotations

import asyncio
import sys

from tests.conftest import ROOT, start_agent, stop_agent


async def _train(keys, spec: str, tmp_path, *extra: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gridwatch", "train", "--nodes", "2", "--steps", "10", "--run-dir", str(tmp_path / "run"),
        "--print-torchrun", "--agents", spec, "--key", str(keys.operator_key), "--known-hosts", str(keys.known_hosts),
        "--no-comm", "--gpus", "2", *extra,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode(), err.decode()


async def test_a_failed_node_stops_the_launch_or_is_left_out(keys, tmp_path):
    good = await start_agent(keys, name="node-1")
    bad = await start_agent(keys, name="node-2")
    bad.agent.gpus.inject("ecc-dbe", gpu=0)
    spec = f"{good.spec},{bad.spec}"
    try:
        code, out, err = await _train(keys, spec, tmp_path)
        assert code == 1, (out, err)
        assert "pre-flight failed on 1 node" in err and "node-2" in err and "--exclude-failed" in err
        code, out, err = await _train(keys, spec, tmp_path, "--exclude-failed")
        assert code == 0, (out, err)
        assert "left out node-2" in err
        assert "pre-flight passed: node-1" in out and "--nnodes=1" in out
    finally:
        await stop_agent(good)
        await stop_agent(bad)
