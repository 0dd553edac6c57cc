"""A restarted console seeds its engine from the real SQLite store: it neither acts twice nor forgets its guards."""

from __future__ import annotations

from pathlib import Path

from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.executor import Executor
from gridwatch.playbooks.loader import load_builtin
from gridwatch.playbooks.plans import Plan
from gridwatch.playbooks.store import IncidentStore
from gridwatch.wire.protocol import Event, Hello, Sample, TrainerStatus
from tests.support_executor import FakeNotifier, FakeRunner, FakeSink

NODES = [f"node{i}" for i in range(1, 9)]


def _console(db: Path, clock: ManualClock, seed: bool) -> tuple[Engine, Executor, FakeSink]:
    engine = Engine(load_builtin(), clock)
    store = IncidentStore(db, clock)
    if seed:
        engine.seed_from(store)
    sink = FakeSink()
    return engine, Executor(store, sink, clock=clock, runner=FakeRunner(), notifier=FakeNotifier()), sink


def _connect(engine: Engine, isolated: set[str] = frozenset()) -> None:
    for name in NODES:
        engine.observe(name, Hello(node=name, interval=1.0, isolated=name in isolated))
        engine.observe(name, Sample(node=name, isolated=name in isolated,
                                    trainer=TrainerStatus(job="llm", step=50, checkpoints={"1": 40})))


def _xid(engine: Engine, node: str, code: int) -> list[Plan]:
    return engine.observe(node, Event(node=node, kind="xid", code=code, gpu=0, severity="critical"))


async def test_a_fault_replayed_after_a_restart_is_not_acted_on_twice(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    engine, executor, sink = _console(tmp_path / "incidents.db", clock, seed=False)
    _connect(engine)
    (plan,) = _xid(engine, "node2", 94)  # contained ECC: restart the job from its checkpoint
    await executor.run(plan)
    assert [a for _, a, _ in sink.calls].count("restart_from") == len(NODES)
    executor.store.close()

    clock.advance(60.0)  # the console restarts; the agent resends the frames of the last minutes
    fresh, _, _ = _console(tmp_path / "incidents.db", clock, seed=False)
    _connect(fresh)
    assert _xid(fresh, "node2", 94) != []  # without its memory it would restart the job again
    engine2, executor2, sink2 = _console(tmp_path / "incidents.db", clock, seed=True)
    _connect(engine2)
    assert _xid(engine2, "node2", 94) == []
    assert engine2.incident(plan.incident.id).symptoms == 2  # the replayed event joined the old incident
    assert await executor2.resume() == [] and sink2.calls == []


async def test_the_blast_radius_survives_a_restart(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    engine, executor, _ = _console(tmp_path / "incidents.db", clock, seed=False)
    _connect(engine)
    for node in ("node1", "node2"):  # two of eight nodes isolated: the limit for xid-hardware
        (plan,) = _xid(engine, node, 79)
        assert next(s for s in plan.steps if s.step == "isolate_node").decision == "act"
        await executor.run(plan)
    executor.store.close()

    clock.advance(900.0)  # past the dedup window, inside the blast-radius hour
    engine2, _, _ = _console(tmp_path / "incidents.db", clock, seed=True)
    _connect(engine2, isolated={"node1", "node2"})
    assert engine2.live_nodes("llm") == NODES[2:]
    (plan,) = _xid(engine2, "node3", 79)
    isolate = next(s for s in plan.steps if s.step == "isolate_node")
    assert isolate.decision == "escalate" and "blast radius" in isolate.reason


async def test_a_node_put_back_while_the_console_was_down_is_back_in_the_job(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    engine, executor, _ = _console(tmp_path / "incidents.db", clock, seed=False)
    _connect(engine)
    (plan,) = _xid(engine, "node5", 79)
    await executor.run(plan)
    executor.store.close()

    clock.advance(120.0)
    engine2, _, _ = _console(tmp_path / "incidents.db", clock, seed=True)
    assert "node5" not in engine2.live_nodes()
    _connect(engine2)  # node5's agent says it is not isolated: an operator put it back
    assert "node5" in engine2.live_nodes("llm")


async def test_a_node_repaired_and_put_back_no_longer_counts_against_the_blast_radius(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    engine, executor, _ = _console(tmp_path / "incidents.db", clock, seed=False)
    _connect(engine)
    for node in ("node1", "node2"):  # two of eight: the limit for xid-hardware within the hour
        (plan,) = _xid(engine, node, 79)
        await executor.run(plan)
    clock.advance(600.0)
    (held,) = _xid(engine, "node3", 79)
    assert next(s for s in held.steps if s.step == "isolate_node").decision == "escalate"
    for incident in list(engine.incidents()):
        engine.resolve(incident.id)
    engine.observe("node1", Event(node="node1", kind="unisolated", severity="info"))  # the technician put it back
    clock.advance(60.0)
    (plan,) = _xid(engine, "node4", 79)
    assert next(s for s in plan.steps if s.step == "isolate_node").decision == "act", \
        "one node out of eight now: taking a second out is within the limit"
