"""Which rank is stuck, through the product: the runtime reads the records, the incident blames the culprit, the playbook acts on it.

The engine half runs on a simulated clock with verdicts built from records
(what gridwatch.playbooks.blame_collectives returns for them); the end-to-end half is a
real 3-node job (torch, gloo, the coordinator) under real agents on loopback
SSH and a runtime built by ``build_runtime``, with one node's worker frozen.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest
from loguru import logger

from gridwatch.console.demo.cluster import trainer_unavailable
from gridwatch.playbooks.blame_collectives import BlameReason, CollectiveVerdict, Culprit, blame
from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.store import IncidentStore
from gridwatch.wire import protocol as p
from gridwatch.wire.control import CollectiveState
from tests.conftest import start_agent, stop_agent, wait_until, wait_until_sync
from tests.support_blame import NODES, make_engine, make_record


def _node3_never_entered() -> CollectiveVerdict:
    verdict = blame({"node-1": make_record("node-1", 41, CollectiveState.STARTED),
                     "node-2": make_record("node-2", 41, CollectiveState.STARTED),
                     "node-3": make_record("node-3", 40, CollectiveState.COMPLETED)}, min_wait_s=1.0)
    assert verdict is not None and verdict.nodes == ["node-3"]
    return verdict


def _timeout(engine: Engine, node: str, clock: ManualClock) -> list:
    return engine.observe(node, p.Event(node=p.Text(node), ts=clock.now(), kind=p.Text("nccl_timeout"),
                                        severity=p.Text("error"), message=p.Text("Watchdog caught collective operation timeout")))


def test_the_verdict_wins_over_the_one_silent_node_and_plans_before_the_storm_settles() -> None:
    engine, clock = make_engine()
    # node-1 and node-3 time out; node-2 stays silent, so the old rule would isolate node-2.
    assert _timeout(engine, "node-1", clock) == [] and _timeout(engine, "node-3", clock) == []
    (incident,) = engine.incidents()
    clock.advance(2.0)
    plan = engine.blame(incident.id, _node3_never_entered())
    assert plan is not None, "planned at once, not after the 30 s settle"
    assert plan.incident.node == "node-3" and plan.incident.blamed == ["node-3"]
    assert plan.incident.summary == "rank 2 on node-3 never entered all_reduce #41 (its newest is #40); 2 ranks wait in it"
    isolate = next(s for s in plan.steps if s.step == "isolate_node")
    assert isolate.nodes == ["node-3"] and isolate.decision == "act"
    restart = next(s for s in plan.steps if s.step == "restart_from_checkpoint")
    assert restart.nodes == ["node-1", "node-2"]
    clock.advance(60.0)
    later = engine.tick()  # one tick: the blamed incident is not planned a second time
    assert all(pl.incident.id != incident.id for pl in later), later


def test_without_a_verdict_the_silent_node_rule_still_decides() -> None:
    engine, clock = make_engine()
    _timeout(engine, "node-1", clock)
    _timeout(engine, "node-3", clock)
    clock.advance(31.0)
    (plan,) = engine.tick()
    assert plan.incident.node == "node-2" and plan.incident.blamed == []


def test_a_frozen_trainer_reported_late_is_isolated_by_the_verdict_kept_for_its_job() -> None:
    engine, clock = make_engine()
    frozen = CollectiveVerdict(pg="g0", seq=41, op="all_reduce", world=3, waiting=[0, 1],
                               culprits=[Culprit(rank=2, node="node-3", reason=BlameReason.NO_ANSWER)],
                               summary="rank 2 on node-3 did not answer (frozen or gone) while 2 ranks wait in all_reduce #41")
    assert engine.hang_verdict("run", frozen) == []  # no incident yet: kept for the job
    clock.advance(5.0)  # the agent's grace later, node-3's trainer is reported gone
    (plan,) = engine.observe("node-3", p.Event(node=p.Text("node-3"), ts=clock.now(), kind=p.Text("trainer_exit"),
                                               severity=p.Text("error"), message=p.Text("stopped answering")))
    assert [s.step for s in plan.steps] == ["capture_scene", "isolate_node", "notify"]
    assert plan.incident.blamed == ["node-3"] and "did not answer" in plan.incident.blame_why
    # A verdict older than BLAME_FRESH names nothing: a later trainer exit gets the plain plan.
    engine2, clock2 = make_engine()
    engine2.hang_verdict("run", frozen)
    clock2.advance(120.0)
    for name in NODES:
        engine2.observe(name, p.Hello(node=p.Text(name), ts=clock2.now()))
    (plain,) = engine2.observe("node-3", p.Event(node=p.Text("node-3"), ts=clock2.now(), kind=p.Text("trainer_exit"),
                                                 severity=p.Text("error"), message=p.Text("stopped answering")))
    assert [s.step for s in plain.steps] == ["capture_scene", "notify"] and plain.incident.blamed == []


def test_the_blame_is_kept_in_sqlite_and_read_back(tmp_path: Path) -> None:
    engine, clock = make_engine()
    _timeout(engine, "node-1", clock)
    (incident,) = engine.incidents()
    plan = engine.blame(incident.id, _node3_never_entered())
    assert plan is not None
    store = IncidentStore(tmp_path / "incidents.db")
    try:
        store.save_plan(plan)
        rec = store.incident(plan.incident.id)
        assert rec is not None and rec.blamed == ["node-3"] and rec.blame_why.startswith("rank 2 on node-3")
    finally:
        store.close()
    raw = sqlite3.connect(tmp_path / "incidents.db")
    assert raw.execute("SELECT blamed, blame_why FROM incidents").fetchone()[0] == '["node-3"]'
    raw.close()


async def test_the_operator_sees_who_is_blamed_in_the_incident_detail_and_the_headless_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gridwatch.console.cli.ui import _headless
    from gridwatch.console.runtime.core import ConsoleRuntime
    from gridwatch.console.runtime.incidents import StoreIncidents
    from gridwatch.console.tui.screens.incidents import incident_detail

    engine, clock = make_engine()
    _timeout(engine, "node-1", clock)
    (incident,) = engine.incidents()
    plan = engine.blame(incident.id, _node3_never_entered())
    assert plan is not None
    store = IncidentStore(tmp_path / "incidents.db")
    try:
        store.save_plan(plan)
        incidents = StoreIncidents(store)
        row = incidents.detail(plan.incident.id)
        assert row is not None and row.blamed == ["node-3"]
        shown = incident_detail(row).plain
        assert ("blamed     node-3  rank 2 on node-3 never entered all_reduce #41 (its newest is #40); "
                "2 ranks wait in it") in shown
        runtime = ConsoleRuntime(incidents=incidents)
        assert await _headless(runtime, 0.3) == 0
        out = capsys.readouterr().out
        assert (f"incident {plan.incident.id} blames node-3: rank 2 on node-3 never entered all_reduce #41"
                in out), out
    finally:
        store.close()


def test_a_record_read_through_the_agent_decodes_in_the_runtime_and_is_cleaned() -> None:
    import msgspec

    from gridwatch.console.runtime.hangs import decode_record
    from gridwatch.trainer.flight import FlightRecorder

    flight = FlightRecorder("node-1\x1b[31m")
    flight.join("gen4", 4, 0, NODES)
    flight.run("all_reduce", None, lambda: None)
    record = flight.dump(16)
    # As the agent sends it (agents/actions.py dump_collectives) and the console's frame decoder hands it over.
    frame = p.ActionResult(node=p.Text("node-1"), ts=1.0, id=p.Text("a1"), action=p.Text("dump_collectives"), ok=True,
                           data={p.Text("record"): msgspec.to_builtins(record, enc_hook=p.text_enc_hook)})
    got = p.decode_agent_frame(p.encode(frame))
    assert isinstance(got, p.ActionResult)
    back = decode_record(got.data["record"])
    assert back.node == "node-1[31m" and back.groups[0].members == NODES
    assert [(e.pg, e.seq, e.state) for e in back.entries] == [("gen4", 1, CollectiveState.COMPLETED)]


# ------------------------------------------------------------------ end to end

@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(trainer_unavailable() is not None, reason="the trainer is not in this build")
async def test_a_frozen_worker_in_a_real_job_is_blamed_and_isolated_by_the_runtime(keys, tmp_path: Path) -> None:
    from gridwatch.agent.trainer_link import TrainerLink
    from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
    from gridwatch.sshlink.hostlist import parse_endpoints
    from gridwatch.trainer.launch import start_local_run
    from gridwatch.wire.controlsock import read_status
    from tests.support_trainer import last, tiny

    cfg = tiny(tmp_path / "run", steps=100_000, tier0_every=1000, tier1_every=1000, tier2_every=1000,
               progress_deadline_s=6.0)
    job = await asyncio.to_thread(start_local_run, cfg, NODES)
    agents = []
    runtime = None
    pid = 0
    try:
        await asyncio.to_thread(wait_until_sync, lambda: job.last_step() >= 3 and last(job).get("world_size") == 3,
                                90, "three nodes training")
        for name in NODES:
            ra = await start_agent(keys, name=name, gpus=1, interval=0.25)
            ra.agent.trainer = TrainerLink(job.socket_path(name), interval=0.1, grace=5.0)
            ra.agent.trainer.start()
            agents.append(ra)
        runtime = build_runtime(RuntimeOptions(endpoints=parse_endpoints(",".join(a.spec for a in agents)),
                                               key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts),
                                               db_path=str(tmp_path / "incidents.db"), operator="alice",
                                               tick_interval=0.1))
        await runtime.start()
        await wait_until(lambda: len(runtime.engine.live_nodes()) == 3 and runtime.job_step() is not None, 20,
                         "the runtime sees three nodes training")
        pid = int((await read_status(job.socket_path("node-3"))).pid or 0)
        os.kill(pid, signal.SIGSTOP)
        store = runtime.plan_store

        def blamed() -> list:
            return [i for i in store.incidents() if i.blamed]

        frozen_at = time.monotonic()
        await wait_until(lambda: blamed(), 30, "an incident blaming the frozen node within 30 s")
        took = time.monotonic() - frozen_at
        (rec,) = blamed()
        assert rec.blamed == ["node-3"] and rec.node == "node-3", (rec.node, rec.blamed, rec.blame_why)
        assert "rank 2 on node-3" in rec.blame_why and "did not answer" in rec.blame_why
        logger.info("node-3 frozen; blamed {:.1f} s later: {}", took, rec.blame_why)
        await wait_until(lambda: any(s.step == "isolate_node" and s.state == "done" for s in store.steps(rec.id)),
                         30, "node-3 isolated")
        assert agents[2].agent.isolated and not agents[0].agent.isolated and not agents[1].agent.isolated
        # No incident of this hang acts on a node that only waited.
        for other in store.incidents():
            assert all(s.target != n for s in store.steps(other.id) if s.step == "isolate_node" for n in NODES[:2])
    finally:
        if pid:
            os.kill(pid, signal.SIGCONT)
        if runtime is not None:
            await runtime.stop()
        for ra in agents:
            await ra.agent.trainer.stop()
            await stop_agent(ra)
        await asyncio.to_thread(job.stop)


def test_a_crashed_trainer_is_not_taken_out_even_when_the_records_name_its_rank() -> None:
    """The ranks' records name the rank that never entered the collective; its process is gone (XID 13 killed
    it, an exception): the shipped playbooks keep the scene and tell, and the node stays (torchrun restarts it)."""
    engine, clock = make_engine(everything=True)
    gone = CollectiveVerdict(pg="g0", seq=41, op="all_reduce", world=3, waiting=[0, 1],
                             culprits=[Culprit(rank=2, node="node-3", reason=BlameReason.NO_ANSWER)],
                             summary="rank 2 on node-3 did not answer (frozen or gone) while 2 ranks wait in all_reduce #41")
    engine.hang_verdict("run", gone)
    clock.advance(5.0)
    plans = engine.observe("node-3", p.Event(node=p.Text("node-3"), ts=clock.now(), kind=p.Text("trainer_exit"),
                                             severity=p.Text("error"), message=p.Text("stopped answering"),
                                             details={p.Text("process"): p.Text("gone")}))
    assert [pl.incident.playbook for pl in plans] == ["trainer-exited"]
    assert [s.step for s in plans[0].steps] == ["capture_scene", "notify"]
    assert not any(s.step in ("isolate_node", "drain_node") for pl in plans for s in pl.steps)
