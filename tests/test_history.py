"""Is this node a repeat offender: history per node and GPU in SQLite, the rules over it, shadow mode, the CLI."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from gridwatch.console.cli import main
from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.executor import Executor
from gridwatch.playbooks.history import HistoryKind, lemon_raw, mean_time_between
from gridwatch.playbooks.loader import load_builtin
from gridwatch.playbooks.plans import Plan
from gridwatch.playbooks.replay import replay
from gridwatch.playbooks.schema import check_text
from gridwatch.playbooks.store import IncidentStore, StoreError
from gridwatch.playbooks.store_db import SCHEMA_VERSION
from gridwatch.wire.protocol import Event, GpuInfo, Hello, Text
from tests.support_executor import FakeNotifier, FakeRunner, FakeSink

DATA = Path(__file__).parent / "data" / "history"
TRACES = Path(__file__).parent / "traces" / "history"
T0 = 1_700_000_000.0
DAY = 86400.0

RULES = """\
name: gpu-xid
severity: critical
scope: gpu
dedup_window: 1m
trigger: {event: xid, match: {code: [119, 13]}}
plan: [capture_scene, reset_gpu, isolate_node, notify]
guards:
  history:
    same_gpu: {times: 2, window: 7d%(shadow)s}
    same_xid: {times: 2, window: 1d%(shadow)s}
    remediations: {times: 3, window: 7d%(shadow)s}
"""


def _books(shadow: bool | None = None, text: str = RULES) -> list:
    books, errors = check_text(text % {"shadow": "" if shadow is None else f", shadow: {str(shadow).lower()}"}, "t.yaml")
    assert not errors, errors
    return books


def _hello(node: str, uuids: list[str]) -> Hello:
    return Hello(node=Text(node), interval=300.0,
                 gpus=[GpuInfo(index=i, uuid=Text(u), name=Text("NVIDIA H100 80GB HBM3")) for i, u in enumerate(uuids)])


def _xid(engine: Engine, node: str, gpu: int, code: int) -> list[Plan]:
    engine.tick()  # incidents quiet for their dedup window close, as on the console's timer
    return engine.observe(node, Event(node=Text(node), kind=Text("xid"), code=code, gpu=gpu, severity=Text("critical")))


def _engine(clock: ManualClock, books: list) -> Engine:
    engine = Engine(books, clock)
    for node in ("node1", "node2", "node3"):
        engine.observe(node, _hello(node, [f"GPU-{node}-{i}" for i in range(4)]))
    return engine


def _acting(plan: Plan) -> list[tuple[str, str]]:
    return [(s.step, s.decision) for s in plan.steps]


# ------------------------------------------------------------------ the store: schema 3 from a real schema 2 file


def test_a_schema_2_database_made_by_gridwatch_gets_its_history_and_keeps_everything(tmp_path: Path) -> None:
    db = tmp_path / "incidents.db"
    shutil.copy(DATA / "incidents-schema2.db", db)
    store = IncidentStore(db, ManualClock(T0 + 4000))
    try:
        rows = store.history()
        kinds = [(e.kind, e.node, e.what) for e in rows]
        assert kinds.count((HistoryKind.INCIDENT, "node2", "xid")) == 2
        assert (HistoryKind.INCIDENT, "node3", "xid") in kinds
        assert [e.code for e in rows if e.kind == HistoryKind.INCIDENT] == [119, 119, 13]  # from the summaries
        remediations = [(e.what, e.outcome) for e in rows if e.kind == HistoryKind.REMEDIATION and e.node == "node2"]
        assert ("reset_gpu", "done") in remediations and len(remediations) == 4
        (back,) = [e for e in rows if e.kind == HistoryKind.RETURN]
        assert (back.node, back.who, back.reason) == ("node2", "alice", "GPU reseated")
        assert len(store.incidents()) == 3 and store.steps(store.incidents()[-1].id)  # nothing lost
        gpu = store.node_history("node2", gpu=3)
        assert gpu.total_incidents == 2 and gpu.mtbi_s == 1800.0
    finally:
        store.close()
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    count = raw.execute("SELECT count(*) FROM history").fetchone()[0]
    raw.close()
    IncidentStore(db).close()  # opened again: nothing added twice
    raw = sqlite3.connect(db)
    assert raw.execute("SELECT count(*) FROM history").fetchone()[0] == count
    raw.execute("PRAGMA user_version = 4")
    raw.commit()
    raw.close()
    with pytest.raises(StoreError, match="newer gridwatch"):
        IncidentStore(db)


def test_a_bad_row_in_a_schema_2_file_is_named_and_the_rest_carries_over(tmp_path: Path) -> None:
    db = tmp_path / "incidents.db"
    shutil.copy(DATA / "incidents-schema2.db", db)
    raw = sqlite3.connect(db)
    raw.execute("UPDATE incidents SET detected_at = 'yesterday' WHERE node = 'node3'")
    raw.commit()
    raw.close()
    store = IncidentStore(db)
    try:
        assert any("incidents row" in note and "history" in note for note in store.bad_rows)
        assert {e.node for e in store.history() if e.kind == HistoryKind.INCIDENT} == {"node2"}
    finally:
        store.close()


# ------------------------------------------------------------------ the rules, on an injected clock


def test_the_same_gpu_failing_again_is_the_hardware_and_follows_the_gpu_to_another_node() -> None:
    clock = ManualClock(T0)
    engine = _engine(clock, _books())
    (first,) = _xid(engine, "node1", 2, 119)
    assert ("reset_gpu", "act") in _acting(first)
    clock.advance(DAY)
    # The GPU is moved to node3's slot 0; node1 gets a new one.
    engine.observe("node1", _hello("node1", ["GPU-node1-0", "GPU-node1-1", "GPU-new-7", "GPU-node1-3"]))
    engine.observe("node3", _hello("node3", ["GPU-node1-2", "GPU-node3-1", "GPU-node3-2", "GPU-node3-3"]))
    (again,) = _xid(engine, "node3", 0, 119)
    assert [s for s, _ in _acting(again)] == ["capture_scene", "isolate_node", "drain_node", "requeue_job",
                                               "restart_from_checkpoint", "notify"]  # the inspection plan
    assert "GPU-node1-2" in again.incident.summary and "earlier on node1" in again.incident.summary
    (verdict,) = [e for e in engine.history.take(again.incident.id) if e.kind == HistoryKind.DECISION]
    assert (verdict.verdict, verdict.gpu_uuid, verdict.shadow) == ("hardware", "GPU-node1-2", False)
    clock.advance(DAY)
    engine.observe("node1", Event(node=Text("node1"), kind=Text("unisolated"), severity=Text("info")))
    (fresh,) = _xid(engine, "node1", 2, 119)  # the new GPU in the old slot has no past
    assert ("reset_gpu", "act") in _acting(fresh)


def test_the_same_xid_on_another_gpu_of_one_node_is_software_and_does_not_isolate() -> None:
    clock = ManualClock(T0)
    engine = _engine(clock, _books())
    (first,) = _xid(engine, "node2", 0, 13)
    assert ("isolate_node", "act") in _acting(first)
    engine.observe("node2", Event(node=Text("node2"), kind=Text("unisolated"), severity=Text("info")))
    clock.advance(3600)
    (second,) = _xid(engine, "node2", 3, 13)
    steps = [s for s, _ in _acting(second)]
    assert "isolate_node" not in steps and "notify" in steps
    assert "software or the application" in second.incident.summary
    clock.advance(2 * DAY)  # outside the window: a fresh XID 13 is the node's again
    engine.observe("node2", Event(node=Text("node2"), kind=Text("unisolated"), severity=Text("info")))
    (later,) = _xid(engine, "node2", 1, 13)
    assert ("isolate_node", "act") in _acting(later)


def test_the_third_remediation_in_a_week_keeps_the_node_out_until_forced(tmp_path: Path) -> None:
    clock = ManualClock(T0)
    engine = _engine(clock, _books())
    store = IncidentStore(tmp_path / "incidents.db", clock)
    try:
        for day, gpu in enumerate((0, 1, 2)):
            clock.set(T0 + day * 2 * DAY)
            engine.observe("node1", Event(node=Text("node1"), kind=Text("unisolated"), severity=Text("info")))
            (plan,) = _xid(engine, "node1", gpu, 119 if day != 1 else 13)
            store.save_plan(plan)
            store.record_history(engine.history.take(plan.incident.id))
        assert "remediated 3 times within 7d" in plan.incident.summary
        why = store.return_refusal("node1")
        assert why is not None and why.startswith("node1 stays out of service: remediated 3 times")
        assert "\n" not in why
        audit = [a.what for a in store.audit_log(plan.incident.id)]
        assert "history remediations: hold" in audit
        store.audit("alice", "return_to_service node1", "burn-in passed", phase="after", outcome="nothing to resume")
        assert store.return_refusal("node1") is None  # returned: the hold is over until the next verdict
    finally:
        store.close()


def test_shadow_mode_changes_nothing_but_the_record(tmp_path: Path) -> None:
    runs = {}
    for shadow in (None, True):
        clock = ManualClock(T0)
        engine = _engine(clock, _books(shadow))
        store = IncidentStore(tmp_path / f"shadow-{shadow}.db", clock)
        plans: list[Plan] = []
        for hours, (node, gpu, code) in enumerate([("node1", 0, 119), ("node1", 0, 119), ("node2", 0, 13),
                                                   ("node2", 1, 13), ("node1", 0, 119)]):
            clock.set(T0 + hours * 3600)
            engine.observe(node, Event(node=Text(node), kind=Text("unisolated"), severity=Text("info")))
            for plan in _xid(engine, node, gpu, code):
                store.save_plan(plan)
                store.record_history(engine.history.take(plan.incident.id))
                plans.append(plan)
        runs[shadow] = (plans, store)
    acting, shadowed = runs[None][0], runs[True][0]
    plain = _books(text=RULES.replace("  history:\n", "  cooldown: 0s\n").split("    same_gpu")[0])
    clock = ManualClock(T0)
    baseline = _engine(clock, plain)
    expected = []
    for hours, (node, gpu, code) in enumerate([("node1", 0, 119), ("node1", 0, 119), ("node2", 0, 13),
                                               ("node2", 1, 13), ("node1", 0, 119)]):
        clock.set(T0 + hours * 3600)
        baseline.observe(node, Event(node=Text(node), kind=Text("unisolated"), severity=Text("info")))
        expected += [_acting(p) for p in _xid(baseline, node, gpu, code)]
    assert [_acting(p) for p in shadowed] == expected  # shadow: the plans of a playbook without the rules
    assert [_acting(p) for p in acting] != expected  # the same rules, acting, change them
    store = runs[True][1]
    try:
        decided = [e for e in store.history() if e.kind == HistoryKind.DECISION]
        assert {e.what for e in decided} == {"same_gpu", "same_xid", "remediations"}
        assert all(e.shadow for e in decided)
        assert any("(shadow: nothing changed)" in a.what for a in store.audit_log())
        assert any("would have judged hardware" in n for p in shadowed for n in p.incident.notes)
        assert store.return_refusal("node1") is None  # a shadow hold keeps nothing out
    finally:
        for _, s in runs.values():
            s.close()


def test_a_history_rule_that_reads_a_gpu_needs_scope_gpu() -> None:
    _, errors = check_text("name: x\ntrigger: {event: xid}\nplan: [notify]\nguards:\n  history:\n"
                           "    same_gpu: {times: 2}\n", "t.yaml")
    assert [e.message for e in errors] == ["guards.history.same_gpu reads the incident's GPU; it needs scope: gpu"]
    _, errors = check_text("name: x\nscope: gpu\ntrigger: {event: xid}\nplan: [notify]\nguards:\n  history:\n"
                           "    same_xid: {tims: 2}\n", "t.yaml")
    assert "unknown key 'tims' (did you mean 'times'?)" in errors[0].message


def test_lemon_and_mean_time_between_incidents() -> None:
    from gridwatch.playbooks.history import HistoryEntry

    def incident(age_days: float, severity: str) -> HistoryEntry:
        return HistoryEntry(kind=HistoryKind.INCIDENT, at=T0 - age_days * DAY, node="n", severity=severity)

    assert lemon_raw([incident(0, "critical"), incident(7, "warning"), incident(31, "critical")], T0) == 4.5
    assert mean_time_between([T0, T0 + 60, T0 + 180]) == 90.0 and mean_time_between([T0]) is None


# ------------------------------------------------------------------ replayed traces


def test_the_history_trace_replays_to_its_expected_plan() -> None:
    books, errors = check_text((TRACES / "playbooks.yaml").read_text(), "playbooks.yaml")
    assert not errors
    with (TRACES / "gpu_moved_and_app_xid.jsonl").open("rb") as fh:
        result = replay(fh, books)
    assert result.start is not None
    steps = [[s.playbook, s.step, s.target, s.decision, round(s.at - result.start, 3)]
             for p in result.plans for s in p.steps]
    assert steps == json.loads((TRACES / "gpu_moved_and_app_xid.expected.json").read_text())["steps"]
    summaries = [p.incident.summary for p in result.plans]
    assert "GPU-aaaa0001" in summaries[1] and "hardware" in summaries[1]
    assert "software or the application" in summaries[3]


# ------------------------------------------------------------------ seeded after a restart


async def test_a_restarted_console_still_counts_the_resets_of_the_repeat_rule(tmp_path: Path) -> None:
    clock = ManualClock(T0)
    db = tmp_path / "incidents.db"
    for _ in range(2):  # two resets of node2's GPU 3 for XID 119, each by a console that then restarts
        engine = Engine(load_builtin(), clock)
        engine.seed_from(IncidentStore(db, clock))
        store = IncidentStore(db, clock)
        executor = Executor(store, FakeSink(), clock=clock, runner=FakeRunner(), notifier=FakeNotifier())
        for node in ("node1", "node2", "node3", "node4"):
            engine.observe(node, _hello(node, [f"GPU-{node}-{i}" for i in range(4)]))
        (plan,) = _xid(engine, "node2", 3, 119)
        assert "reset_gpu" in [s.step for s in plan.steps]
        await executor.run(plan)
        store.record_history(engine.history.take(plan.incident.id))
        store.close()
        clock.advance(1800)
    engine = Engine(load_builtin(), clock)
    summary = engine.seed_from(IncidentStore(db, clock))
    assert summary.repeats == 2
    for node in ("node1", "node2", "node3", "node4"):
        engine.observe(node, _hello(node, [f"GPU-{node}-{i}" for i in range(4)]))
    (third,) = _xid(engine, "node2", 3, 119)
    assert "isolate_node" in [s.step for s in third.steps] and "hardware inspection" in third.incident.summary


# ------------------------------------------------------------------ gridwatch history


def _db_with_history(tmp_path: Path) -> Path:
    db = tmp_path / "incidents.db"
    shutil.copy(DATA / "incidents-schema2.db", db)
    IncidentStore(db).close()
    return db


def test_history_cli_prints_the_node_its_gpu_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = _db_with_history(tmp_path)
    assert main(["history", "node2", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("node2: 2 incidents, 2 remediated, 1 returned to service; MTBI 30m; lemon ")
    assert "xid 119" in out and "reset_gpu done" in out
    assert main(["history", "node2", "--gpu", "3", "--db", str(db), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu"] == 3 and [i["code"] for i in data["incidents"]] == [119, 119]
    assert main(["history", "node9", "--db", str(db)]) == 0
    assert "no incident recorded (nodes with a history: node2, node3)" in capsys.readouterr().out


def test_history_cli_exit_codes_and_help(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["history", "node2", "--db", str(tmp_path / "missing.db")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "no incident database" in err
    with pytest.raises(SystemExit) as done:
        main(["history", "--help"])
    assert done.value.code == 0 and "lemon score" in capsys.readouterr().out
    db = _db_with_history(tmp_path)
    store = IncidentStore(db)
    clock_now = store.clock.now()
    store.close()
    raw = sqlite3.connect(db)  # a hold decided now keeps node2 out: the command says so and exits 1
    raw.execute("INSERT INTO history (at, kind, node, incident, what, verdict, reason) VALUES (?, 'decision', 'node2',"
                " 'x', 'remediations', 'hold', 'remediated 3 times within 7d: not returned to service by itself')",
                (clock_now,))
    raw.commit()
    raw.close()
    assert main(["history", "node2", "--db", str(db)]) == 1
    assert "kept out: node2 stays out of service: remediated 3 times" in capsys.readouterr().out
