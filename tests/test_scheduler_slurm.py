"""drain_node and return to service against a real Slurm: Debian's slurmctld, four `slurmd -N node-N` and munge.

The cluster is started once for the run by scripts/slurm-cluster.sh; every test
starts from all four nodes idle. The agents' side of a plan is not what these
tests are about, so its actions go to an in-memory sink (tests/test_slurm_e2e.py
runs the whole product against real agents).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.executor import Executor
from gridwatch.playbooks.loader import load_builtin
from gridwatch.playbooks.plans import Plan
from gridwatch.playbooks.scheduler import Backoff
from gridwatch.playbooks.schema import check_text
from gridwatch.playbooks.store import IncidentStore
from gridwatch.wire.protocol import Event, Hello, Sample, TrainerStatus
from tests.conftest import wait_until
from tests.processes import live_members
from tests.slurm_cluster import NODES, SlurmCluster, missing
from tests.support_executor import FakeSink

pytestmark = pytest.mark.skipif(missing() is not None, reason=f"no Slurm here: {missing()}")


def xid79(node: str = "node-2", text: str | None = None) -> Plan:
    """The plan for an XID 79 on ``node`` of a four-node job: the shipped playbooks, or the one in ``text``."""
    clock = ManualClock(1000.0)
    playbooks = load_builtin() if text is None else check_text(text, "t.yaml")[0]
    engine = Engine(playbooks, clock)
    for name in NODES:
        engine.observe(name, Hello(node=name))
        engine.observe(name, Sample(node=name, trainer=TrainerStatus(job="llm", step=7)))
    (plan,) = engine.observe(node, Event(node=node, kind="xid", code=79, gpu=0, severity="critical",
                                         message="GPU has fallen off the bus"))
    return plan


def executor_for(tmp_path: Path, *, clock: ManualClock | None = None, **kw: Any) -> tuple[Executor, IncidentStore, FakeSink]:
    clock = clock or ManualClock(1000.0)
    store = IncidentStore(tmp_path / "incidents.db", clock)
    sink = FakeSink()
    return Executor(store, sink, clock=clock, scheduler="slurm", who="alice", **kw), store, sink


def step(store: IncidentStore, plan: Plan, name: str = "drain_node"):  # type: ignore[no-untyped-def]
    return next(s for s in store.steps(plan.incident.id) if s.step == name)


async def test_a_shipped_playbook_drains_the_node_with_incident_playbook_and_operator_in_the_reason(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    plan = xid79()
    assert plan.incident.playbook == "xid-hardware"
    executor, store, _ = executor_for(tmp_path)
    await executor.run(plan)
    drain = step(store, plan)
    assert drain.state == "done", drain.outcome
    state, reason = slurm.node("node-2")
    assert "DRAIN" in state
    assert reason.startswith("xid 79 on node-2")  # what is wrong first: `sinfo -R` shows 20 characters
    assert reason.endswith(f"(gridwatch incident {plan.incident.id}, playbook xid-hardware, operator alice)")
    assert [slurm.drained(n) for n in NODES] == [False, True, False, False]
    # The audit has the command as sent, and the reason sent with it.
    sent = [a for a in store.audit_log(plan.incident.id) if a.what.startswith("scontrol update")]
    assert [a.phase for a in sent] == ["before", "after"]
    assert f"'Reason={reason}'" in sent[0].what and sent[0].why == reason
    assert sent[1].outcome.startswith("exit 0")


async def test_a_drain_someone_else_made_is_kept_and_its_reason_audited(slurm: SlurmCluster, tmp_path: Path) -> None:
    slurm.scontrol("update", "NodeName=node-2", "State=DRAIN", "Reason=OPS-4711 fan noise, do not use")
    plan = xid79()
    executor, store, _ = executor_for(tmp_path)
    await executor.run(plan)
    drain = step(store, plan)
    assert drain.state == "done"
    assert "already drained by someone else" in drain.outcome and "OPS-4711 fan noise" in drain.outcome
    assert slurm.node("node-2")[1] == "OPS-4711 fan noise, do not use"  # the operator's note is not overwritten
    audit = store.audit_log(plan.incident.id)
    assert any("OPS-4711" in a.outcome for a in audit if a.what == "scontrol show node -o node-2")
    assert not [a for a in audit if a.what.startswith("scontrol update")]

    # Back in service: gridwatch did not make this drain, so it does not lift it.
    outcome = await executor.return_to_service("node-2", "bob", "GPU reseated")
    assert "drained by someone else" in outcome and "left drained" in outcome
    assert slurm.node("node-2")[1] == "OPS-4711 fan noise, do not use"
    assert not [a for a in store.audit_log() if "State=RESUME" in a.what]


async def test_return_to_service_resumes_only_a_drain_of_ours(slurm: SlurmCluster, tmp_path: Path) -> None:
    plan = xid79()
    executor, store, _ = executor_for(tmp_path)
    await executor.run(plan)
    assert slurm.drained("node-2")
    outcome = await executor.return_to_service("node-2", "bob", "GPU replaced")
    assert outcome.startswith("resumed in Slurm"), outcome
    assert not slurm.drained("node-2")
    # The incident's own audit shows who gave the node back, with the command run.
    rows = [(a.who, a.what, a.phase) for a in store.audit_log(plan.incident.id) if a.who == "bob"]
    assert ("bob", "scontrol update NodeName=node-2 State=RESUME", "before") in rows
    assert ("bob", "scontrol update NodeName=node-2 State=RESUME", "after") in rows
    assert ("bob", "return_to_service node-2", "after") in rows
    again = await executor.return_to_service("node-2", "bob", "GPU replaced")
    assert again.startswith("not drained in Slurm") and "nothing to resume" in again


async def test_with_the_controller_down_the_drain_stays_pending_and_happens_when_it_answers(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    executor, store, sink = executor_for(tmp_path, clock=clock, poll_interval=0.01,
                                         drain_retry=Backoff(first=5.0, cap=20.0))
    plan = xid79()
    slurm.script("stop-controller")
    try:
        await executor.run(plan)
        drain = step(store, plan)
        assert drain.state == "pending", drain.outcome
        assert drain.outcome.startswith("controller unreachable, retrying")
        # The job goes on without waiting, and the node stays isolated meanwhile.
        assert [s.state for s in store.steps(plan.incident.id) if s.step not in ("drain_node", "requeue_job")] == ["done"] * 4
        sent = [(node, action) for node, action, _ in sink.calls]
        assert ("node-2", "isolate") in sent and all(a != "unisolate" for _, a in sent)
        assert list(executor.pending_drains.values()) == ["node-2"]
        slurm.script("start-controller")
        clock.advance(5.0)  # the backoff's first wait, on the executor's clock
        await wait_until(lambda: step(store, plan).state != "pending", timeout=60, what="the retried drain")
        drain = step(store, plan)
        assert drain.state == "done", drain.outcome
        assert "on try 2" in drain.outcome
        assert plan.incident.id in slurm.node("node-2")[1]
        outcomes = [a.outcome for a in store.audit_log(plan.incident.id) if a.what == "drain_node on node-2"]
        assert outcomes[-2].startswith("pending: controller unreachable, retrying") and outcomes[-1].startswith("done")
    finally:
        await executor.close()


async def test_a_pending_drain_is_taken_up_by_the_next_console(slurm: SlurmCluster, tmp_path: Path) -> None:
    plan = xid79()
    executor, store, _ = executor_for(tmp_path)
    slurm.script("stop-controller")
    await executor.run(plan)
    assert step(store, plan).state == "pending"
    await executor.close()  # the console stops with the drain still pending
    store.close()
    slurm.script("start-controller")
    again, store2, _ = executor_for(tmp_path)
    assert await again.resume() == [plan.incident.id]
    assert step(store2, plan).state == "done"
    assert slurm.drained("node-2")


STANDIN = """#!/bin/sh
# A scontrol that reads like the real one but, asked to change anything, stalls first (a slow controller).
if [ "$1" = update ]; then
    echo $$ > "{pidfile}"
    ( sleep 30; exec {real} "$@" ) &
    wait
    exit 0
fi
exec {real} "$@"
"""


async def test_a_timed_out_drain_is_killed_and_never_acts_afterwards(slurm: SlurmCluster, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    pidfile = tmp_path / "standin.pid"
    script = bindir / "scontrol"
    script.write_text(STANDIN.format(pidfile=pidfile, real="/usr/bin/scontrol"))
    script.chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    text = ("name: hw\ntrigger: {event: xid, match: {code: [79]}}\nplan:\n  - isolate_node\n"
            "  - do: drain_node\n    timeout: 1s\n  - notify\n")
    plan = xid79(text=text)
    executor, store, _ = executor_for(tmp_path)
    await executor.run(plan)
    drain = step(store, plan)
    # Killed before it finished, the command's outcome is unknown: pending, the node read again before the
    # next try (on the executor's clock, which does not move here), never recorded "failed".
    assert drain.state == "pending"
    assert drain.outcome.startswith("outcome unknown (the command timed out), reading the node again")
    # The stand-in's whole process group is gone, the delayed scontrol with it: nothing can drain the node later.
    pgid = int(pidfile.read_text())
    await wait_until(lambda: not live_members(pgid), timeout=5, what="the stand-in's process group to die")
    assert not slurm.drained("node-2")
    rows = [(a.what.split(" ", 2)[:2], a.phase, a.outcome) for a in store.audit_log(plan.incident.id)
            if a.what.startswith("scontrol update")]
    assert rows == [(["scontrol", "update"], "before", ""), (["scontrol", "update"], "after", "killed: the step timed out")]
    await executor.close()
