"""The executor against a real SQLite file and an in-memory action sink: audit, idempotence, confirmation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.executor import Executor
from gridwatch.playbooks.plans import Plan
from gridwatch.playbooks.scheduler import DrainRefused, Kubernetes, Slurm, backend_for
from gridwatch.playbooks.schema import check_text
from gridwatch.playbooks.store import IncidentStore, UnknownIncident
from gridwatch.wire.protocol import Event, Hello, Sample, TrainerStatus
from tests.support_executor import FakeNotifier, FakeRunner, FakeSink

HARDWARE = """\
name: hw
trigger: {event: xid, match: {code: [79]}}
plan:
  - capture_scene
  - isolate_node
  - do: drain_node
    scheduler: slurm
  - restart_from_checkpoint
  - notify
"""


def _plan(text: str = HARDWARE, event: Event | None = None) -> Plan:
    clock = ManualClock(1000.0)
    playbooks, errors = check_text(text, "t.yaml")
    assert not errors
    engine = Engine(playbooks, clock)
    for name in ("node1", "node2", "node3"):
        engine.observe(name, Hello(node=name))
        engine.observe(name, Sample(node=name, trainer=TrainerStatus(job="llm", step=7)))
    (plan,) = engine.observe("node2", event or Event(node="node2", kind="xid", code=79, gpu=0))
    return plan


def _executor(tmp_path: Path, sink: FakeSink, runner: FakeRunner | None = None,
              **kw: Any) -> tuple[Executor, IncidentStore, FakeRunner, FakeNotifier]:
    clock = ManualClock(1000.0)
    store = IncidentStore(tmp_path / "incidents.db", clock)
    runner, notifier = runner or FakeRunner(), FakeNotifier()
    return Executor(store, sink, clock=clock, runner=runner, notifier=notifier, who="console", **kw), store, runner, notifier


async def test_runs_the_plan_and_audits_before_and_after(tmp_path: Path) -> None:
    sink = FakeSink()
    executor, store, runner, notifier = _executor(tmp_path, sink)
    plan = _plan()
    records = await executor.run(plan)
    assert [r.state for r in records] == ["done"] * 5
    assert [(n, a) for n, a, _ in sink.calls] == [
        ("node2", "capture_scene"), ("node2", "isolate"), ("node1", "restart_from"), ("node3", "restart_from")]
    assert sink.calls[2][2]["checkpoint"] == "newest"
    reason = f"xid 79 on node2 gpu 0 (gridwatch incident {plan.incident.id}, playbook hw, operator console)"
    assert runner.argvs == [["scontrol", "update", "NodeName=node2", "State=DRAIN", f"Reason={reason}"]]
    assert len(notifier.sent) == 1
    audit = store.audit_log(plan.incident.id)
    assert [(a.what, a.phase) for a in audit][:2] == [("capture_scene on node2", "before"),
                                                       ("capture_scene on node2", "after")]
    # The drain's commands are in the audit as typed, each with the reason sent.
    commands = [(a.what, a.phase) for a in audit if a.what.startswith("scontrol")]
    assert commands == [("scontrol show node -o node2", "after"),
                        (f"scontrol update NodeName=node2 State=DRAIN 'Reason={reason}'", "before"),
                        (f"scontrol update NodeName=node2 State=DRAIN 'Reason={reason}'", "after")]
    assert all(a.why == reason for a in audit if a.what.startswith("scontrol"))
    assert all(a.who == "console" for a in audit)
    assert store.incident(plan.incident.id).acted_at == 1000.0


async def test_a_resumed_plan_does_not_act_twice(tmp_path: Path) -> None:
    plan = _plan()
    sink = FakeSink()
    executor, store, _, _ = _executor(tmp_path, sink)
    store.save_plan(plan)
    # The console died while isolating: capture_scene done, isolate_node started but not finished.
    store.set_step(plan.steps[0].id, "done", "ok")
    store.set_step(plan.steps[1].id, "running", started=True)
    store.close()

    executor2, store2, runner2, _ = _executor(tmp_path, sink)
    assert await executor2.resume() == [plan.incident.id]
    states = [r.state for r in store2.steps(plan.incident.id)]
    assert states == ["done", "interrupted", "done", "done", "done"]
    assert [a for _, a, _ in sink.calls] == ["restart_from", "restart_from"]  # nothing sent twice
    calls = len(sink.calls)
    await executor2.run(plan)  # the engine handing the same plan again changes nothing
    assert await executor2.resume() == []
    assert len(sink.calls) == calls and len(runner2.argvs) == 1


async def test_confirmation_holds_the_rest_of_the_plan(tmp_path: Path) -> None:
    text = HARDWARE.replace("  - isolate_node\n", "  - do: isolate_node\n    confirm: true\n")
    plan = _plan(text)
    sink = FakeSink()
    executor, store, _, _ = _executor(tmp_path, sink)
    records = await executor.run(plan)
    assert [r.state for r in records] == ["done", "awaiting_confirmation", "planned", "planned", "planned"]
    assert [a for _, a, _ in sink.calls] == ["capture_scene"]
    with pytest.raises(ValueError):
        await executor.confirm(plan.steps[0].id, "alice")
    records = await executor.confirm(plan.steps[1].id, "alice")
    assert [r.state for r in records] == ["done"] * 5
    isolate = [a for a in store.audit_log(plan.incident.id) if a.what.startswith("isolate_node")]
    assert [(a.who, a.phase) for a in isolate] == [("console", "engine"), ("alice", "before"), ("alice", "after")]


async def test_decline_skips_the_rest(tmp_path: Path) -> None:
    text = HARDWARE.replace("  - isolate_node\n", "  - do: isolate_node\n    confirm: true\n")
    plan = _plan(text)
    executor, store, _, _ = _executor(tmp_path, FakeSink())
    await executor.run(plan)
    records = await executor.decline(plan.steps[1].id, "bob", "not this node")
    assert [r.state for r in records] == ["done", "declined", "skipped", "skipped", "skipped"]


async def test_failure_stops_the_plan_and_escalates_once(tmp_path: Path) -> None:
    sink = FakeSink(fail={"isolate"})
    executor, store, runner, notifier = _executor(tmp_path, sink)
    records = await executor.run(_plan())
    assert [r.state for r in records] == ["done", "failed", "skipped", "skipped", "skipped"]
    assert records[1].outcome == "node2: refused"
    assert runner.argvs == []
    assert [e for _, e in notifier.sent] == [True]


async def test_a_hung_agent_times_out(tmp_path: Path) -> None:
    text = HARDWARE.replace("  - capture_scene\n", "  - do: capture_scene\n    timeout: 50ms\n"
                                                    "    continue_on_failure: true\n")
    executor, _, _, _ = _executor(tmp_path, FakeSink(hang={"capture_scene"}))
    records = await executor.run(_plan(text))
    assert records[0].state == "failed" and records[0].outcome == "timed out after 0.05s"
    assert [r.state for r in records[1:]] == ["done"] * 4


async def test_guard_decisions_are_recorded_not_acted(tmp_path: Path) -> None:
    plan = _plan()
    plan.steps[1].decision, plan.steps[1].reason = "escalate", "blast radius"
    plan.steps[2].decision, plan.steps[2].reason = "skip", "cooldown"
    sink = FakeSink()
    executor, store, runner, notifier = _executor(tmp_path, sink)
    records = await executor.run(plan)
    assert [r.state for r in records] == ["done", "escalated", "skipped", "done", "done"]
    assert "isolate" not in [a for _, a, _ in sink.calls] and runner.argvs == []
    assert ("hw:node2:1000 needs a human: blast radius", True) in notifier.sent


async def test_rollback_before_an_event_carries_the_step(tmp_path: Path) -> None:
    text = "name: nan\nscope: job\ntrigger: {event: nan_loss}\nplan:\n  - do: restart_from_checkpoint\n    checkpoint: before\n"
    plan = _plan(text, Event(node="node2", kind="nan_loss", details={"step": "42"}))
    sink = FakeSink()
    executor, _, _, _ = _executor(tmp_path, sink)
    await executor.run(plan)
    assert {n for n, _, _ in sink.calls} == {"node1", "node2", "node3"}
    assert sink.calls[0][2] == {"incident": plan.incident.id, "checkpoint": "before", "before_ts": 1000.0,
                                "before_step": 42}


def test_store_acknowledge_silence_resolve(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    store = IncidentStore(tmp_path / "i.db", clock)
    plan = _plan()
    store.save_plan(plan)
    iid = plan.incident.id
    assert store.incident(iid).state == "open"
    assert store.acknowledge(iid, "alice").acknowledged_by == "alice"
    assert store.silence(iid, "alice", until=1600.0).state == "silenced"
    clock.advance(601)
    assert store.incident(iid).state == "open"  # the silence ran out by itself
    assert [r.id for r in store.incidents(states=["open"])] == [iid]
    assert store.resolve(iid, "bob", "replaced the GPU").state == "resolved"
    assert store.incidents(states=["open"]) == []
    assert [(a.who, a.what) for a in store.audit_log(iid)] == [
        ("alice", "acknowledge"), ("alice", "silence"), ("bob", "resolve")]
    with pytest.raises(ValueError):
        store.silence(iid, "alice", until=10.0)
    with pytest.raises(UnknownIncident, match="no incident 'nope'"):
        store.acknowledge("nope", "alice")


def test_drain_commands_are_argv_and_refuse_odd_names() -> None:
    assert Kubernetes().drain_argvs("gpu-07.dc1", "x")[-1] == ["kubectl", "cordon", "gpu-07.dc1"]
    assert backend_for("none") is None
    for odd in ("--all", "n1; rm -rf /", "-N"):
        with pytest.raises(DrainRefused):
            Slurm().drain_argvs(odd, "x")
        with pytest.raises(DrainRefused):
            Slurm().read_argv(odd)
    with pytest.raises(DrainRefused, match="unknown scheduler 'pbs'; use one of none, slurm, kubernetes"):
        backend_for("pbs")


class FlipProbe:
    """Says a condition holds from the third time it is asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    def holds(self, condition: str, node: str) -> bool:
        self.asked.append((condition, node))
        return len(self.asked) >= 3


async def test_wait_for_polls_until_the_condition_holds_or_times_out(tmp_path: Path) -> None:
    text = ("name: w\ntrigger: {event: xid}\nplan:\n  - isolate_node\n"
            "  - do: wait_for\n    condition: isolated\n    timeout: 5s\n  - notify\n")
    probe = FlipProbe()
    executor, _, _, _ = _executor(tmp_path, FakeSink(), probe=probe, poll_interval=0)
    records = await executor.run(_plan(text))
    assert [r.state for r in records] == ["done", "done", "done"]
    assert probe.asked == [("isolated", "node2")] * 3

    class Never:
        def holds(self, condition: str, node: str) -> bool:
            return False

    text2 = text.replace("timeout: 5s", "timeout: 20ms")
    (tmp_path / "second").mkdir()
    executor2, _, _, _ = _executor(tmp_path / "second", FakeSink(), probe=Never(), poll_interval=0.001)
    records = await executor2.run(_plan(text2))
    assert [r.state for r in records] == ["done", "failed", "skipped"]
    assert records[1].outcome == "timed out after 0.02s"


async def test_a_superseded_plan_stands_down_and_cannot_be_confirmed(tmp_path: Path) -> None:
    from gridwatch.playbooks.loader import load_builtin
    from gridwatch.playbooks.replay import replay

    trace = Path(__file__).parent / "traces" / "straggler_then_xid79.jsonl"
    straggler, hardware = replay(trace.open("rb"), load_builtin()).plans
    sink = FakeSink()
    executor, store, _, _ = _executor(tmp_path, sink)
    waiting = [r for r in await executor.run(straggler) if r.state == "awaiting_confirmation"]
    assert [r.step for r in waiting] == ["isolate_node"]
    records = await executor.run(hardware)
    # No scheduler configured: the drain is skipped and says why, never "done".
    assert [(r.step, r.state) for r in records if r.state != "done"] == [("drain_node", "skipped"),
                                                                        ("requeue_job", "skipped")]
    assert [r.outcome for r in records if r.step == "drain_node"] == ["no scheduler configured"]
    assert [r.state for r in store.steps(straggler.incident.id)] == ["done", "done", "skipped", "skipped"]
    assert store.incident(straggler.incident.id).state == "resolved"
    with pytest.raises(ValueError, match="not waiting for confirmation"):
        await executor.confirm(waiting[0].id, "alice")
    assert [(n, a) for n, a, _ in sink.calls].count(("node4", "isolate")) == 1


def _restart_plan(text: str, checkpoints: dict[str, dict[str, int]], event: Event) -> Plan:
    clock = ManualClock(1000.0)
    engine = Engine(check_text(text, "t.yaml")[0], clock)
    for name, tiers in checkpoints.items():
        engine.observe(name, Hello(node=name))
        engine.observe(name, Sample(node=name, trainer=TrainerStatus(job="llm", step=90, checkpoints=tiers)))
    (plan,) = engine.observe(str(event.node), event)
    return plan


async def test_restart_names_the_checkpoint_step_every_node_holds(tmp_path: Path) -> None:
    # node1 already has the newest tier-0 snapshot (80); node3 has not: 70 is the newest they share.
    checkpoints = {"node1": {"0": 80, "1": 70}, "node2": {"0": 80, "1": 70}, "node3": {"0": 75, "1": 70}}
    plan = _restart_plan(HARDWARE, checkpoints, Event(node="node2", kind="xid", code=79, gpu=0))
    sink = FakeSink()
    executor, _, _, _ = _executor(tmp_path, sink)
    await executor.run(plan)
    restarts = [(n, args) for n, a, args in sink.calls if a == "restart_from"]
    assert restarts == [(n, {"incident": plan.incident.id, "checkpoint": "newest", "step": 70})
                        for n in ("node1", "node3")]


async def test_rollback_names_the_newest_shared_checkpoint_below_the_bad_step(tmp_path: Path) -> None:
    text = "name: nan\nscope: job\ntrigger: {event: nan_loss}\nplan:\n  - do: restart_from_checkpoint\n    checkpoint: before\n"
    checkpoints = {"node1": {"0": 85, "1": 80}, "node2": {"0": 85, "1": 80, "2": 60}}
    plan = _restart_plan(text, checkpoints, Event(node="node2", kind="nan_loss", details={"step": "85"}))
    sink = FakeSink()
    executor, _, _, _ = _executor(tmp_path, sink)
    await executor.run(plan)
    assert {args["step"] for _, _, args in sink.calls} == {80}
    assert sink.calls[0][2]["before_step"] == 85 and sink.calls[0][2]["checkpoint"] == "before"


def _node3_went_silent(plan: str) -> tuple[Engine, Plan]:
    """An engine over three nodes with a heartbeat playbook of ``plan``, and its plan for node3 gone quiet."""
    clock = ManualClock(1000.0)
    playbooks, errors = check_text(f"name: hb\ntrigger: {{condition: heartbeat_lost}}\nplan: {plan}\n", "t.yaml")
    assert not errors
    engine = Engine(playbooks, clock)
    for name in ("node1", "node2", "node3"):
        engine.observe(name, Hello(node=name, ts=clock.now()))
    clock.advance(4.0)
    engine.observe("node1", Sample(node="node1"))
    engine.observe("node2", Sample(node="node2"))
    (made,) = engine.tick()
    return engine, made


async def test_a_standby_taking_the_lead_skips_a_heartbeat_plan_whose_node_came_back(tmp_path: Path) -> None:
    """A standby stalled, planned heartbeat-lost for a node, and takes the lead after the node's frames came
    back: before each step it re-reads the condition, and the node is not isolated."""
    engine, plan = _node3_went_silent("[notify, isolate_node, restart_from_checkpoint]")
    sink = FakeSink()
    executor, store, _, notifier = _executor(tmp_path, sink)
    executor.recheck = engine.no_longer_holds
    leading = False
    executor.gate = lambda: None if leading else "this console does not lead"
    await executor.run(plan)
    assert [r.state for r in store.steps(plan.incident.id)] == ["planned"] * 3 and not sink.calls
    engine.observe("node3", Sample(node="node3"))  # its frames come back before the lead changes
    leading = True
    records = await executor.resume()
    assert plan.incident.id in records
    steps = store.steps(plan.incident.id)
    assert [r.state for r in steps] == ["skipped"] * 3
    assert "node3 is sending frames again" in steps[0].outcome
    assert not sink.calls and not notifier.sent


async def test_a_notify_says_what_the_steps_did_not_the_playbooks_sentence_when_a_guard_stopped_them(
        tmp_path: Path) -> None:
    text = HARDWARE.replace("  - notify\n", "  - do: notify\n    message: node isolated and drained, job resumed\n")
    plan = _plan(text)
    for step in plan.steps:
        if step.step in ("isolate_node", "drain_node", "restart_from_checkpoint"):
            step.decision, step.reason = "escalate", "blast radius: 2 nodes out within 1h"
    executor, _, _, notifier = _executor(tmp_path, FakeSink())
    await executor.run(plan)
    told = [t for t, escalation in notifier.sent if not escalation]
    assert told and "node isolated and drained" not in told[-1]
    assert "isolate_node escalated (blast radius: 2 nodes out within 1h)" in told[-1]
    assert "capture_scene done" in told[-1]


async def test_a_drain_whose_command_timed_out_is_read_again_not_recorded_failed(tmp_path: Path) -> None:
    """slurmctld froze while it took the update: the command is killed at the step's timeout, yet the node
    is drained. The step is pending (its outcome unknown), the node is read again, and then it is done."""
    import asyncio

    from gridwatch.playbooks.notify import CommandOutcome
    from tests.conftest import wait_until

    class FrozenController(FakeRunner):
        def __init__(self) -> None:
            super().__init__()
            self.reason = ""

        async def run(self, argv: list[str], timeout: float) -> CommandOutcome:
            if argv[:3] == ["scontrol", "show", "node"]:
                held = f"IDLE+DRAIN ThreadsPerCore=1 Reason={self.reason} [root@2026-12-02T01:00:00]" \
                    if self.reason else "IDLE ThreadsPerCore=1"
                return CommandOutcome(0, f"NodeName={argv[-1]} Arch=x86_64 State={held}\n")
            self.argvs.append(argv)
            if argv[:2] == ["scontrol", "update"] and not self.reason:
                self.reason = argv[-1].split("=", 1)[1]  # taken by the controller ...
                await asyncio.sleep(3600)  # ... which then stops answering
            return CommandOutcome(0, "")

    text = HARDWARE.replace("    scheduler: slurm\n", "    scheduler: slurm\n    timeout: 1s\n")
    plan = _plan(text)
    runner = FrozenController()
    executor, store, _, _ = _executor(tmp_path, FakeSink(), runner=runner)
    await executor.run(plan)
    drain = next(s for s in store.steps(plan.incident.id) if s.step == "drain_node")
    assert drain.state == "pending" and drain.outcome.startswith("outcome unknown (the command timed out)")
    executor.clock.advance(120.0)
    await wait_until(lambda: next(s for s in store.steps(plan.incident.id) if s.step == "drain_node").state == "done",
                     10, "the node read again")
    drain = next(s for s in store.steps(plan.incident.id) if s.step == "drain_node")
    assert "already drained by gridwatch" in drain.outcome
    assert [a for a in runner.argvs if a[:2] == ["scontrol", "update"]] == [runner.argvs[0]]  # sent once
    await executor.close()


async def test_a_pending_drain_of_a_node_that_came_back_is_not_sent_later(tmp_path: Path) -> None:
    """A heartbeat plan's drain waits for slurmctld; the node's frames come back meanwhile: the retry
    re-reads the condition first and drains nothing."""
    from gridwatch.playbooks.notify import CommandOutcome
    from tests.conftest import wait_until

    class Unreachable(FakeRunner):
        async def run(self, argv: list[str], timeout: float) -> CommandOutcome:
            self.argvs.append(argv)
            return CommandOutcome(1, "slurm_load_node error: Unable to contact slurm controller (connect failure)")

    engine, plan = _node3_went_silent("[{do: drain_node, scheduler: slurm}, notify]")
    runner = Unreachable()
    executor, store, _, _ = _executor(tmp_path, FakeSink(), runner=runner)
    executor.recheck = engine.no_longer_holds
    await executor.run(plan)
    assert store.steps(plan.incident.id)[0].state == "pending"
    engine.observe("node3", Sample(node="node3"))  # it was the network; the node is back
    executor.clock.advance(120.0)
    await wait_until(lambda: store.steps(plan.incident.id)[0].state == "skipped", 10, "the pending drain given up")
    assert "node3 is sending frames again" in store.steps(plan.incident.id)[0].outcome
    assert not [a for a in runner.argvs if a[:2] == ["scontrol", "update"]]
    await executor.close()
