"""Blame from collective records: the rank that never entered, the one stuck inside, the one that does not answer.

Records are built as the trainer's flight recorder writes them (gridwatch.trainer.flight),
not read from a job: the end-to-end tests (tests/test_blame_e2e.py) take them
from real ranks.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from gridwatch.playbooks.blame_collectives import BlameReason, blame
from gridwatch.wire.control import MAX_DUMP_ENTRIES, CollectiveEntry, CollectiveRecord, CollectiveState, ProcessGroupInfo
from gridwatch.wire.controlsock import read_collectives, read_stacks

S = CollectiveState
NODES = ["node-1", "node-2", "node-3", "node-4"]


def _record(node: str, states: dict[int, CollectiveState], now: float = 100.0, pg: str = "gen3", ordinal: int = 3,
            members: list[str] = NODES) -> CollectiveRecord:
    entries = [CollectiveEntry(pg=pg, seq=seq, op="all_reduce", numel=8, dtype="float32", state=state,
                               scheduled_at=now - 5, started_at=None if state == S.SCHEDULED else now - 5,
                               ended_at=now - 4 if state in (S.COMPLETED, S.FAILED) else None)
               for seq, state in sorted(states.items())]
    return CollectiveRecord(node=node, pid=1, now=now,
                            groups=[ProcessGroupInfo(name=pg, ordinal=ordinal, rank=members.index(node), members=members)],
                            entries=entries)


def _done(upto: int) -> dict[int, CollectiveState]:
    return {s: S.COMPLETED for s in range(upto - 3, upto + 1)}


def test_the_rank_that_never_entered_is_blamed_not_the_ones_that_wait() -> None:
    records = {n: _record(n, {**_done(4180), 4181: S.STARTED}) for n in NODES if n != "node-3"}
    records["node-3"] = _record("node-3", _done(4180))
    v = blame(records)
    assert v is not None and v.seq == 4181 and v.op == "all_reduce"
    assert [(c.rank, c.node, c.reason) for c in v.culprits] == [(2, "node-3", BlameReason.NEVER_ENTERED)]
    assert v.waiting == [0, 1, 3]
    assert v.summary == "rank 2 on node-3 never entered all_reduce #4181 (its newest is #4180); 3 ranks wait in it"


def test_a_rank_that_does_not_answer_is_blamed_while_the_others_wait() -> None:
    records: dict[str, CollectiveRecord | None] = {n: _record(n, {**_done(40), 41: S.FAILED}) for n in NODES[:3]}
    records["node-4"] = None
    v = blame(records)
    assert v is not None and v.nodes == ["node-4"] and v.culprits[0].reason == BlameReason.NO_ANSWER
    assert "rank 3 on node-4 did not answer (frozen or gone) while 3 ranks wait in all_reduce #41" == v.summary


def test_a_rank_late_to_the_collective_beside_one_that_does_not_answer_is_not_blamed() -> None:
    # Seen on a loaded machine: node-2 frozen, node-1 still computing its step after #11, node-3 waiting in #12.
    records: dict[str, CollectiveRecord | None] = {
        "node-1": _record("node-1", _done(11), members=NODES[:3]),
        "node-2": None,
        "node-3": _record("node-3", {**_done(11), 12: S.STARTED}, members=NODES[:3]),
    }
    v = blame(records, min_wait_s=0.5)
    assert v is not None and v.nodes == ["node-2"] and v.culprits[0].reason == BlameReason.NO_ANSWER


def test_a_rank_that_left_its_last_collective_only_just_now_is_not_yet_late() -> None:
    records = {n: _record(n, {**_done(4180), 4181: S.STARTED}) for n in NODES if n != "node-3"}
    records["node-3"] = _record("node-3", _done(4180))  # its #4180 ended 4 s before its record was read
    early = blame(records, min_wait_s=4.5)  # the others have waited 5 s: long enough; node-3 idle 4 s: not yet
    assert early is not None and early.seq == 4181 and early.culprits == []
    late = blame(records, min_wait_s=1.0)
    assert late is not None and late.nodes == ["node-3"]


def test_stuck_inside_scheduled_never_started_or_still_in_it_after_others_completed() -> None:
    records = {n: _record(n, {**_done(9), 10: S.STARTED}) for n in NODES}
    records["node-2"] = _record("node-2", {**_done(9), 10: S.SCHEDULED})
    v = blame(records)
    assert v is not None and [(c.node, c.reason) for c in v.culprits] == [("node-2", BlameReason.STUCK_INSIDE)]
    assert "entered all_reduce #10 but never got through it" in v.summary

    # A broadcast its source finished: the one rank still in it holds the others' next collective up.
    records = {n: _record(n, {**_done(10), 11: S.STARTED}) for n in NODES}
    records["node-1"] = _record("node-1", {**_done(9), 10: S.STARTED})
    v = blame(records)
    assert v is not None and v.seq == 11 and v.nodes == ["node-1"]
    assert v.culprits[0].reason == BlameReason.NEVER_ENTERED and v.culprits[0].last_seq == 10


def test_all_waiting_blames_nobody_and_no_wait_is_no_verdict() -> None:
    v = blame({n: _record(n, {**_done(9), 10: S.STARTED}) for n in NODES})
    assert v is not None and v.culprits == [] and "cannot tell" in v.summary
    assert blame({n: _record(n, _done(9)) for n in NODES}) is None
    # Waiting shorter than the threshold is a collective in flight, not a hang.
    fresh = {n: _record(n, {**_done(9), 10: S.STARTED}) for n in NODES}
    for rec in fresh.values():
        rec.entries[-1].started_at = rec.now - 1.0
    assert blame(fresh, min_wait_s=5.0) is None


def test_the_newest_group_with_a_hang_is_judged_and_a_node_outside_it_is_not_blamed() -> None:
    old = ["node-1", "node-2", "node-3"]
    records: dict[str, CollectiveRecord | None] = {}
    for n in old[:2]:
        rec = _record(n, {**_done(20), 21: S.FAILED}, pg="gen2", ordinal=2, members=old)
        new = _record(n, _done(30), pg="gen3", ordinal=3, members=old[:2])
        rec.groups += new.groups
        rec.entries += new.entries
        records[n] = rec
    records["node-3"] = None  # frozen: the job went on without it in generation 3
    records["node-4"] = _record("node-4", _done(5), pg="other", ordinal=9, members=["node-4"])
    v = blame(records)
    assert v is not None and v.pg == "gen2" and v.nodes == ["node-3"]


def test_the_control_socket_dumps_the_record_while_the_loop_is_stuck_in_a_collective(tmp_path: Path) -> None:
    from gridwatch.trainer.control_server import ControlServer
    from gridwatch.trainer.flight import FlightRecorder
    from gridwatch.wire.protocol import TrainerStatus

    flight = FlightRecorder("node-1")
    flight.join("gen1", 1, 0, ["node-1", "node-2"])
    flight.run("all_reduce", None, lambda: None)
    release = threading.Event()
    stuck = threading.Thread(target=flight.run, args=("all_reduce", None, release.wait), daemon=True)
    server = ControlServer(str(tmp_path / "c.sock"), lambda: TrainerStatus(), "node-1", collectives_fn=flight.dump)
    server.start()
    try:
        stuck.start()
        rec = asyncio.run(read_collectives(server.path))
        assert [(e.seq, e.state) for e in rec.entries] == [(1, S.COMPLETED), (2, S.STARTED)]
        assert rec.groups[0].members == ["node-1", "node-2"] and rec.node == "node-1"
        stacks = asyncio.run(read_stacks(server.path))
        assert any("in wait" in line for line in stacks), stacks  # the stuck thread, seen from the control thread
        assert len(asyncio.run(read_collectives(server.path, limit=1)).entries) == 1
        with pytest.raises(Exception, match="limit"):
            asyncio.run(read_collectives(server.path, limit=0))
    finally:
        release.set()
        server.stop()
    assert MAX_DUMP_ENTRIES >= 256


async def test_a_scene_captured_beside_a_trainer_keeps_its_collectives_record(tmp_path: Path) -> None:
    # A scene is what the operator reads after the fact: the record of every collective must be in it,
    # node text and all (a capture once failed on every trainer-backed node encoding that text).
    import json
    import os

    from gridwatch.agent.agent import Agent
    from gridwatch.agent.config import AgentConfig
    from gridwatch.agent.trainer_link import TrainerLink
    from gridwatch.sshlink.server import Caller
    from gridwatch.trainer.control_server import ControlServer
    from gridwatch.trainer.flight import FlightRecorder
    from gridwatch.wire import protocol as p
    from tests.conftest import wait_until

    flight = FlightRecorder("node-1")
    flight.join("gen1", 1, 0, ["node-1", "node-2"])
    flight.run("all_reduce", None, lambda: None)
    server = ControlServer(str(tmp_path / "c.sock"), lambda: p.TrainerStatus(job=p.Text("run"), pid=os.getpid()),
                           "node-1", collectives_fn=flight.dump)
    server.start()
    agent = Agent(AgentConfig(node_name="node-1", scene_dir=str(tmp_path / "scenes")))
    agent.trainer = TrainerLink(server.path, interval=0.05)
    agent.trainer.start()
    try:
        await wait_until(lambda: agent.trainer.status is not None, 10, "the trainer's status")
        agent.tick()
        res = await agent.act(Caller(username="op", role="operator", key="SHA256:op"),
                              p.Action(id=p.Text("scene-1"), action=p.Text("capture_scene"), args={}))
        assert res.ok, res.message
        kept = json.loads((Path(res.data["path"]) / "collectives.json").read_text())
        assert kept["node"] == "node-1" and [e["seq"] for e in kept["entries"]] == [1]
    finally:
        await agent.trainer.stop()
        server.stop()
