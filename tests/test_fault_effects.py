"""Simulated GPU faults hurt the trainer beside them as real ones would: hangs, CUDA errors, slow steps, timeouts.

The agent's inject_fault (over real SSH) writes the node's fault file and the
driver's lines to its simulated kernel log; real 2-node training jobs (torch,
gloo, the coordinator) read the file through the simulated-device hook and
react. The collective timeout of these jobs is their progress deadline.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from gridwatch.agent.detectors import detect
from gridwatch.console.demo.cluster import trainer_unavailable
from gridwatch.wire.simdevices import (
    SIM_DEVICES_ENV,
    DeviceFault,
    DeviceState,
    FaultRecord,
    kernel_log_path,
    read_state,
    state_path,
    write_state,
)
from tests.conftest import wait_until, wait_until_sync
from tests.support_trainer import last, tiny

NODES = ["node-1", "node-2"]


@pytest.fixture
def sim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "sim"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv(SIM_DEVICES_ENV, str(directory))
    return directory


def _fault(sim: Path, node: str, *faults: DeviceFault) -> float:
    at = time.time()
    write_state(state_path(sim, node), DeviceState(node=node, faults=[
        FaultRecord(fault=f, at=at, seq=i + 1) for i, f in enumerate(faults)]))
    return at


# ------------------------------------------------------------------ the file


def test_a_missing_garbled_foreign_or_open_file_reads_healthy(sim: Path) -> None:
    path = state_path(sim, "node-1")
    assert read_state(path, "node-1").faults == []
    path.write_bytes(b"\x00{not json")
    path.chmod(0o600)
    assert read_state(path, "node-1").faults == []
    _fault(sim, "node-2", DeviceFault.LOST)
    os.replace(state_path(sim, "node-2"), path)  # another node's file under this name
    assert read_state(path, "node-1").faults == []
    _fault(sim, "node-1", DeviceFault.LOST)
    assert [f.fault for f in read_state(path, "node-1").faults] == [DeviceFault.LOST]
    path.chmod(0o644)  # a file others could have written is not believed
    assert read_state(path, "node-1").faults == []
    sim.chmod(0o777)
    with pytest.raises(PermissionError):
        _fault(sim, "node-1", DeviceFault.LOST)


async def test_inject_fault_tells_the_trainer_and_writes_the_drivers_kernel_lines(sim: Path, agent, keys) -> None:
    from gridwatch.sshlink.client import Fleet, FleetOptions
    from gridwatch.sshlink.hostlist import parse_endpoints

    fleet = Fleet(parse_endpoints(agent.spec), FleetOptions(key_path=str(keys.operator_key),
                                                           known_hosts=str(keys.known_hosts)))
    await fleet.start()
    try:
        await wait_until(lambda: fleet.connected, what="connection")
        assert (await fleet.action("node-1", "inject_fault", {"kind": "xid", "code": 79, "gpu": 1})).ok
        state = read_state(state_path(sim, "node-1"), "node-1")
        assert [(f.fault, f.gpu, f.code) for f in state.faults] == [(DeviceFault.LOST, 1, 79)]
        assert oct(state_path(sim, "node-1").stat().st_mode & 0o777) == "0o600"
        lines = kernel_log_path(sim, "node-1").read_text().splitlines()
        # The agent's own detectors read the line as the real driver's: XID 79 on GPU 1's PCI address.
        events = [e for e in (detect(line) for line in lines) if e is not None and e.kind == "xid"]
        assert events and events[0].code == 79, lines
        assert "GPU has fallen off the bus" in lines[0] and "kernel: NVRM: Xid (PCI:0000:2a:00): 79" in lines[0]
        assert (await fleet.action("node-1", "inject_fault", {"kind": "thermal"})).ok
        kinds = [f.fault for f in read_state(state_path(sim, "node-1"), "node-1").faults]
        assert kinds == [DeviceFault.LOST, DeviceFault.THERMAL]
        assert (await fleet.action("node-1", "clear_faults")).ok
        assert read_state(state_path(sim, "node-1"), "node-1").faults == []
    finally:
        await fleet.stop()


def test_a_throttled_gpu_makes_the_steps_slower() -> None:
    from gridwatch.trainer.simdevice import THERMAL_SLOWDOWN, SimDevice

    slept: list[float] = []
    hook = SimDevice.__new__(SimDevice)
    hook.sleep = slept.append
    hook.state = lambda: DeviceState(node="n", faults=[FaultRecord(fault=DeviceFault.THERMAL, at=0.0)])  # type: ignore[method-assign]
    hook.throttle(0.10)
    assert slept and abs(0.10 + slept[0] - 0.10 * THERMAL_SLOWDOWN) < 1e-9  # 1.8x the compute time
    hook.state = lambda: DeviceState(node="n")  # type: ignore[method-assign]
    hook.throttle(0.10)
    assert len(slept) == 1


# ------------------------------------------------------------ real jobs


def _log(run, node: str) -> str:
    try:
        return (run.run_dir / "logs" / f"{node}.log").read_text(errors="replace")
    except OSError:
        return ""


def _start(tmp_path: Path, deadline: float):
    from gridwatch.trainer.launch import start_local_run

    cfg = tiny(tmp_path / "run", steps=100_000, tier0_every=3, tier1_every=1000, tier2_every=1000,
               progress_deadline_s=deadline)
    run = start_local_run(cfg, NODES)
    wait_until_sync(lambda: run.last_step() >= 3 and last(run).get("world_size") == 2, 90, "both nodes training")
    return run


def _trains_on(run, world: int, steps: int = 3, timeout: float = 60) -> None:
    start = run.last_step()
    wait_until_sync(lambda: run.last_step() >= start + steps and last(run).get("world_size") == world, timeout,
                    f"training on {world} node(s) past step {start + steps}; logs in {run.run_dir / 'logs'}")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(trainer_unavailable() is not None, reason="the trainer is not in this build")
def test_crash_ecc_and_lost_gpu_hurt_the_job_as_real_ones_do(tmp_path: Path, sim: Path) -> None:
    timeout = 4.0
    run = _start(tmp_path, timeout)
    try:
        # XID 13: the running worker dies with an illegal memory access; its restart trains (the node is healthy).
        _fault(sim, "node-2", DeviceFault.APP_CRASH)
        wait_until_sync(lambda: "CUDA error: an illegal memory access was encountered" in _log(run, "node-2"), 30,
                        "node-2's worker to crash")
        _trains_on(run, 2, timeout=90)
        assert _log(run, "node-2").count("RuntimeError: CUDA error: an illegal memory access") == 1

        # XID 48: the worker dies with the ECC error, and so does each new one until the GPU is reset.
        _fault(sim, "node-2", DeviceFault.ECC_DBE)
        wait_until_sync(lambda: _log(run, "node-2").count("RuntimeError: CUDA error: uncorrectable ECC error") >= 2, 90,
                        "node-2's worker and its restart to fail on the ECC error")
        _trains_on(run, 1)
        _fault(sim, "node-2")  # reset: node-2's next start joins again
        _trains_on(run, 2, timeout=90)

        # XID 79: node-2 blocks in its collective; node-1 waits out the collective timeout, then
        # both end as NCCL's watchdog and the CUDA error end them, and torchrun starts them again.
        at = _fault(sim, "node-2", DeviceFault.LOST)
        wait_until_sync(lambda: "CUDA error: unspecified launch failure" in _log(run, "node-2")
                        and "Watchdog caught collective operation timeout" in _log(run, "node-1"), 60,
                        "the lost GPU's error and its peer's collective timeout")
        waited = time.time() - at
        assert waited >= timeout * 0.9, f"the job noticed after {waited:.1f} s, before its collective timeout"
        assert f"Timeout(ms)={int(timeout * 1000)}" in _log(run, "node-1")
        _fault(sim, "node-2")
        _trains_on(run, 2, timeout=120)
        assert "restarted by torchrun" in _log(run, "node-1"), "the watchdog's exit restarts node-1's worker too"
    finally:
        run.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(trainer_unavailable() is not None, reason="the trainer is not in this build")
def test_flap_hang_and_a_lost_gpu_that_is_told_to_leave(tmp_path: Path, sim: Path) -> None:
    from gridwatch.wire.controlsock import request

    timeout = 8.0
    run = _start(tmp_path, timeout)
    try:
        # A link flap: collectives slow, then fail with NCCL's network error; the job re-forms and goes on.
        _fault(sim, "node-2", DeviceFault.LINK_FLAP)
        wait_until_sync(lambda: "NET/IB : Got completion from peer" in _log(run, "node-2"), 30, "the flap's error")
        _trains_on(run, 2, timeout=60)

        # A hang: stuck in the collective; the peer times out; once the fault is cleared the job trains again.
        _fault(sim, "node-2", DeviceFault.HANG)
        wait_until_sync(lambda: "Watchdog caught collective operation timeout" in _log(run, "node-1"), 40,
                        "node-1's collective timeout")
        assert "CUDA error" not in _log(run, "node-2")
        _fault(sim, "node-2")
        _trains_on(run, 2, timeout=120)

        # XID 79 with the operator acting: asked to leave, the lost node goes at once, long before the timeout.
        _fault(sim, "node-2", DeviceFault.LOST)
        wait_until_sync(lambda: "fell off the bus: blocked" in _log(run, "node-2"), 30, "node-2 to block")
        asked = time.monotonic()
        reply = asyncio.run(request(run.socket_path("node-2"), "leave", {}))
        assert reply.ok, reply.message
        _trains_on(run, 1, steps=2, timeout=30)
        assert time.monotonic() - asked < timeout, "the job went on without the lost node before its collective timeout"
        assert "CUDA error" not in _log(run, "node-2")
        wait_until_sync(lambda: run.nodes["node-2"].poll() is not None, 30, "node-2's trainer to exit")
        assert run.nodes["node-2"].returncode == 0
    finally:
        run.stop()
