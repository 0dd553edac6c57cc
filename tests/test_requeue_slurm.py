"""requeue_job against a real Slurm: a batch job gridwatch did not write is moved off a bad node.

The job is a plain shell script under ``sbatch`` (it imports nothing of gridwatch). The agents' side of
the plan goes to an in-memory sink: what is under test is what Slurm does, read with scontrol.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.executor import Executor
from gridwatch.playbooks.loader import load_builtin
from gridwatch.playbooks.plans import Plan
from gridwatch.playbooks.scheduler import Backoff
from gridwatch.playbooks.store import IncidentStore, StepRecord
from gridwatch.wire.protocol import Event, Hello, Sample
from tests.conftest import wait_until, wait_until_sync
from tests.slurm_cluster import NODES, SlurmCluster, missing
from tests.support_executor import FakeSink

pytestmark = pytest.mark.skipif(missing() is not None, reason=f"no Slurm here: {missing()}")


class Told:
    """A notifier that keeps what it was asked to say."""

    def __init__(self) -> None:
        self.said: list[tuple[str, bool]] = []

    async def notify(self, step: Any, incident: Any, text: str, escalation: bool) -> str:
        self.said.append((text, escalation))
        return "told"


def xid79(node: str = "node-2") -> Plan:
    """The shipped plan for an XID 79 on ``node``, whose agents report no trainer (the job is not ours)."""
    engine = Engine(load_builtin(), ManualClock(1000.0))
    for name in NODES:
        engine.observe(name, Hello(node=name))
        engine.observe(name, Sample(node=name))
    (plan,) = engine.observe(node, Event(node=node, kind="xid", code=79, gpu=0, severity="critical",
                                         message="GPU has fallen off the bus"))
    return plan


def executor_for(tmp_path: Path, **kw: Any) -> tuple[Executor, IncidentStore, FakeSink, Told]:
    clock = kw.pop("clock", None) or ManualClock(1000.0)
    store = IncidentStore(tmp_path / "incidents.db", clock)
    sink, told = FakeSink(), Told()
    executor = Executor(store, sink, clock=clock, scheduler="slurm", who="alice", notifier=told, **kw)
    return executor, store, sink, told


def step(store: IncidentStore, plan: Plan, name: str) -> StepRecord:
    return next(s for s in store.steps(plan.incident.id) if s.step == name)


def running_on(slurm: SlurmCluster, job: str, nodes: str) -> bool:
    fields = slurm.job(job)
    return fields.get("JobState") == "RUNNING" and fields.get("NodeList") == nodes


async def test_a_job_gridwatch_did_not_write_is_requeued_off_the_drained_node_and_starts_at_once(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    job = slurm.submit(tmp_path, nodes=3, requeue=True)
    wait_until_sync(lambda: running_on(slurm, job, "node-[1-3]"), timeout=30, what="the job running on node-[1-3]")
    plan = xid79("node-2")
    executor, store, sink, _ = executor_for(tmp_path)
    await executor.run(plan)

    drain, requeue = step(store, plan, "drain_node"), step(store, plan, "requeue_job")
    assert drain.state == "done" and slurm.drained("node-2"), drain.outcome
    assert requeue.state == "done", requeue.outcome
    assert requeue.outcome.startswith(f"requeued job {job} (plain-job, user ")
    assert "pending again, asked to start now" in requeue.outcome
    # Slurm would hold a requeued job about two minutes; asked to start now, it runs again at once, on the
    # nodes left (node-2 is drained), and the scheduler restarts it: no agent is told to restart anything.
    wait_until_sync(lambda: running_on(slurm, job, "node-[1,3-4]"), timeout=30,
                    what="the requeued job running again without node-2")
    assert slurm.job(job)["Restarts"] == "1"
    restart = step(store, plan, "restart_from_checkpoint")
    assert restart.state == "skipped" and restart.outcome.startswith("not sent: the scheduler restarts the job")
    assert not [c for c in sink.calls if c[1] == "restart_from"]
    # Each command is in the audit with its argv, before and after.
    sent = [(a.what, a.phase) for a in store.audit_log(plan.incident.id) if a.what.startswith("scontrol ")
            and ("requeue" in a.what or "StartTime" in a.what)]
    assert sent == [(f"scontrol requeue {job}", "before"), (f"scontrol requeue {job}", "after"),
                    (f"scontrol update JobId={job} StartTime=now", "before"),
                    (f"scontrol update JobId={job} StartTime=now", "after")]

    # The same plan run again (a console restarted, a standby taking over) requeues nothing more.
    await executor.run(plan)
    assert slurm.job(job)["Restarts"] == "1"
    assert [a.phase for a in store.audit_log() if a.what == f"scontrol requeue {job}"] == ["before", "after"]


async def test_a_job_that_did_not_opt_in_is_drained_not_requeued_and_the_incident_pages(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    job = slurm.submit(tmp_path, nodes=3, requeue=False)
    wait_until_sync(lambda: running_on(slurm, job, "node-[1-3]"), timeout=30, what="the job running on node-[1-3]")
    plan = xid79("node-2")
    executor, store, _, told = executor_for(tmp_path)
    await executor.run(plan)
    requeue = step(store, plan, "requeue_job")
    assert requeue.state == "failed"
    assert f"job {job} (plain-job" in requeue.outcome and "did not opt in to requeue" in requeue.outcome
    assert "sbatch --requeue" in requeue.outcome
    assert slurm.drained("node-2") and running_on(slurm, job, "node-[1-3]")  # left as it runs
    assert slurm.job(job)["Restarts"] == "0"
    assert not [a for a in store.audit_log() if a.what.startswith("scontrol requeue")]
    # A person hears of it, with the reason.
    assert any(escalation and "did not opt in to requeue" in text for text, escalation in told.said), told.said


async def test_with_the_controller_down_the_requeue_waits_and_happens_once_when_it_answers(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    job = slurm.submit(tmp_path, nodes=3, requeue=True)
    wait_until_sync(lambda: running_on(slurm, job, "node-[1-3]"), timeout=30, what="the job running on node-[1-3]")
    clock = ManualClock(1000.0)
    executor, store, _, _ = executor_for(tmp_path, clock=clock, poll_interval=0.01,
                                         drain_retry=Backoff(first=1.0, cap=2.0))
    plan = xid79("node-2")
    slurm.script("stop-controller")
    try:
        await executor.run(plan)
        assert step(store, plan, "drain_node").state == "pending"
        requeue = step(store, plan, "requeue_job")
        assert requeue.state == "pending" and requeue.outcome.startswith("controller unreachable, retrying")
        slurm.script("start-controller")

        def settled() -> bool:
            clock.advance(0.5)  # the backoff waits on the executor's clock
            return step(store, plan, "requeue_job").state != "pending"

        await wait_until(settled, timeout=90, what="the retried requeue")
        requeue = step(store, plan, "requeue_job")
        assert requeue.state == "done", requeue.outcome
        assert f"requeued job {job}" in requeue.outcome
        assert slurm.drained("node-2")
        # slurmctld starts a requeued job at its next scheduling pass after the job's end is cleaned up:
        # seconds alone, tens of seconds beside a full test run on two cores.
        wait_until_sync(lambda: running_on(slurm, job, "node-[1,3-4]"), timeout=90,
                        what="the requeued job running again without node-2")
        assert slurm.job(job)["Restarts"] == "1"
    finally:
        await executor.close()


async def test_the_agent_names_the_slurm_job_running_on_its_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    from gridwatch.sshlink.keys import init_keys
    from tests.conftest import start_agent, stop_agent

    job = slurm.submit(tmp_path, nodes=3, requeue=True)
    wait_until_sync(lambda: running_on(slurm, job, "node-[1-3]"), timeout=30, what="the job running on node-[1-3]")
    keys = init_keys(tmp_path / "keys", shared_host_key=True)
    batch_host, other = await start_agent(keys, "node-1", jobs_every=0.2), await start_agent(keys, "node-4",
                                                                                            jobs_every=0.2)
    try:
        # The job's batch script runs on node-1 (its first node); node-4 holds no part of it.
        # By its id: an earlier test's job cancelled a moment ago may still be dying on these nodes (its processes
        # outlive squeue's answer), and a node in that state holds both, as a real one does while a job completes.
        await wait_until(lambda: any(j.id == job for j in batch_host.agent.jobs), timeout=20,
                         what="node-1's agent to see the job")
        (found,) = [j for j in batch_host.agent.jobs if j.id == job]
        assert (found.scheduler, found.id, found.name, found.nodes) == ("slurm", job, "plain-job", "node-[1-3]")
        assert found.pids >= 1
        assert not any(j.id == job for j in other.agent.jobs), other.agent.jobs
    finally:
        await stop_agent(batch_host)
        await stop_agent(other)
