"""The scheduler side of a plan without Slurm: no scheduler, Kubernetes through a stand-in kubectl, killed commands.

No Kubernetes API server can run here, so `kubectl` is a recording stand-in on
PATH: it answers `get node -o json`, `annotate`, `cordon` and `uncordon` from a
JSON file the way kubectl does, logs every argv it was given, and says the
connection was refused while a `down` file exists. Slurm itself is tested for
real in test_scheduler_slurm.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.executor import Executor
from gridwatch.playbooks.loader import load_builtin
from gridwatch.playbooks.notify import SubprocessRunner
from gridwatch.playbooks.plans import Plan
from gridwatch.playbooks.scheduler import ANNOTATION, Backoff
from gridwatch.playbooks.store import IncidentStore
from gridwatch.wire.protocol import ActionResult, Event, Hello, Sample, TrainerStatus
from tests.conftest import wait_until
from tests.processes import live_members

NODES = ("gpu-1", "gpu-2", "gpu-3")

KUBECTL = r'''#!{python}
"""A stand-in kubectl for tests: nodes in a JSON file, every argv logged, 'down' while a down file exists."""
import json, os, sys
base = {base!r}
args = sys.argv[1:]
with open(os.path.join(base, "argv.jsonl"), "a") as log:
    log.write(json.dumps(args) + "\n")
if os.path.exists(os.path.join(base, "down")):
    print("The connection to the server 127.0.0.1:6443 was refused - did you specify the right host or port?",
          file=sys.stderr)
    sys.exit(1)
path = os.path.join(base, "nodes.json")
nodes = json.load(open(path))
words = [a for a in args if not a.startswith("--")]
verb, rest = words[0], words[1:]
if rest and rest[0] == "node":
    rest = rest[1:]
name = rest[0]
if name not in nodes:
    print(f'Error from server (NotFound): nodes "{{name}}" not found', file=sys.stderr)
    sys.exit(1)
node = nodes[name]
if verb == "get":
    print(json.dumps({{"kind": "Node", "metadata": {{"name": name, "annotations": node["annotations"]}},
                      "spec": {{"unschedulable": True}} if node["cordoned"] else {{}}}}))
elif verb in ("cordon", "uncordon"):
    node["cordoned"] = verb == "cordon"
    print(f"node/{{name}} {{verb}}ed")
elif verb == "annotate":
    for item in rest[1:]:
        if item.endswith("-"):
            node["annotations"].pop(item[:-1], None)
        else:
            key, _, value = item.partition("=")
            if key in node["annotations"] and "--overwrite" not in args:
                print(f"error: --overwrite is false but found the following declared annotation(s): '{{key}}'",
                      file=sys.stderr)
                sys.exit(1)
            node["annotations"][key] = value
    print(f"node/{{name}} annotated")
json.dump(nodes, open(path, "w"))
'''


class Kube:
    """The stand-in's files: its nodes, the argvs it was run with, and the switch that takes it down."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def nodes(self) -> dict[str, Any]:
        return json.loads((self.base / "nodes.json").read_text())

    def set_node(self, name: str, cordoned: bool, annotations: dict[str, str] | None = None) -> None:
        nodes = self.nodes()
        nodes[name] = {"cordoned": cordoned, "annotations": annotations or {}}
        (self.base / "nodes.json").write_text(json.dumps(nodes))

    def argvs(self) -> list[list[str]]:
        log = self.base / "argv.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def down(self, is_down: bool) -> None:
        flag = self.base / "down"
        flag.touch() if is_down else flag.unlink(missing_ok=True)


@pytest.fixture
def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Kube:
    base = tmp_path / "kube"
    (base / "bin").mkdir(parents=True)
    script = base / "bin" / "kubectl"
    script.write_text(KUBECTL.format(python=sys.executable, base=str(base)))
    script.chmod(stat.S_IRWXU)
    (base / "nodes.json").write_text(json.dumps({n: {"cordoned": False, "annotations": {}} for n in NODES}))
    monkeypatch.setenv("PATH", f"{base / 'bin'}:{os.environ['PATH']}")
    return Kube(base)


class CountingClock(ManualClock):
    """A manual clock that counts how often it was read: a loop waiting on it is seen to wait."""

    looked = 0

    def now(self) -> float:
        self.looked += 1
        return super().now()


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def act(self, node: str, action: str, args: dict[str, Any], reason: str) -> ActionResult:
        self.calls.append((node, action))
        return ActionResult(node=node, id="x", action=action, ok=True, message="done")


def xid79(node: str = "gpu-2") -> Plan:
    """The shipped playbooks' plan for an XID 79 on ``node``: no per-step scheduler, the configured one is used."""
    engine = Engine(load_builtin(), ManualClock(1000.0))
    for name in NODES:
        engine.observe(name, Hello(node=name))
        engine.observe(name, Sample(node=name, trainer=TrainerStatus(job="llm", step=7)))
    (plan,) = engine.observe(node, Event(node=node, kind="xid", code=79, gpu=0, severity="critical"))
    assert [s.scheduler for s in plan.steps if s.step == "drain_node"] == [None]
    return plan


def executor_for(tmp_path: Path, scheduler: str, clock: ManualClock | None = None,
                 **kw: Any) -> tuple[Executor, IncidentStore, Sink]:
    clock = clock or ManualClock(1000.0)
    store = IncidentStore(tmp_path / "incidents.db", clock)
    sink = Sink()
    return Executor(store, sink, clock=clock, scheduler=scheduler, who="alice", **kw), store, sink


def drain_step(store: IncidentStore, plan: Plan):  # type: ignore[no-untyped-def]
    return next(s for s in store.steps(plan.incident.id) if s.step == "drain_node")


# ------------------------------------------------------------------ none


async def test_with_no_scheduler_the_drain_is_skipped_and_says_so_never_done(tmp_path: Path) -> None:
    plan = xid79()
    executor, store, sink = executor_for(tmp_path, "none")
    records = await executor.run(plan)
    drain = drain_step(store, plan)
    assert (drain.state, drain.outcome) == ("skipped", "no scheduler configured")
    assert [r.state for r in records if r.step not in ("drain_node", "requeue_job")] == ["done"] * 4  # the job goes on
    assert [r.state for r in records if r.step == "requeue_job"] == ["skipped"]  # gridwatch's trainer leaves in place
    after = [a for a in store.audit_log(plan.incident.id) if a.what == "drain_node on gpu-2"]
    assert [(a.phase, a.outcome) for a in after] == [("after", "skipped: no scheduler configured")]
    assert await executor.return_to_service("gpu-2", "bob", "fixed") == "no scheduler configured: nothing to resume"


def test_every_shipped_drain_uses_the_configured_scheduler() -> None:
    drains = [(book.name, s.scheduler) for book in load_builtin() for s in book.plan if s.action == "drain_node"]
    assert len(drains) >= 4 and all(scheduler is None for _, scheduler in drains), drains


def test_an_unknown_scheduler_is_refused_in_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^unknown scheduler 'pbs'; use one of none, slurm, kubernetes$"):
        executor_for(tmp_path, "pbs")


# ------------------------------------------------------------ kubernetes


async def test_kubernetes_cordons_marks_the_cordon_ours_and_uncordons_it_on_return(kube: Kube, tmp_path: Path) -> None:
    plan = xid79()
    executor, store, _ = executor_for(tmp_path, "kubernetes")
    await executor.run(plan)
    drain = drain_step(store, plan)
    assert drain.state == "done", drain.outcome
    node = kube.nodes()["gpu-2"]
    assert node["cordoned"] is True
    reason = node["annotations"][ANNOTATION]
    assert reason.startswith("xid 79 on gpu-2")
    assert f"(gridwatch incident {plan.incident.id}, playbook xid-hardware, operator alice)" in reason
    assert kube.argvs() == [["get", "node", "gpu-2", "-o", "json"],
                            ["annotate", "--overwrite", "node", "gpu-2", f"{ANNOTATION}={reason}"],
                            ["cordon", "gpu-2"]]
    audited = [a.what for a in store.audit_log(plan.incident.id) if a.what.startswith("kubectl") and a.phase == "before"]
    assert audited == [f"kubectl annotate --overwrite node gpu-2 '{ANNOTATION}={reason}'", "kubectl cordon gpu-2"]

    outcome = await executor.return_to_service("gpu-2", "bob", "GPU replaced")
    assert outcome.startswith("resumed in Kubernetes")
    assert kube.nodes()["gpu-2"] == {"cordoned": False, "annotations": {}}
    assert kube.argvs()[-2:] == [["uncordon", "gpu-2"], ["annotate", "node", "gpu-2", f"{ANNOTATION}-"]]


async def test_kubernetes_leaves_a_cordon_someone_else_made(kube: Kube, tmp_path: Path) -> None:
    kube.set_node("gpu-2", cordoned=True, annotations={"ops/ticket": "OPS-12"})
    plan = xid79()
    executor, store, _ = executor_for(tmp_path, "kubernetes")
    await executor.run(plan)
    drain = drain_step(store, plan)
    assert drain.state == "done" and "already drained by someone else" in drain.outcome
    outcome = await executor.return_to_service("gpu-2", "bob", "GPU replaced")
    assert "drained by someone else" in outcome and "left drained" in outcome
    assert kube.nodes()["gpu-2"] == {"cordoned": True, "annotations": {"ops/ticket": "OPS-12"}}
    assert [a[0] for a in kube.argvs()] == ["get", "get"]  # read twice, changed nothing


async def test_an_unreachable_api_server_leaves_the_drain_pending_until_it_answers(kube: Kube, tmp_path: Path) -> None:
    clock = CountingClock(1000.0)
    executor, store, sink = executor_for(tmp_path, "kubernetes", clock, poll_interval=0.005,
                                         drain_retry=Backoff(first=10.0, factor=2.0, cap=30.0))
    kube.down(True)
    plan = xid79()
    try:
        await executor.run(plan)
        drain = drain_step(store, plan)
        assert drain.state == "pending"
        assert drain.outcome.startswith("controller unreachable, retrying")
        assert ("gpu-2", "isolate") in sink.calls
        # Each try waits longer, on the executor's clock: nothing happens before the wait is over.
        await wait_until(lambda: "next in 10s" in drain_step(store, plan).outcome, what="the first wait")
        clock.advance(9.0)
        looked = clock.looked
        await wait_until(lambda: clock.looked >= looked + 5, what="the retry loop to look at the clock again")
        assert len(kube.argvs()) == 1  # 9 s of its 10 s wait: not tried yet
        clock.advance(1.0)
        await wait_until(lambda: "next in 20s" in drain_step(store, plan).outcome, what="the second try")
        assert len(kube.argvs()) == 2
        kube.down(False)
        clock.advance(20.0)
        await wait_until(lambda: drain_step(store, plan).state == "done", what="the drain once the server answers")
        assert kube.nodes()["gpu-2"]["cordoned"] is True
        assert "on try 3" in drain_step(store, plan).outcome
        assert executor.pending_drains == {}
    finally:
        await executor.close()


async def test_return_to_service_stops_a_pending_drain(kube: Kube, tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    executor, store, _ = executor_for(tmp_path, "kubernetes", clock, poll_interval=0.005)
    kube.down(True)
    plan = xid79()
    await executor.run(plan)
    assert drain_step(store, plan).state == "pending"
    kube.down(False)
    outcome = await executor.return_to_service("gpu-2", "bob", "false alarm")
    assert outcome.startswith(f"stopped the pending drain of {plan.incident.id}; not drained in Kubernetes")
    drain = drain_step(store, plan)
    assert drain.state == "skipped" and "returned to service by bob" in drain.outcome
    clock.advance(3600.0)
    assert executor.pending_drains == {}
    assert kube.nodes()["gpu-2"]["cordoned"] is False  # the stopped retry never cordons it later


# ------------------------------------------------------------ killed commands


async def test_a_command_whose_caller_gives_up_is_killed_with_its_whole_group(tmp_path: Path) -> None:
    # The outer deadline cancels the runner mid-wait (a step's timeout does this): the command and
    # the child it left in the background must both be dead before the caller hears of it.
    pidfile, marker = tmp_path / "pid", tmp_path / "acted"
    script = f"echo $$ > {pidfile}; ( sleep 30; touch {marker} ) & wait"
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(SubprocessRunner().run(["sh", "-c", script], timeout=60), 0.5)
    pgid = int(pidfile.read_text())
    await wait_until(lambda: not live_members(pgid), timeout=5, what="the command's process group to die")
    assert not marker.exists()


async def test_a_scheduler_client_that_is_not_installed_fails_the_drain_in_one_sentence(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    plan = xid79()
    executor, store, _ = executor_for(tmp_path, "slurm")
    await executor.run(plan)
    drain = drain_step(store, plan)
    assert (drain.state, drain.outcome) == (
        "failed", 'scontrol is not installed here (not on PATH): install the Slurm client, or set scheduler = "none"')


def test_a_drain_reason_says_what_is_wrong_first_and_an_earlier_versions_drain_is_still_ours() -> None:
    from gridwatch.playbooks.scheduler import drain_reason, incident_of, ours

    reason = drain_reason("xid-hardware:node-3:17", "xid-hardware", "alice", "xid 79 on node-3 gpu 1: GPU has fallen off the bus")
    assert reason[:20] == "xid 79 on node-3 gpu"  # what `sinfo -R` shows
    assert ours(reason) and incident_of(reason) == "xid-hardware:node-3:17"
    old = "gridwatch: incident xid-hardware:node-3:9 (playbook xid-hardware, operator bob): xid 48 on node-3"
    assert ours(old) and incident_of(old) == "xid-hardware:node-3:9"
    assert not ours("bad PSU, ticket 4411") and incident_of("bad PSU, ticket 4411") is None
