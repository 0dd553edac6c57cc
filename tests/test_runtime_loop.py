"""The console's own runtime closes the loop: a restart sent while the job re-forms, recovery, MTTD/MTTR, audit.

Real agents on loopback SSH, each relaying a real trainer control socket
(``gridwatch.trainer.control_server``) whose status the test drives, the runtime built
by ``build_runtime`` exactly as ``gridwatch console`` builds it, and a real
SQLite incident store.
"""

from __future__ import annotations

import asyncio
import sqlite3

from gridwatch.console.runtime.incidents import StoreIncidents
from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
from gridwatch.sshlink.hostlist import parse_endpoints
from tests.conftest import start_agent, stop_agent, wait_until
from tests.support_loop import FakeJob, agents_beside, runtime_over, stop_beside


async def test_the_console_retries_a_restart_while_the_job_reforms_and_marks_it_recovered_with_its_times(
        keys, tmp_path) -> None:
    names = ["node-1", "node-2", "node-3"]
    job = FakeJob(tmp_path, names)
    agents = await agents_beside(keys, job)
    db = tmp_path / "incidents.db"
    runtime = runtime_over(agents, keys, db)
    store = runtime.plan_store
    steps_when_recovered: list[int | None] = []
    runtime.hooks.recovered.append(lambda row: steps_when_recovered.append(runtime.job_step()))
    reformed = asyncio.Event()

    async def trainers() -> None:
        # The job as the coordinator runs it: node-2 leaves, the others re-form (no one serves their
        # sockets for a second), restore checkpoint 35 and train on.
        await job.left.wait()
        await asyncio.sleep(1.0)  # the re-formation itself
        job.step = 36
        for name in ("node-1", "node-3"):
            job.up(name)
        reformed.set()
        restarts = 0
        while True:
            restarts += sum(1 for s in (job.servers["node-1"], job.servers["node-3"])
                            for r in s.take() if r.cmd == "restart_from")
            if restarts:
                job.step += 1
            await asyncio.sleep(0.1)  # the stand-in job's pace: a step every 0.1 s once restarted

    sim: asyncio.Task | None = None
    try:
        await runtime.start()
        await wait_until(lambda: runtime.job_step() == 40 and len(runtime.engine.live_nodes()) == 3, 20,
                         "three nodes training at step 40")
        sim = asyncio.create_task(trainers())
        agents[1].agent.event("xid", "GPU has fallen off the bus", severity="critical", gpu=0, code=79)
        await wait_until(lambda: any(i.playbook == "xid-hardware" for i in store.incidents()), 10, "the incident")
        (rec,) = [i for i in store.incidents() if i.playbook == "xid-hardware"]
        await wait_until(lambda: store.incident(rec.id).recovered_at is not None, 30, "the job to train past it")
        rec = store.incident(rec.id)
        steps = {s.step: s for s in store.steps(rec.id)}
        for name in ("capture_scene", "isolate_node", "restart_from_checkpoint"):
            assert steps[name].state == "done", (name, steps[name].state, steps[name].outcome)
        restart = steps["restart_from_checkpoint"]
        assert reformed.is_set() and restart.planned.nodes == ["node-1", "node-3"]
        # It met the job re-forming and was sent again until the trainers answered, not failed and escalated.
        assert restart.finished_at - restart.started_at >= 0.5
        assert not any(a.what == "escalate" for a in store.audit_log(rec.id))
        # Recovered once the job trained past step 40, where it was when the fault came.
        assert rec.fault_step == 40 and steps_when_recovered and steps_when_recovered[0] > 40
        assert rec.fault_at is not None and rec.fault_at <= rec.detected_at
        assert 0 <= rec.detect_s < 3 and rec.recover_s > 1.0
        row = StoreIncidents(store).detail(rec.id)
        assert row is not None and row.recover_s == rec.recover_s and row.detect_s == rec.detect_s
        kept = sqlite3.connect(db).execute("SELECT detect_s, recover_s FROM incident_times WHERE id=?",
                                           (rec.id,)).fetchone()
        assert kept[0] == rec.detect_s and abs(kept[1] - rec.recover_s) < 1e-6
        # The operator puts node-2 back: audited like a step, and the scheduler asked to take it back.
        back = await runtime.node_action("node-2", "unisolate", "GPU reseated")
        assert back.ok and "scheduler:" in back.message
        audit = [(a.who, a.what, a.phase) for a in store.audit_log() if a.incident is None]
        assert ("alice", "unisolate on node-2", "before") in audit and ("alice", "unisolate on node-2", "after") in audit
        assert any(what.startswith("return_to_service node-2") for _, what, _ in audit)
    finally:
        await stop_beside(runtime, agents, job, sim)


async def test_an_incident_from_before_any_training_step_recovers_once_the_job_trains_past_the_first_step_seen(
        keys, tmp_path) -> None:
    from gridwatch.agent.trainer_link import TrainerLink

    job = FakeJob(tmp_path, ["node-1"])
    ra = await start_agent(keys, name="node-1", gpus=2, interval=0.1)
    runtime = build_runtime(RuntimeOptions(endpoints=parse_endpoints(ra.spec), key_path=str(keys.operator_key),
                                           known_hosts=str(keys.known_hosts), db_path=str(tmp_path / "i.db"),
                                           operator="alice", tick_interval=0.1))
    store = runtime.plan_store
    try:
        await runtime.start()
        await wait_until(lambda: len(runtime.engine.live_nodes()) == 1, 20, "the node")
        # The fault comes before the console has seen any trainer: no step is known at the fault.
        ra.agent.event("xid", "Graphics Engine Exception", severity="warning", gpu=0, code=13)
        await wait_until(lambda: any(i.playbook == "xid-application" for i in store.incidents()), 10, "the incident")
        (rec,) = [i for i in store.incidents() if i.playbook == "xid-application"]
        assert rec.fault_step is None
        job.up("node-1")
        ra.agent.trainer = TrainerLink(job.paths["node-1"], interval=0.05)
        ra.agent.trainer.start()
        await wait_until(lambda: runtime.job_step() == 40, 20, "the trainer at step 40")
        seen_at = runtime.store.clock.now()

        async def trains() -> None:
            while True:
                await asyncio.sleep(0.2)  # the stand-in job's pace
                job.step += 1

        stepping = asyncio.create_task(trains())
        try:
            # The first step seen after the fault is the one to pass.
            await wait_until(lambda: store.incident(rec.id).recovered_at is not None, 30, "the job to train past it")
        finally:
            stepping.cancel()
        assert store.incident(rec.id).recovered_at >= seen_at
    finally:
        await runtime.stop()
        job.down("node-1")
        await stop_agent(ra)
