"""The closed loop end to end: a fault on a GPU, the console detects it, the playbook acts, training goes on.

Real agent processes on loopback, the real trainer (torch, gloo), real SSH,
every shipped playbook and a real SQLite incident store. When training does
not come back, the failure message carries the tail of each trainer node's
log: where a re-formation stopped is the first thing to know.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gridwatch.console.demo.chaos import FaultSpec
from gridwatch.console.demo.cluster import ClusterOptions, trainer_unavailable
from gridwatch.console.demo.session import DemoOptions, DemoSession
from tests.conftest import wait_until

TINY_TRAINER = ["--dim=32", "--heads=2", "--layers=1", "--micro-batches=1", "--tiers=5,10,30"]


def _session(tmp_path: Path, trainer: bool) -> DemoSession:
    return DemoSession(DemoOptions(
        cluster=ClusterOptions(nodes=3, gpus=2, interval=0.5, trainer=trainer, trainer_args=TINY_TRAINER),
        directory=str(tmp_path / "demo"), tick_interval=0.25,
    ))


def _incidents(session: DemoSession, playbook: str) -> list:
    return [i for i in session.store.incidents() if i.playbook == playbook]


def _trainer_tail(tmp_path: Path, lines: int = 4) -> str:
    out = []
    for log in sorted((tmp_path / "demo" / "run" / "logs").glob("node-*.log")):
        text = [ln for ln in log.read_text(errors="replace").splitlines()
                if ln.strip() and not ln.startswith((" ", "Traceback")) and "NumPy" not in ln]
        out.append(f"{log.stem}: " + " | ".join(t[:160] for t in text[-lines:]))
    return "\n".join(out)


async def _wait_training(tmp_path: Path, cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    try:
        await wait_until(cond, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_trainer_tail(tmp_path)}") from None


def _out(session: DemoSession) -> set[str]:
    return {n.name for n in session.engine.nodes.values() if n.out}


@pytest.mark.timeout(150)
@pytest.mark.skipif(trainer_unavailable() is not None, reason="the trainer is not in this build")
async def test_application_xid_isolates_nothing_and_hardware_xid_moves_training_off_the_node(tmp_path: Path) -> None:
    session = _session(tmp_path, trainer=True)
    try:
        await session.start()
        await session.attach()
        await session.wait_connected(30)
        await _wait_training(tmp_path, lambda: (session.watch.last_step or 0) >= 15, 90, "training to reach step 15")

        # XID 13 is the program's fault, not the GPU's: notify only.
        assert (await session.inject("node-1", FaultSpec("xid", 13), gpu=1)).ok
        await wait_until(lambda: _incidents(session, "xid-application"), 10, "the XID 13 incident")
        app = _incidents(session, "xid-application")[0]
        await wait_until(lambda: all(s.state == "done" for s in session.store.steps(app.id)), 10, "its notify")
        assert [s.step for s in session.store.steps(app.id)] == ["notify"]
        assert _out(session) == set()

        # XID 79 on node-2: scene kept, node-2 out, training resumed on node-1 and node-3.
        assert (await session.inject("node-2", FaultSpec("xid", 79), gpu=0)).ok
        await wait_until(lambda: _incidents(session, "xid-hardware"), 10, "the XID 79 incident")
        inc = _incidents(session, "xid-hardware")[0]
        assert inc.node == "node-2"
        await wait_until(lambda: all(s.state not in ("planned", "running") for s in session.store.steps(inc.id)),
                         60, "the plan to finish")
        steps = {s.step: s for s in session.store.steps(inc.id)}
        for name in ("capture_scene", "isolate_node", "restart_from_checkpoint"):
            assert steps[name].state == "done", f"{name}: {steps[name].state} {steps[name].outcome}"
        assert "node-2" not in steps["restart_from_checkpoint"].planned.nodes
        scenes = list((tmp_path / "demo" / "scenes" / "node-2").glob("*/frames.jsonl"))
        assert scenes and scenes[0].stat().st_size > 0
        audit = session.store.audit_log(inc.id)
        for name in ("capture_scene", "isolate_node", "restart_from_checkpoint"):
            phases = [a.phase for a in audit if a.what.startswith(name)]
            assert phases == ["before", "after"], (name, phases)
        assert _out(session) == {"node-2"}

        await _wait_training(tmp_path, lambda: session.summary().incidents and any(
            r.recovered_s is not None for r in session.summary().incidents if r.id == inc.id), 90, "training to resume")
        # Rank 0 reports the world it trained with: the two nodes left.
        await _wait_training(tmp_path, lambda: session.watch.points[-1].world == 2, 30,
                             "steps trained by the two remaining nodes")
    finally:
        await session.close()


@pytest.mark.timeout(120)
async def test_a_killed_agent_is_lost_not_out_and_its_next_hardware_fault_is_handled(tmp_path: Path) -> None:
    session = _session(tmp_path, trainer=False)
    try:
        await session.start()
        await session.attach()
        await session.wait_connected(30)
        assert (await session.inject("node-3", FaultSpec("agent-kill"))).ok
        await wait_until(lambda: _incidents(session, "heartbeat-lost"), 30, "the heartbeat-lost incident")
        inc = _incidents(session, "heartbeat-lost")[0]
        assert inc.node == "node-3"
        await wait_until(lambda: any(s.step == "isolate_node" and s.state in ("done", "failed")
                                     for s in session.store.steps(inc.id)), 30, "the isolate step")
        isolate = next(s for s in session.store.steps(inc.id) if s.step == "isolate_node")
        assert isolate.state == "failed", isolate.outcome  # a dead agent cannot be isolated ...
        assert _out(session) == set()  # ... so node-3 is lost, not out of the job (no scheduler drained it)
        assert session.engine.nodes["node-3"].lost
        assert any(a.what.startswith("isolate_node") and a.phase == "before" for a in session.store.audit_log(inc.id))

        # The agent comes back, and then a real hardware fault: its own incident, scene and isolation.
        assert session.cluster.respawn_agent("node-3")
        await wait_until(lambda: not session.engine.nodes["node-3"].lost, 30, "node-3 reporting again")
        assert (await session.inject("node-3", FaultSpec("xid", 79), gpu=0)).ok
        await wait_until(lambda: _incidents(session, "xid-hardware"), 15, "the XID 79 incident on node-3")
        hw = _incidents(session, "xid-hardware")[0]
        assert hw.node == "node-3"
        await wait_until(lambda: all(s.state not in ("planned", "running") for s in session.store.steps(hw.id)),
                         60, "the XID plan to finish")
        steps = {s.step: s for s in session.store.steps(hw.id)}
        for name in ("capture_scene", "isolate_node"):
            assert steps[name].state == "done", f"{name}: {steps[name].state} {steps[name].outcome}"
        assert _out(session) == {"node-3"}
    finally:
        await session.close()
