"""Replay every trace in tests/traces through the builtin playbooks and compare with its expected plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gridwatch.console.cli import main
from gridwatch.playbooks.loader import load_builtin
from gridwatch.playbooks.replay import ReplayResult, replay

TRACES = Path(__file__).parent / "traces"
TRACE_FILES = sorted(TRACES.glob("*.jsonl"))


def _replay(trace: Path) -> ReplayResult:
    with trace.open("rb") as fh:
        return replay(fh, load_builtin())


def _steps(result: ReplayResult) -> list[list]:
    assert result.start is not None
    return [[s.playbook, s.step, s.target, s.decision, round(s.at - result.start, 3)]
            for p in result.plans for s in p.steps]


@pytest.mark.parametrize("trace", TRACE_FILES, ids=[t.stem for t in TRACE_FILES])
def test_trace_produces_its_expected_plan(trace: Path) -> None:
    expected = json.loads(trace.with_suffix(".expected.json").read_text())
    result = _replay(trace)
    assert _steps(result) == expected["steps"]
    assert result.stats.skipped == expected["skipped"]
    assert {f"{i.playbook}@{i.node}": i.state for i in result.incidents} == expected["incidents"]


def test_every_shipped_playbook_fires_in_some_trace() -> None:
    fired = {s[0] for t in TRACE_FILES for s in json.loads(t.with_suffix(".expected.json").read_text())["steps"]}
    assert {pb.name for pb in load_builtin()} <= fired


def test_application_xid_never_isolates() -> None:
    result = _replay(TRACES / "xid13_application.jsonl")
    assert [s.step for p in result.plans for s in p.steps] == ["notify"]
    assert result.incidents[0].symptoms == 8  # eight GPUs, one incident


def test_cascade_isolates_at_most_the_blast_radius_and_escalates_the_rest() -> None:
    result = _replay(TRACES / "cascade_blast_radius.jsonl")
    isolations = [(s.target, s.decision) for p in result.plans for s in p.steps if s.step == "isolate_node"]
    assert [t for t, d in isolations if d == "act"] == ["node5", "node6"]
    assert [t for t, d in isolations if d == "escalate"] == ["node7", "node8"]
    restarts = [s for p in result.plans for s in p.steps if s.step == "restart_from_checkpoint"]
    assert [s.decision for s in restarts] == ["act", "skip", "escalate", "escalate"]  # one restart, not two
    assert restarts[0].nodes == ["node1", "node2", "node3", "node4"]


def test_one_dead_node_makes_one_incident_acting_on_it() -> None:
    result = _replay(TRACES / "xid79_fell_off_bus.jsonl")
    assert len(result.plans) == 1
    incident = result.plans[0].incident
    assert incident.node == "node3"
    assert set(incident.reporters) == {"node1", "node2", "node3", "node4"}  # the NCCL storm joined it
    restart = next(s for s in result.plans[0].steps if s.step == "restart_from_checkpoint")
    assert restart.nodes == ["node1", "node2", "node4"]


def test_nan_loss_rolls_back_to_before_the_first_nan() -> None:
    result = _replay(TRACES / "nan_loss.jsonl")
    restart = next(s for p in result.plans for s in p.steps if s.step == "restart_from_checkpoint")
    assert restart.checkpoint == "before" and restart.before_step == 512


def test_replay_json_prints_one_object_per_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["playbook", "replay", str(TRACES / "heartbeat_lost.jsonl"), "--json"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["step"], r["target"], r["decision"]) for r in rows] == [
        ("notify", "node2", "act"), ("isolate_node", "node2", "act"),
        ("drain_node", "node2", "act"), ("requeue_job", "node2", "skip"), ("restart_from_checkpoint", "job", "act"),
    ]
    assert {"incident", "playbook", "step", "target", "at", "decision"} <= set(rows[0])
    assert rows[0]["at"] == 1700000009.0
    assert "nothing skipped" in err


def test_replay_of_bad_lines_says_what_it_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["playbook", "replay", str(TRACES / "bad_input.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "skipped 5: 1 console frame" in out and "2 garbage (first at line 49)" in out
    assert "isolate_node" in out


def test_replay_of_a_missing_trace_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["playbook", "replay", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read trace" in err and "Traceback" not in err


def test_replay_with_a_custom_playbook_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "mine.yaml").write_text(
        "name: any-xid\nscope: node\ntrigger:\n  event: xid\nplan:\n  - notify\n")
    assert main(["playbook", "replay", str(TRACES / "xid13_application.jsonl"), "--playbooks", str(tmp_path),
                 "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["playbook"], r["step"], r["target"]) for r in rows] == [("any-xid", "notify", "node2")]


def test_a_hardware_xid_takes_over_a_straggler_waiting_for_confirmation() -> None:
    result = _replay(TRACES / "straggler_then_xid79.jsonl")
    straggler, hardware = result.plans
    assert straggler.incident.playbook == "straggler-persistent"
    assert [s.decision for s in straggler.steps if s.step == "isolate_node"] == ["needs_confirmation"]
    isolate = next(s for s in hardware.steps if s.step == "isolate_node")
    assert (hardware.incident.playbook, isolate.target, isolate.decision) == ("xid-hardware", "node4", "act")
    assert hardware.incident.supersedes == [straggler.incident.id]
    assert straggler.incident.state == "merged" and straggler.incident.merged_into == hardware.incident.id


def test_a_milder_fault_still_merges_into_a_hardware_incident() -> None:
    lines = (TRACES / "straggler_then_xid79.jsonl").read_text().splitlines()
    # The XID first, then the stragglers: the straggler reports join the hardware incident.
    xid = [line for line in lines if '"xid"' in line]
    hello = [line for line in lines if '"hello"' in line]
    rest = [line for line in lines if line not in xid and line not in hello]
    early = [line.replace('"ts":1700000302', '"ts":1700000005') for line in xid]
    result = replay([*hello, *early, *rest], load_builtin())
    assert [p.incident.playbook for p in result.plans] == ["xid-hardware"]
    assert result.plans[0].incident.symptoms > 2
