"""Which rank is stuck, in real 3-node jobs (torch, gloo, the coordinator): the culprit is named, not its victims.

One node's worker is frozen (SIGSTOP), spins in Python before its collective, or
is stuck inside one (a simulated GPU hang). The other ranks wait in the
collective and time out; the records read from every trainer's control socket
name the node that held them up, within 30 s of the fault.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from gridwatch.console.demo.cluster import trainer_unavailable
from gridwatch.wire.simdevices import SIM_DEVICES_ENV, DeviceFault, DeviceState, FaultRecord, state_path, write_state
from tests.conftest import wait_until_sync

NODES = ["node-1", "node-2", "node-3"]
CULPRIT = "node-2"
DEADLINE = 4.0  # the collective timeout of these jobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120),
              pytest.mark.skipif(trainer_unavailable() is not None, reason="the trainer is not in this build")]


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from gridwatch.trainer.launch import start_local_run
    from tests.support_trainer import last, tiny

    sim = tmp_path / "sim"
    sim.mkdir(mode=0o700)
    monkeypatch.setenv(SIM_DEVICES_ENV, str(sim))
    cfg = tiny(tmp_path / "run", steps=100_000, tier0_every=1000, tier1_every=1000, tier2_every=1000,
               progress_deadline_s=DEADLINE)
    job = start_local_run(cfg, NODES)
    job.sim = sim
    try:
        wait_until_sync(lambda: job.last_step() >= 3 and last(job).get("world_size") == 3, 90, "three nodes training")
        yield job
    finally:
        job.stop()


def _verdict_after(job, started: float):
    from gridwatch.playbooks.blame_collectives import blame
    from gridwatch.trainer.flight import gather

    sockets = {n: job.socket_path(n) for n in NODES}
    found = []

    def named() -> bool:
        v = blame(asyncio.run(gather(sockets)), min_wait_s=1.0)
        if v is not None and v.culprits:
            found.append(v)
            return True
        return False

    wait_until_sync(named, 30, "a verdict naming the stuck rank")
    return found[0], time.monotonic() - started


def _worker_pid(job, node: str) -> int:
    from gridwatch.wire.controlsock import read_status

    return int(asyncio.run(read_status(job.socket_path(node))).pid or 0)


def _fault(job, fault: DeviceFault) -> None:
    write_state(state_path(job.sim, CULPRIT), DeviceState(node=CULPRIT, faults=[
        FaultRecord(fault=fault, at=time.time(), seq=1)]))


def test_a_frozen_worker_is_blamed_though_the_others_time_out(run) -> None:
    pid = _worker_pid(run, CULPRIT)
    at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        verdict, took = _verdict_after(run, at)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert verdict.nodes == [CULPRIT], verdict.summary
    assert "did not answer" in verdict.summary and took < 30


def test_a_worker_spinning_before_its_collective_never_entered_it(run) -> None:
    at = time.monotonic()
    _fault(run, DeviceFault.SPIN)
    verdict, took = _verdict_after(run, at)
    assert verdict.nodes == [CULPRIT], verdict.summary
    assert "never entered" in verdict.summary and took < 30


def test_a_worker_stuck_inside_its_collective_is_blamed(run) -> None:
    at = time.monotonic()
    _fault(run, DeviceFault.HANG)
    verdict, took = _verdict_after(run, at)
    assert verdict.nodes == [CULPRIT], verdict.summary
    assert "stuck inside" in verdict.summary and took < 30
