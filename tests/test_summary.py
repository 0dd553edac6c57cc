"""The compact summary stream and the conditions agents evaluate: real agents, real SSH on loopback."""

from __future__ import annotations

import asyncio

from gridwatch.console.fleet.metrics import Metric
from gridwatch.console.fleet.state import StateStore
from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine, agent_watches
from gridwatch.playbooks.loader import load_with_builtin
from gridwatch.sshlink.client import Fleet, FleetOptions
from gridwatch.sshlink.hostlist import parse_endpoints
from gridwatch.wire import protocol as p
from tests.conftest import start_agent, stop_agent, wait_until


def _fleet(ra, keys, **opts):
    frames: list[p.Frame] = []
    fleet = Fleet(parse_endpoints(ra.spec), FleetOptions(key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts),
                                                         backoff_min=0.05, backoff_max=0.3, **opts),
                  on_frame=lambda link, f: frames.append(f))
    return fleet, frames


def _of(frames, cls):
    return [f for f in frames if isinstance(f, cls)]


async def test_summaries_are_small_carry_the_fleet_view_and_switch_to_full_for_an_open_node(keys):
    ra = await start_agent(keys, gpus=8, interval=0.05)
    fleet, frames = _fleet(ra, keys, mode=p.StreamMode.SUMMARY)
    store = StateStore()
    await fleet.start()
    try:
        await wait_until(lambda: len(_of(frames, p.Summary)) >= 3, what="three summaries")
        assert not _of(frames, p.Sample)
        summary = _of(frames, p.Summary)[-1]
        newest_sample = ra.agent.ring.since(summary.seq - 1, 1)[0][0]
        # A tenth of the size of the sample it stands for, or less, and it takes that sample's seq.
        assert len(p.encode(summary)) * 4 < len(newest_sample)
        assert isinstance(p.decode_agent_frame(newest_sample), p.Sample)
        for f in frames:
            store.apply(f, "n")
        node = store.nodes["n"]
        row = store.node_row(node, store.clock.now())
        assert row.gpus == 8 and row.util is not None and row.temp_max is not None and row.mem_pct is not None
        assert all(v is not None for v in store.heatmap(Metric.TEMP)[0].values)
        # Opening the node: full samples, same numbering, nothing counted lost; closing it: summaries again.
        link = next(iter(fleet.links.values()))
        fleet.subscribe_logs("node-1", True)
        await wait_until(lambda: len(_of(frames, p.Sample)) >= 3, what="full samples for the open node")
        assert _of(frames, p.Sample)[-1].gpus[0].sm_clock_mhz is not None  # what only a full sample has
        fleet.subscribe_logs("node-1", False)
        count = len(frames)
        await wait_until(lambda: len(_of(frames[count:], p.Summary)) >= 3, what="summaries again")
        seqs = [f.seq for f in frames if f.seq and not isinstance(f, p.Hello)]
        assert seqs == sorted(seqs) and len(seqs) == len(set(seqs))
        assert link.gaps == 0 and link.bad_frames == 0
    finally:
        await fleet.stop()
        await stop_agent(ra)


async def test_summaries_every_few_ticks_fold_samples_without_a_gap_and_events_come_at_once(keys):
    ra = await start_agent(keys, gpus=2, interval=0.05)
    fleet, frames = _fleet(ra, keys, mode=p.StreamMode.SUMMARY, summary_every=0.5)
    await fleet.start()
    try:
        await wait_until(lambda: len(_of(frames, p.Summary)) >= 2, what="two summaries")
        sim = ra.agent.gpus
        sim.inject("xid", gpu=1, code=79)  # type: ignore[union-attr]
        injected_at = asyncio.get_running_loop().time()
        await wait_until(lambda: any(e.kind == "xid" for e in _of(frames, p.Event)), what="the XID event")
        # Sooner than the next summary would come: events do not wait for the summary cadence.
        assert asyncio.get_running_loop().time() - injected_at < 0.45
        await wait_until(lambda: len(_of(frames, p.Summary)) >= 5, what="five summaries")
        summaries = _of(frames, p.Summary)
        assert all(s.every == 0.5 for s in summaries)
        gaps_between = [b.seq - a.seq for a, b in zip(summaries, summaries[1:])]
        assert min(gaps_between) >= 5  # about ten samples of 0.05 s folded into each
        client = next(iter(ra.agent.clients))
        assert client.folded > 0
        link = next(iter(fleet.links.values()))
        assert link.gaps == 0 and link.every == 0.5, [(type(f).__name__, f.seq, getattr(f, "after", None)) for f in frames]
    finally:
        await fleet.stop()
        await stop_agent(ra)


async def test_the_agent_evaluates_a_for_condition_and_the_engine_opens_one_incident(keys):
    ra = await start_agent(keys, gpus=2, interval=0.05)
    books = [pb for pb in load_with_builtin([]).playbooks if pb.name in ("thermal-throttle", "gpu-temperature")]
    assert books, "the shipped thermal playbooks"
    watches = agent_watches(books)
    assert {str(w.metric) for w in watches} == {"gpu.throttle.thermal", "gpu.temperature"}
    # The shipped windows are a minute: the same conditions with a 0.3 s window keep the test short.
    watches = [p.Watch(name=w.name, metric=w.metric, op=w.op, threshold=w.threshold, hold=0.3) for w in watches]
    fleet, frames = _fleet(ra, keys, mode=p.StreamMode.SUMMARY, watches=watches)
    await fleet.start()
    try:
        await wait_until(lambda: _of(frames, p.Summary), what="a summary")
        ra.agent.gpus.inject("thermal", gpu=0)  # type: ignore[union-attr]
        await wait_until(lambda: [e for e in _of(frames, p.Event) if e.kind == "condition_held"], what="condition_held")
        held = [e for e in _of(frames, p.Event) if e.kind == "condition_held"]
        await wait_until(lambda: len([e for e in _of(frames, p.Event) if e.kind == "condition_held"]) >= 2, what="both held")
        held = [e for e in _of(frames, p.Event) if e.kind == "condition_held"]
        # A throttling GPU runs over 90 C too (the simulation's thermal fault): both conditions, on GPU 0 only.
        assert {(str(e.details["playbook"]), e.gpu) for e in held} == {("thermal-throttle", 0), ("gpu-temperature", 0)}
        assert "gpu.throttle.thermal >= 1 for 0.3s" in {str(e.details["condition"]) for e in held}
        ra.agent.gpus.clear_faults()  # type: ignore[union-attr]
        await wait_until(lambda: [e for e in _of(frames, p.Event) if e.kind == "condition_cleared"], what="cleared")
    finally:
        await fleet.stop()
        await stop_agent(ra)
    # The engine, given the same conditions (its playbooks with the short window), takes the agent's word once.
    from dataclasses import replace

    from gridwatch.playbooks.metrics import MetricCondition

    short = []
    for pb in books:
        cond = pb.trigger.condition  # type: ignore[union-attr]
        short.append(replace(pb, trigger=replace(pb.trigger, condition=MetricCondition(cond.metric, cond.op, cond.threshold, 0.3))))
    engine = Engine(short, ManualClock(1000.0))
    plans = []
    for f in frames:
        plans += engine.observe("n", f)
    thermal = [i for i in engine.incidents(include_closed=True) if i.playbook == "thermal-throttle"]
    assert len(thermal) == 1, [i.summary for i in engine.incidents(include_closed=True)]
    assert "seen by the agent" in thermal[0].summary
    # The same held event twice (a second console's, a replay) is still one incident.
    again = [f for f in frames if isinstance(f, p.Event) and f.kind == "condition_held"][0]
    engine.observe("n", again)
    assert len([i for i in engine.incidents(include_closed=True) if i.playbook == "thermal-throttle"]) == 1


def test_a_watch_the_agent_cannot_evaluate_is_refused_with_a_reason():
    from gridwatch.agent.watch import Watcher

    watcher = Watcher()
    refused = watcher.set(1, [p.Watch(name=p.Text("x"), metric=p.Text("host.cpu"), op=p.Text(">"), threshold=1.0),
                              p.Watch(name=p.Text("y"), metric=p.Text("gpu.util"), op=p.Text("=~"), threshold=1.0)])
    assert len(refused) == 2 and "cannot evaluate metric 'host.cpu'" in refused[0] and "comparison" in refused[1]
    assert not watcher


async def test_a_console_set_to_summaries_every_3_s_gets_them_3_s_apart_and_an_xid_at_once(keys, tmp_path):
    from gridwatch.console.runtime.config import parse_cluster
    from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime

    ra = await start_agent(keys, gpus=2, interval=0.5)
    config = parse_cluster(f'nodes = "{ra.spec}"\nkey = "{keys.operator_key}"\nknown_hosts = "{keys.known_hosts}"\n'
                           "summary_every = 3\n", str(tmp_path / "cluster.toml"))
    runtime = build_runtime(RuntimeOptions.from_cluster(config, acting=False, tick_interval=0.1))
    loop = asyncio.get_running_loop()
    arrived: list[tuple[float, p.Frame]] = []
    runtime.hooks.frame.append(lambda link, frame: arrived.append((loop.time(), frame)))
    statuses: set[str] = set()

    def summaries(n: int) -> bool:
        node = runtime.store.by_name("node-1")
        if node is not None and node.last_frame_at is not None:
            statuses.add(str(runtime.store.status(node)))
        return len([f for _, f in arrived if isinstance(f, p.Summary)]) >= n

    await runtime.start()
    try:
        await wait_until(lambda: summaries(2), timeout=20, what="two summaries")
        ra.agent.gpus.inject("xid", gpu=1, code=79)  # type: ignore[union-attr]
        injected_at = loop.time()
        await wait_until(lambda: any(isinstance(f, p.Event) and f.kind == "xid" for _, f in arrived), what="the XID")
        xid_at = next(t for t, f in arrived if isinstance(f, p.Event) and f.kind == "xid")
        # At once: not held back to the next summary, three seconds off at most.
        assert xid_at - injected_at < 1.0
        await wait_until(lambda: runtime.incidents.incidents(), what="an incident for the XID")  # type: ignore[union-attr]
        await wait_until(lambda: summaries(4), timeout=20, what="four summaries")
        got = [(t, f) for t, f in arrived if isinstance(f, p.Summary)]
        assert all(f.every == 3.0 for _, f in got)
        # Three seconds apart by the agent's clock (six samples of 0.5 s folded into each), and as they arrive.
        apart = [b.ts - a.ts for (_, a), (_, b) in zip(got, got[1:])]
        assert all(2.9 <= d <= 3.1 for d in apart), apart
        assert all(2.5 <= tb - ta <= 3.5 for (ta, _), (tb, _) in zip(got[1:], got[2:]))
        # Nothing lost and never stale: the samples between were folded on purpose.
        link = next(iter(runtime.fleet.links.values()))  # type: ignore[union-attr]
        assert link.gaps == 0 and link.bad_frames == 0 and link.every == 3.0
        assert statuses == {"ok"}, statuses
    finally:
        await runtime.stop()
        await stop_agent(ra)


async def test_summaries_carry_the_trainers_membership_first_and_when_it_changes_and_the_engine_keeps_it(keys, tmp_path):
    from gridwatch.trainer.control_server import ControlServer

    sock = str(tmp_path / "trainer.sock")
    status = p.TrainerStatus(phase=p.Text("training"), step=7, world_size=2,
                             membership=[p.Text("node-1"), p.Text("node-2")])
    server = ControlServer(sock, lambda: status, node="node-1")
    server.start()
    ra = await start_agent(keys, interval=0.05)
    from gridwatch.agent.trainer_link import TrainerLink

    ra.agent.trainer = TrainerLink(sock, interval=0.05)
    ra.agent.trainer.start()
    fleet, frames = _fleet(ra, keys, mode=p.StreamMode.SUMMARY)
    engine = Engine([], clock=ManualClock(0.0))
    fleet.on_frame = lambda link, f: (frames.append(f), engine.observe("node-1", f))
    await fleet.start()
    try:
        def with_trainer():
            return [s for s in _of(frames, p.Summary) if s.trainer is not None]

        await wait_until(lambda: len(with_trainer()) >= 4, what="summaries with the trainer's status")
        said = [s.members for s in with_trainer()]
        assert said[0] == ["node-1", "node-2"] and all(m is None for m in said[1:])  # once, not in every summary
        assert engine.nodes["node-1"].members == {"node-1", "node-2"}
        status.membership = [p.Text("node-1")]  # node-2 left the job
        await wait_until(lambda: any(s.members == ["node-1"] for s in with_trainer()), what="the new membership")
        count = len(with_trainer())
        await wait_until(lambda: len(with_trainer()) >= count + 3, what="more summaries")
        assert all(s.members is None for s in with_trainer()[count:])
        assert engine.nodes["node-1"].members == {"node-1"}
    finally:
        await fleet.stop()
        await ra.agent.trainer.stop()
        await stop_agent(ra)
        server.stop()
