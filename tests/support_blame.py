"""Blaming a stuck rank: a playbook engine watching three training nodes, and a rank's record of its collectives."""

from __future__ import annotations

from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.loader import load_builtin
from gridwatch.wire import protocol as p
from gridwatch.wire.control import CollectiveEntry, CollectiveRecord, CollectiveState, ProcessGroupInfo

NODES = ["node-1", "node-2", "node-3"]


def make_engine(everything: bool = False) -> tuple[Engine, ManualClock]:
    """Three nodes of job "run"; the shipped blame playbooks (or every shipped playbook)."""
    clock = ManualClock(1000.0)
    books = [pb for pb in load_builtin() if everything or pb.name in ("nccl-timeout", "trainer-unresponsive")]
    engine = Engine(books, clock)
    for name in NODES:
        engine.observe(name, p.Hello(node=p.Text(name), ts=clock.now()))
        engine.observe(name, p.Sample(node=p.Text(name), ts=clock.now(),
                                      trainer=p.TrainerStatus(job=p.Text("run"), step=10)))
    return engine, clock


def make_record(node: str, last: int, state: CollectiveState, now: float = 1050.0) -> CollectiveRecord:
    """A rank's record as gridwatch.trainer.flight keeps it: group "g0" of the three nodes, collectives 1..last."""
    entries = [CollectiveEntry(pg=p.Text("g0"), seq=s, op=p.Text("all_reduce"), numel=8, dtype=p.Text("float32"),
                               state=CollectiveState.COMPLETED if s < last else state, scheduled_at=1000.0 + s,
                               started_at=1000.0 + s, ended_at=1000.0 + s if s < last else None)
               for s in range(1, last + 1)]
    return CollectiveRecord(node=p.Text(node), pid=1, now=now, entries=entries, groups=[
        ProcessGroupInfo(name=p.Text("g0"), ordinal=0, rank=NODES.index(node), members=[p.Text(n) for n in NODES])])
