"""The pure engine driven frame by frame on a manual clock: windows, deadlines and guards without sleeping."""

from __future__ import annotations

from pathlib import Path

import pytest

from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.loader import load_builtin
from gridwatch.playbooks.model import Playbook
from gridwatch.playbooks.schema import check_text
from gridwatch.wire.protocol import Event, GpuSample, Hello, LogLine, Sample, Summary, TrainerStatus


def _playbooks(text: str) -> list[Playbook]:
    playbooks, errors = check_text(text, "test.yaml")
    assert not errors, errors
    return playbooks


def _cluster(engine: Engine, clock: ManualClock, nodes: list[str], interval: float = 1.0) -> None:
    for name in nodes:
        engine.observe(f"10.0.0.{name[-1]}:2222", Hello(node=name, ts=clock.now(), interval=interval))
        engine.observe(f"10.0.0.{name[-1]}:2222", Sample(node=name, ts=clock.now(),
                                                          trainer=TrainerStatus(job="llm", step=10)))


def test_heartbeat_is_lost_after_three_intervals_of_the_injected_clock() -> None:
    clock = ManualClock(100.0)
    engine = Engine(_playbooks("name: hb\ntrigger: {condition: heartbeat_lost}\nplan: [notify]\n"), clock)
    _cluster(engine, clock, ["node1", "node2"], interval=2.0)
    clock.advance(6.0)
    assert engine.tick() == []  # exactly 3 x 2 s: not yet
    clock.advance(0.5)
    engine.observe("10.0.0.1:2222", Sample(node="node1"))
    plans = engine.tick()
    assert [(p.incident.node, p.incident.kind) for p in plans] == [("node2", "heartbeat_lost")]
    assert plans[0].incident.summary.startswith("no frame from node2 for 6.5s (3 x its 2s interval)")
    assert engine.tick() == []  # fires once per loss
    engine.observe("10.0.0.2:2222", Sample(node="node2"))
    assert engine.incident(plans[0].incident.id).recovered_at == clock.now()


def test_a_console_that_stalled_holds_no_silence_of_that_time_against_its_nodes() -> None:
    clock = ManualClock(100.0)
    engine = Engine(_playbooks("name: hb\ntrigger: {condition: heartbeat_lost}\nplan: [notify]\n"), clock)
    _cluster(engine, clock, ["node1", "node2"], interval=2.0)
    clock.advance(20.0)  # the console's own loop did not run for 20 s: the nodes' frames wait unread
    engine.excuse_silence(clock.now())
    assert engine.tick() == [] and not any(n.lost for n in engine.nodes.values())
    clock.advance(2.0)
    engine.observe("10.0.0.1:2222", Sample(node="node1"))  # the frames read after the stall
    engine.observe("10.0.0.2:2222", Sample(node="node2"))
    clock.advance(6.5)  # then node2 goes quiet for real: a full window after its last frame
    engine.observe("10.0.0.1:2222", Sample(node="node1"))
    plans = engine.tick()
    assert [(p.incident.node, p.incident.kind) for p in plans] == [("node2", "heartbeat_lost")]


def test_the_heartbeat_follows_the_stream_in_force_summaries_then_whole_samples_again() -> None:
    """Summaries every 5 s are a 15 s heartbeat; once the node sends whole samples again (an operator opened it), 3 s."""
    clock = ManualClock(100.0)
    engine = Engine(_playbooks("name: hb\ntrigger: {condition: heartbeat_lost}\nplan: [notify]\n"), clock)
    _cluster(engine, clock, ["node1"], interval=1.0)
    engine.observe("10.0.0.1:2222", Summary(node="node1", ts=clock.now(), every=5.0))
    clock.advance(14.0)
    assert engine.tick() == []  # under 3 x 5 s: not lost
    engine.observe("10.0.0.1:2222", Sample(node="node1", ts=clock.now()))
    clock.advance(3.5)
    plans = engine.tick()
    assert [(p.incident.node, p.incident.kind) for p in plans] == [("node1", "heartbeat_lost")]


def test_a_tick_finds_every_quiet_node_among_many_whatever_their_cadence_in_the_fleets_order() -> None:
    """A tick reads only the nodes heard from longest ago: nodes on a 1 s tick, on 5 s summaries and back on
    whole samples must each be lost at their own three intervals, the rack that fell silent together named in
    the order the nodes joined, and nothing else."""
    clock = ManualClock(100.0)
    engine = Engine(_playbooks("name: hb\ntrigger: {condition: heartbeat_lost}\nplan: [notify]\n"), clock)
    names = [f"node{i:03d}" for i in range(300)]
    for name in names:
        engine.observe(name, Hello(node=name, ts=clock.now(), interval=1.0))
    for name in names[:100]:  # a third on summaries every 5 s: a 15 s heartbeat
        engine.observe(name, Summary(node=name, ts=clock.now(), every=5.0))
    rack = names[250:260]
    for step in range(1, 12):  # 11 s: every node but the rack speaks each second, in a shuffled order
        clock.advance(1.0)
        for name in reversed(names) if step % 2 else names:
            if name not in rack and (name not in names[:100] or step % 5 == 0):
                engine.observe(name, Summary(node=name, ts=clock.now(), every=5.0) if name in names[:100]
                               else Sample(node=name, ts=clock.now()))
        plans = engine.tick()
        if step < 4:
            assert plans == [], step
        elif step == 4:  # 4 s > 3 x 1 s: the rack, and only the rack, in the order it joined
            assert [p.incident.node for p in plans] == rack
            assert sorted(n.name for n in engine.nodes.values() if n.lost) == rack
        else:
            assert plans == [], step  # each loss fires once; the summaries' nodes are inside their 15 s
    engine.observe(rack[3], Sample(node=rack[3], ts=clock.now()))
    assert not engine.nodes[rack[3]].lost  # its own frame clears it
    engine.observe(names[0], Sample(node=names[0], ts=clock.now()))  # node000 back on whole samples: 1 s
    clock.advance(3.5)  # nobody speaks: each node is judged at its own interval
    lost = {p.incident.node for p in engine.tick()}
    assert names[0] in lost and rack[3] in lost and set(names[100:250]) <= lost
    assert not lost & set(names[1:100])  # 4.5 s into their 15 s


def test_a_clock_that_runs_back_loses_no_quiet_node() -> None:
    """Replay or a test's clock may step back between ticks; the nodes heard "later" at an earlier time are
    still found when they go quiet."""
    clock = ManualClock(100.0)
    engine = Engine(_playbooks("name: hb\ntrigger: {condition: heartbeat_lost}\nplan: [notify]\n"), clock)
    _cluster(engine, clock, ["node1", "node2", "node3"], interval=1.0)
    assert engine.tick() == []
    clock.advance(-50.0)
    engine.observe("10.0.0.2:2222", Sample(node="node2"))  # heard at 50: older than the others' 100
    assert engine.tick() == []
    clock.advance(51.0)  # 1 s after the others' last frame, 51 s after node2's
    assert [p.incident.node for p in engine.tick()] == ["node2"]


def test_metric_must_hold_for_its_whole_window() -> None:
    clock = ManualClock(0.0)
    engine = Engine(_playbooks("name: hot\nscope: gpu\ntrigger: {metric: gpu.temperature > 90 for 60s}\n"
                               "plan: [notify]\n"), clock)

    def temp(value: float | None) -> list:
        return engine.observe("n1", Sample(node="n1", gpus=[GpuSample(index=3, temp_c=value)]))

    assert temp(95) == []
    clock.advance(30)
    assert temp(None) == []  # N/A breaks the window: it is not a reading
    clock.advance(30)
    assert temp(95) == []
    clock.advance(59)
    assert temp(95) == []
    clock.advance(1)
    plans = temp(96)
    assert [(p.incident.node, p.incident.gpu) for p in plans] == [("n1", 3)]


def test_cooldown_and_resolve() -> None:
    clock = ManualClock(0.0)
    text = ("name: app\ntrigger: {event: xid}\nplan: [notify]\ndedup_window: 1m\nguards: {cooldown: 10m}\n")
    engine = Engine(_playbooks(text), clock)
    first = engine.observe("n1", Event(node="n1", kind="xid", code=13))
    assert first[0].steps[0].decision == "act"
    clock.advance(120)
    engine.tick()  # quiet for the dedup window: closed
    again = engine.observe("n1", Event(node="n1", kind="xid", code=13))
    assert again[0].steps[0].decision == "skip" and "cooldown" in again[0].steps[0].reason
    assert engine.resolve(again[0].incident.id)
    clock.advance(600)
    third = engine.observe("n1", Event(node="n1", kind="xid", code=13))
    assert third[0].steps[0].decision == "act"


def test_rate_limit_escalates_acting_steps_of_a_playbook() -> None:
    clock = ManualClock(0.0)
    text = ("name: restart\ntrigger: {event: trainer_exit}\nplan: [restart_from_checkpoint, notify]\n"
            "guards: {rate_limit: {max: 2, window: 1h}}\n")
    engine = Engine(_playbooks(text), clock)
    _cluster(engine, clock, ["node1", "node2", "node3"])
    decisions = []
    for name in ("node1", "node2", "node3"):
        clock.advance(60)
        plan = engine.observe(name, Event(node=name, kind="trainer_exit"))[0]
        decisions.append([s.decision for s in plan.steps])
    assert decisions == [["act", "act"], ["act", "act"], ["escalate", "skip"]]


def test_count_within_window_and_log_pattern() -> None:
    clock = ManualClock(0.0)
    text = ("name: oom\ntrigger: {log: 'CUDA out of memory', count: 2, within: 1m}\nplan: [notify]\n")
    engine = Engine(_playbooks(text), clock)
    assert engine.observe("n1", LogLine(node="n1", source="trainer", line="CUDA out of memory")) == []
    clock.advance(61)
    assert engine.observe("n1", LogLine(node="n1", source="trainer", line="CUDA out of memory")) == []
    clock.advance(10)
    plans = engine.observe("n1", Event(node="n1", kind="oom", message="RuntimeError: CUDA out of memory"))
    assert len(plans) == 1


def test_a_node_fault_absorbs_a_second_fault_playbook_on_the_same_node() -> None:
    clock = ManualClock(0.0)
    text = ("name: hw\ntrigger: {event: xid}\nplan: [isolate_node]\n---\n"
            "name: dbe\ntrigger: {event: ecc_dbe}\nplan: [isolate_node, notify]\n")
    engine = Engine(_playbooks(text), clock)
    _cluster(engine, clock, ["node1", "node2", "node3", "node4"])
    assert len(engine.observe("node2", Event(node="node2", kind="xid", code=48, gpu=1))) == 1
    assert engine.observe("node2", Event(node="node2", kind="ecc_dbe", gpu=1)) == []
    (incident,) = engine.incidents()
    assert incident.symptoms == 2 and "node2" not in engine.live_nodes()


def test_stack_mismatch_needs_a_majority() -> None:
    clock = ManualClock(0.0)
    engine = Engine(_playbooks("name: stack\ntrigger: {condition: stack_mismatch}\nplan: [notify]\n"), clock)
    for name, digest in (("a", "x1"), ("b", "x2")):
        hello = Hello(node=name, interval=1.0)
        hello.stack.hash = digest
        engine.observe(name, hello)
    assert engine.tick() == []  # two nodes, two stacks: nobody is the odd one out
    for name in ("c", "d"):
        hello = Hello(node=name)
        hello.stack.hash = "x1"
        engine.observe(name, hello)
    assert [p.incident.node for p in engine.tick()] == ["b"]


def _straggler(engine: Engine, reporter: str, slow: str, step: int) -> list:
    """One straggler episode as the trainer tells it: once, by the slow node itself (or, here, by another)."""
    return engine.observe(reporter, Event(node=reporter, kind="straggler", severity="warning", source="trainer",
                                          message=f"{slow} is slower than its peers: 12 slow steps of 20 over 190 s",
                                          details={"rank": "3", "node": slow, "step": str(step), "flagged": "12"}))


def test_a_straggler_episode_told_by_the_slow_node_opens_one_incident_on_it() -> None:
    from gridwatch.playbooks.loader import load_builtin

    clock = ManualClock(0.0)
    engine = Engine(load_builtin(), clock)
    nodes = ["node1", "node2", "node3", "node4"]
    _cluster(engine, clock, nodes, interval=10.0)
    clock.advance(10.0)
    plans = _straggler(engine, "node2", "node2", 119)
    assert [(p.incident.playbook, p.incident.node) for p in plans] == [("straggler-persistent", "node2")]
    steps = [(s.step, s.confirm) for s in plans[0].steps]
    assert ("isolate_node", True) in steps  # moving the job off it is an operator's call
    clock.advance(10.0)
    assert _straggler(engine, "node2", "node2", 121) == []  # the same episode again: the same incident


def test_a_straggler_named_by_one_other_node_alone_blames_nobody() -> None:
    from gridwatch.playbooks.loader import load_builtin

    clock = ManualClock(0.0)
    engine = Engine(load_builtin(), clock)
    _cluster(engine, clock, ["node1", "node2", "node3", "node4"])
    assert _straggler(engine, "node1", "node4", 50) == []
    assert [p.incident.node for p in _straggler(engine, "node3", "node4", 50)] == ["node4"]


def test_a_straggler_report_naming_an_unknown_node_blames_nobody() -> None:
    from gridwatch.playbooks.loader import load_builtin

    clock = ManualClock(0.0)
    engine = Engine(load_builtin(), clock)
    _cluster(engine, clock, ["node1", "node2"], interval=10.0)
    for step in range(100, 140):
        clock.advance(10.0)
        engine.observe("node1", Sample(node="node1"))
        engine.observe("node2", Sample(node="node2"))
        assert _straggler(engine, "node1", "gpu-host-9", step) == []
    assert engine.incidents() == []


def test_a_new_incident_in_the_same_second_gets_its_own_id():
    from gridwatch.playbooks.clock import ManualClock
    from gridwatch.playbooks.engine import Engine
    from gridwatch.playbooks.loader import load_builtin
    from gridwatch.wire.protocol import Event, Hello, Text

    clock = ManualClock(1000.0)
    engine = Engine(load_builtin(), clock)
    engine.observe("n1", Hello(node=Text("n1"), ts=1000.0))
    xid13 = Event(node=Text("n1"), kind=Text("xid"), code=13, gpu=0, ts=1000.0)
    engine.observe("n1", xid13)
    (first,) = engine.incidents()
    engine.resolve(first.id)
    engine.observe("n1", xid13)
    ids = [inc.id for inc in engine.incidents(include_closed=True)]
    assert len(ids) == 2 and len(set(ids)) == 2


def test_the_step_a_symptom_names_is_a_field_of_its_incident_not_a_note_to_parse() -> None:
    clock = ManualClock(0.0)
    engine = Engine(_playbooks("name: x\ntrigger: {event: xid}\nplan: [notify]\n"), clock)
    (plan,) = engine.observe("n1", Event(node="n1", kind="xid", code=79, details={"step": "120"}))
    assert plan.incident.symptom_step == 120
    assert any("training step 120" in note for note in plan.incident.notes)  # and said for people


_HW_AND_HB = """
name: hb
severity: critical
trigger: {condition: heartbeat_lost, missed: 3}
plan: [notify, {do: isolate_node, continue_on_failure: true}]
guards: {blast_radius: {max_nodes: 5}}
---
name: hw
severity: critical
trigger: {event: xid, match: {code: [79, 48]}}
plan: [capture_scene, isolate_node, notify]
guards: {blast_radius: {max_nodes: 5}}
"""


def _finish(engine: Engine, plan, state: str) -> None:  # noqa: ANN001 - a Plan
    for step in plan.steps:
        engine.step_finished(step, state if step.step == "isolate_node" else "done", "test")


def test_a_node_is_out_only_once_its_removal_is_done_and_a_failed_one_is_planned_again() -> None:
    clock = ManualClock(100.0)
    engine = Engine(_playbooks(_HW_AND_HB), clock)
    _cluster(engine, clock, ["node1", "node2", "node3"])
    plans = engine.observe("10.0.0.1:2222", Event(node="node1", kind="xid", code=79, gpu=0, ts=clock.now()))
    assert [p.incident.playbook for p in plans] == ["hw"]
    assert not engine.nodes["node1"].out and "node1" not in engine.live_nodes()  # being removed: off job steps
    _finish(engine, plans[0], "failed")  # "not connected": the isolation did not happen
    assert not engine.nodes["node1"].out
    # The next XID on it is not swallowed as "already out": the node reports again, the plan is made anew
    # (not at its very next frame: a link that was just down gets REPLAN_AFTER_S first).
    assert engine.observe("10.0.0.1:2222", Sample(node="node1", ts=clock.now())) == []
    clock.advance(10.0)
    again = engine.observe("10.0.0.1:2222", Sample(node="node1", ts=clock.now()))
    assert [p.incident.id for p in again] == [plans[0].incident.id]
    assert [s.index for s in again[0].steps] == [3, 4, 5]  # new step ids after the first plan's
    _finish(engine, again[0], "done")
    assert engine.nodes["node1"].out


def test_a_hardware_fault_after_a_heartbeat_loss_gets_its_own_capture_and_isolation() -> None:
    clock = ManualClock(100.0)
    engine = Engine(_playbooks(_HW_AND_HB), clock)
    _cluster(engine, clock, ["node1", "node2", "node3"])
    clock.advance(3.5)
    for name in ("node1", "node2"):
        engine.observe(f"10.0.0.{name[-1]}:2222", Sample(node=name, ts=clock.now()))
    hb = engine.tick()
    assert [(p.incident.playbook, p.incident.node) for p in hb] == [("hb", "node3")]
    _finish(engine, hb[0], "failed")  # isolate: not connected (the agent had crashed)
    # The agent is back; the XID 79 it then reports (and an XID 48 after) make the hardware plan.
    engine.observe("10.0.0.3:2222", Hello(node="node3", ts=clock.now()))
    plans = engine.observe("10.0.0.3:2222", Event(node="node3", kind="xid", code=79, gpu=1, ts=clock.now()))
    assert [p.incident.playbook for p in plans] == ["hw"]
    assert [s.step for s in plans[0].steps if s.decision == "act"] == ["capture_scene", "isolate_node", "notify"]
    assert hb[0].incident.id in plans[0].incident.supersedes


def test_a_removal_that_will_not_happen_gives_its_node_back_to_job_wide_steps() -> None:
    """A drain skipped (no scheduler), a step declined or skipped as recovered: the node is in the job again."""
    clock = ManualClock(100.0)
    engine = Engine(_playbooks(_HW_AND_HB), clock)
    _cluster(engine, clock, ["node1", "node2", "node3"])
    (plan,) = engine.observe("10.0.0.1:2222", Event(node="node1", kind="xid", code=79, gpu=0, ts=clock.now()))
    assert "node1" not in engine.live_nodes()
    isolate = next(s for s in plan.steps if s.step == "isolate_node")
    engine.step_finished(isolate, "skipped", "declined")
    engine.step_finished(isolate, "skipped", "told twice")  # a second telling changes nothing
    assert "node1" in engine.live_nodes() and engine.nodes["node1"].removing == 0
    # One never told at all stops counting after REMOVAL_MAX_S.
    (plan2,) = engine.observe("10.0.0.2:2222", Event(node="node2", kind="xid", code=79, gpu=0, ts=clock.now()))
    assert "node2" not in engine.live_nodes()
    clock.advance(901.0)
    for name in ("node1", "node2", "node3"):
        engine.observe(f"10.0.0.{name[-1]}:2222", Sample(node=name, ts=clock.now()))
    engine.tick()
    assert "node2" in engine.live_nodes()


def test_a_node_that_sends_one_frame_and_goes_silent_again_is_planned_again() -> None:
    clock = ManualClock(100.0)
    engine = Engine(_playbooks(_HW_AND_HB), clock)
    _cluster(engine, clock, ["node1", "node2", "node3"])
    clock.advance(3.5)
    for name in ("node1", "node2"):
        engine.observe(f"10.0.0.{name[-1]}:2222", Sample(node=name, ts=clock.now()))
    (first,) = engine.tick()
    engine.observe("10.0.0.3:2222", Sample(node="node3", ts=clock.now()))  # one stray frame ...
    assert engine.no_longer_holds(first.incident.id) is not None
    clock.advance(3.5)  # ... and silence again
    for name in ("node1", "node2"):
        engine.observe(f"10.0.0.{name[-1]}:2222", Sample(node=name, ts=clock.now()))
    (again,) = engine.tick()
    assert again.incident.id == first.incident.id and engine.no_longer_holds(first.incident.id) is None
    assert [s.step for s in again.steps] == ["notify", "isolate_node"]


def test_an_incident_moves_open_acting_recovered_resolved_as_its_store_records_it(tmp_path: Path) -> None:
    from gridwatch.playbooks.incident_times import Phase
    from gridwatch.playbooks.store import IncidentStore
    clock = ManualClock(1000.0)
    engine = Engine(load_builtin(), clock)
    for name in ("node-1", "node-2"):
        engine.observe(name, Hello(node=name))
    (plan,) = engine.observe("node-2", Event(node="node-2", kind="xid", code=79, gpu=0, severity="critical",
                                             message="GPU has fallen off the bus"))
    store = IncidentStore(tmp_path / "incidents.db", clock)
    store.save_plan(plan)
    seen = [store.incident(plan.incident.id).phase]
    store.mark_acted(plan.incident.id, 1001.0)
    seen.append(store.incident(plan.incident.id).phase)
    store.acknowledge(plan.incident.id, "alice")  # a mark beside the phase, not a phase
    seen.append(store.incident(plan.incident.id).phase)
    store.mark_recovered(plan.incident.id, 1010.0)
    seen.append(store.incident(plan.incident.id).phase)
    store.resolve(plan.incident.id, "alice", "GPU replaced")
    seen.append(store.incident(plan.incident.id).phase)
    assert seen == [Phase.OPEN, Phase.ACTING, Phase.ACTING, Phase.RECOVERED, Phase.RESOLVED]


def test_an_incident_names_the_scheduler_job_its_node_holds() -> None:
    from gridwatch.wire.protocol import SchedulerJob
    engine = Engine(load_builtin(), ManualClock(1000.0))
    for name in ("node-1", "node-2"):
        engine.observe(name, Hello(node=name))
    job = SchedulerJob(scheduler="slurm", id="4242", user="alice", name="pretrain-7b", nodes="node-[1-2]", pids=9)
    engine.observe("node-2", Summary(node="node-2", jobs=[job]))
    (plan,) = engine.observe("node-2", Event(node="node-2", kind="xid", code=79, gpu=0, severity="critical",
                                             message="GPU has fallen off the bus"))
    assert plan.incident.summary.endswith("[slurm job 4242 (alice, pretrain-7b)]")
    assert plan.incident.summary.startswith("xid 79 on node-2")  # what is wrong first, as a drain reason reads it
    engine.observe("node-2", Summary(node="node-2"))  # the job ended
    assert engine.nodes["node-2"].scheduler_jobs == ()


def test_the_worker_an_application_xid_kills_is_that_xids_incident_not_a_second_one() -> None:
    # The README's XID 13 in the demo: NVIDIA's catalogue says "restart the application", the program dies of it,
    # and torchrun restarts it. One fault: one incident, the restart told as its consequence.
    clock = ManualClock(0.0)
    engine = Engine(load_builtin(), clock)
    _cluster(engine, clock, ["node1", "node2", "node3"])
    plans = engine.observe("node2", Event(node="node2", kind="xid", code=13, gpu=0, severity="warning",
                                          details={"resolution": "RESTART_APP", "blame": "application"}))
    assert [p.incident.playbook for p in plans] == ["xid-application"]
    clock.advance(5.0)
    # Its last answer came just before the XID was read (a status poll earlier): still that XID's consequence.
    restarted = Event(node="node2", kind="trainer_restarted", severity="error", source="trainer",
                      message="the trainer on node2 was restarted by torchrun (restart 1)",
                      details={"fault_at": f"{clock.now() - 5.8:.3f}"})
    assert engine.observe("node2", restarted) == []
    (incident,) = [i for i in engine.incidents() if i.state != "closed"]
    assert incident.playbook == "xid-application" and incident.symptoms == 2
    assert any("trainer-restarted" in note and "consequence" in note for note in incident.notes)
    # On another node, or long after, a worker's death is its own incident.
    assert [p.incident.playbook for p in engine.observe("node3", Event(node="node3", kind="trainer_restarted",
                                                                       severity="error", source="trainer"))] \
        == ["trainer-restarted"]
    clock.advance(300.0)
    assert [p.incident.playbook for p in engine.observe("node2", restarted)] == ["trainer-restarted"]


@pytest.mark.parametrize(("first", "then"), [
    ({"kind": "trainer_exit", "details": {"process": "gone"}}, {"kind": "trainer_restarted"}),
    ({"kind": "trainer_exit", "details": {"process": "unknown"}}, {"kind": "trainer_restarted"}),
    ({"kind": "trainer_exit", "details": {"process": "gone"}}, {"kind": "worker_failed"}),
    ({"kind": "worker_failed"}, {"kind": "trainer_exit", "details": {"process": "gone"}}),
])
def test_one_workers_death_told_twice_is_one_incident(first: dict, then: dict) -> None:
    # The drill's crashed worker on a loaded machine: its trainer's link says it exited (gone, or not known yet)
    # before torchrun's restart is told; one death, one incident, one scene, one page.
    clock = ManualClock(0.0)
    engine = Engine(load_builtin(), clock)
    _cluster(engine, clock, ["node1", "node2", "node3"])
    plans = engine.observe("node2", Event(node="node2", severity="error", source="trainer", **first))
    assert len(plans) == 1
    clock.advance(3.0)
    assert engine.observe("node2", Event(node="node2", severity="error", source="trainer", **then)) == []
    (incident,) = [i for i in engine.incidents() if i.state != "closed"]
    assert incident.id == plans[0].incident.id and incident.symptoms == 2
    assert any("consequence" in note for note in incident.notes)
    # The same telling on another node is that node's own death.
    assert len(engine.observe("node3", Event(node="node3", severity="error", source="trainer", **then))) == 1


def test_a_workers_death_told_after_its_grace_then_by_its_slow_restart_is_one_incident() -> None:
    # The drill on a loaded machine: the worker dies at t=0; torchrun's new life takes 16 s to import torch, so
    # the trainer's link says first, after its 15 s grace, that the process is gone (dated at the death), and the
    # restart is told a second later, dated at the same death. One death: one incident, measured from t=0.
    clock = ManualClock(100.0)
    engine = Engine(load_builtin(), clock)
    _cluster(engine, clock, ["node1", "node2", "node3"])
    died = clock.now()
    clock.advance(15.0)
    plans = engine.observe("node2", Event(node="node2", kind="trainer_exit", severity="error", source="trainer",
                                          details={"process": "gone", "fault_at": f"{died:.3f}"}))
    assert [p.incident.playbook for p in plans] == ["trainer-exited"]
    clock.advance(1.0)
    assert engine.observe("node2", Event(node="node2", kind="trainer_restarted", severity="error", source="trainer",
                                         details={"fault_at": f"{died:.3f}"})) == []
    (incident,) = [i for i in engine.incidents() if i.state != "closed"]
    assert incident.id == plans[0].incident.id and incident.symptoms == 2
    # A restart dated long after that death is a second one.
    clock.advance(200.0)
    again = Event(node="node2", kind="trainer_restarted", severity="error", source="trainer",
                  details={"fault_at": f"{clock.now() - 2.0:.3f}"})
    assert [p.incident.playbook for p in engine.observe("node2", again)] == ["trainer-restarted"]


def test_a_worker_that_died_while_its_node_was_out_joins_that_fault_even_after_its_incident_closed() -> None:
    # XID 79 takes node2 out; its worker dies while out, and torchrun's new life tells of it only after the
    # node was fixed and its incident resolved. The death (fault_at) came while that fault's incident stood.
    clock = ManualClock(0.0)
    engine = Engine(load_builtin(), clock)
    _cluster(engine, clock, ["node1", "node2", "node3"])
    (plan,) = [p for p in engine.observe("node2", Event(node="node2", kind="xid", code=79, gpu=0, severity="critical",
                                                        message="GPU has fallen off the bus"))
               if p.incident.playbook == "xid-hardware"]
    clock.advance(25.0)
    died_at = clock.now() - 3.0
    clock.advance(2.0)
    assert engine.resolve(plan.incident.id)
    clock.advance(5.0)
    restarted = Event(node="node2", kind="trainer_restarted", severity="error", source="trainer",
                      details={"fault_at": f"{died_at:.3f}"})
    assert engine.observe("node2", restarted) == []
    assert any("consequence" in note for note in plan.incident.notes)
    # A death after the incident closed is the node's own new fault.
    clock.advance(10.0)
    later = Event(node="node2", kind="trainer_restarted", severity="error", source="trainer",
                  details={"fault_at": f"{clock.now() - 1.0:.3f}"})
    assert [p.incident.playbook for p in engine.observe("node2", later)] == ["trainer-restarted"]


def test_consequence_of_names_real_event_kinds() -> None:
    _, errors = check_text("name: x\nconsequence_of: {events: [xid, xdi]}\ntrigger: {event: trainer_restarted}\n"
                           "plan: [notify]\n", "test.yaml")
    assert len(errors) == 1 and "xdi" in str(errors[0])
    _, errors = check_text("name: x\nconsequence_of: {within: 2m}\ntrigger: {event: trainer_restarted}\n"
                           "plan: [notify]\n", "test.yaml")
    assert len(errors) == 1 and "needs events" in str(errors[0])


def test_the_blast_radius_counts_the_nodes_of_the_incidents_own_slurm_job() -> None:
    # Two Slurm jobs of four nodes each, no gridwatch trainer. With max_nodes 1 per job, job A losing a node
    # does not stop job B from losing its own bad one; a second bad node of job A goes to a human.
    from gridwatch.wire.protocol import SchedulerJob
    clock = ManualClock(1000.0)
    engine = Engine(_playbooks("""
name: hw
trigger: {event: xid}
plan: [isolate_node]
guards: {blast_radius: {max_nodes: 1, window: 1h}}
"""), clock)
    names = [f"n{i}" for i in range(1, 9)]
    for i, name in enumerate(names):
        engine.observe(name, Hello(node=name, ts=clock.now()))
        job = SchedulerJob(scheduler="slurm", id="100" if i < 4 else "200", nodes="n[1-4]" if i < 4 else "n[5-8]")
        engine.observe(name, Summary(node=name, jobs=[job]))

    def decide(node: str) -> tuple[str, str]:
        clock.advance(60.0)
        (plan,) = engine.observe(node, Event(node=node, kind="xid", code=79, gpu=0, severity="critical"))
        step = plan.steps[0]
        if step.decision == "act":
            engine.step_finished(step, "done", "isolated")
        return step.decision, step.reason

    assert decide("n1")[0] == "act"
    assert decide("n5")[0] == "act"  # the other job's: its own blast radius
    decision, reason = decide("n2")
    assert decision == "escalate" and "2 of its job's 4 nodes" in reason
