"""The demo: its summary arithmetic, chaos choices, the state file, `gridwatch fault`, and a clean shutdown."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from gridwatch.console.demo.chaos import Chaos, FaultSpec
from gridwatch.console.demo.progress import StepPoint, TrainingWatch
from gridwatch.console.demo.summary import FaultRecord, IncidentFacts, goodput, paced_goodput, steps_lost, summarize
from tests.conftest import wait_until, wait_until_sync

PY = sys.executable


def points(*pairs: tuple[float, int]) -> list[StepPoint]:
    return [StepPoint(at, step) for at, step in pairs]


def test_steps_lost_counts_redone_steps_after_a_restart() -> None:
    # Trained to 12, restarted from the checkpoint at 10: steps 10, 11, 12 are done twice.
    pts = points((0, 8), (1, 9), (2, 10), (3, 11), (4, 12), (10, 10), (11, 11), (12, 12), (13, 13))
    assert steps_lost(pts) == 3


def test_goodput_is_one_without_faults_and_lower_with_a_stall() -> None:
    steady = points(*[(float(i), i) for i in range(11)])
    assert goodput(steady, end=10.0) == pytest.approx(1.0)
    stalled = points(*[(float(i), i) for i in range(6)], *[(float(i + 10), i) for i in range(6, 11)])
    # 9 steps of 1 s and one 11 s interval: 3 typical steps of it count as a slow step, the rest is a stall.
    assert goodput(stalled, end=20.0) == pytest.approx(12 / 20)
    assert paced_goodput(stalled, end=20.0) == pytest.approx(0.5)


def test_goodput_counts_training_on_fewer_nodes_as_productive_and_redone_steps_against() -> None:
    # 3 nodes at 1 s a step, one taken out: 2 nodes at 2 s a step (fewer GPUs), no stall.
    three = [StepPoint(float(i), i, 3) for i in range(21)]
    two = [StepPoint(20.0 + 2 * i, 20 + i, 2) for i in range(1, 21)]
    assert goodput(three + two, end=60.0) == pytest.approx(1.0)
    # The same, but restored 10 steps back on the way (10 steps of 2 s done twice, 20 s of 80).
    redo = [StepPoint(60.0 + 2 * i, 30 + i, 2) for i in range(1, 11)]
    assert goodput(three + two + redo, end=80.0) == pytest.approx(0.75)
    assert paced_goodput(three + two + redo, end=80.0) == pytest.approx(0.75)


def test_slow_steps_are_productive_but_not_at_the_typical_pace() -> None:
    # 20 steps of 1 s, then 10 steps of 2 s (a busy machine): every step counts, the pace does not.
    pts = [StepPoint(float(i), i, 2) for i in range(21)] + [StepPoint(20.0 + 2 * i, 20 + i, 2) for i in range(1, 11)]
    assert goodput(pts, end=40.0) == pytest.approx(1.0)
    assert paced_goodput(pts, end=40.0) == pytest.approx(30 / 40)
    # A 30 s gap is a stall, not a slow step: only 3 typical steps of it count.
    stalled = [StepPoint(float(i), i, 2) for i in range(21)] + [StepPoint(50.0 + i, 20 + i, 2) for i in range(1, 11)]
    assert goodput(stalled, end=60.0) == pytest.approx((20 + 3 + 9) / 60)


def test_summary_times_detection_and_recovery_from_the_fault() -> None:
    faults = [FaultRecord(node="node-2", kind="xid", code=79, at=100.0)]
    incidents = [IncidentFacts(id="inc-1", node="node-2", kind="xid", playbook="xid-hardware", detected_at=101.5,
                               actions=["capture_scene", "isolate_node"], acted_until=104.0)]
    pts = points((99, 5), (100, 6), (103, 7), (110, 5), (111, 6), (112, 7), (113, 8))
    summary = summarize(faults, incidents, pts, started=90.0, end=120.0)
    row = summary.incidents[0]
    assert (row.detected_s, row.recovered_s, row.fault) == (1.5, 13.0, "xid 79")
    assert summary.faults_detected == 1 and summary.steps == 8 and summary.steps_lost == 3


def test_an_incident_on_another_node_is_not_the_answer_to_a_fault() -> None:
    faults = [FaultRecord(node="node-2", kind="thermal", at=100.0)]
    incidents = [IncidentFacts(id="inc-1", node="node-3", kind="xid", playbook="p", detected_at=101.0, actions=[],
                               acted_until=None)]
    summary = summarize(faults, incidents, [], started=90.0, end=120.0)
    assert summary.incidents[0].detected_s is None and summary.faults_detected == 0


def test_training_watch_reads_whole_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    watch = TrainingWatch(path, clock=lambda: 5.0)
    assert watch.poll() == []  # no file yet
    path.write_text('{"step": 1, "loss": 3.2}\n{"step": 2, "lo')
    assert [p.step for p in watch.poll()] == [1]
    with path.open("a") as fh:
        fh.write('ss": 3.1}\nnot json\n')
    assert [p.step for p in watch.poll()] == [2]


def test_training_watch_follows_the_trainer_rewriting_its_metrics(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    watch = TrainingWatch(path, clock=lambda: 0.0)
    path.write_text("".join(f'{{"step": {s}, "time": {s}.0}}\n' for s in range(1, 13)))
    watch.poll()
    # A restore from step 10 keeps lines up to 10 in a new file, then training goes on.
    tmp = tmp_path / "metrics.tmp"
    tmp.write_text("".join(f'{{"step": {s}, "time": {s}.0}}\n' for s in range(1, 11)) + '{"step": 11, "time": 20.0}\n')
    tmp.replace(path)
    assert [(p.step, p.at) for p in watch.poll()] == [(11, 20.0)]
    assert steps_lost(watch.points) == 2 and watch.last_step == 11


async def test_chaos_only_picks_nodes_still_in_service() -> None:
    injected: list[tuple[str, str, int]] = []

    async def inject(node: str, spec: FaultSpec, gpu: int) -> object:
        injected.append((node, spec.label, gpu))
        return None

    rounds = 0

    async def no_sleep(_: float) -> None:
        nonlocal rounds
        rounds += 1
        if rounds > 20:
            raise StopAsyncIteration

    chaos = Chaos(inject, lambda: ["node-3"], every=60, gpus=2, rng=random.Random(1), sleep=no_sleep)  # type: ignore[arg-type]
    with pytest.raises(StopAsyncIteration):
        await chaos.run()
    assert len(injected) == 20 and {n for n, _, _ in injected} == {"node-3"}
    assert {g for _, _, g in injected} <= {0, 1}


def _gridwatch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "gridwatch", *args], capture_output=True, text=True, timeout=60)


def test_fault_without_a_demo_says_so_in_one_line(tmp_path: Path) -> None:
    res = _gridwatch("fault", "node-2", "xid", "--code", "79", "--dir", str(tmp_path))
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "no demo state" in res.stderr and "Traceback" not in res.stderr


def test_fault_xid_needs_a_code() -> None:
    res = _gridwatch("fault", "node-2", "xid")
    assert res.returncode == 2 and "--code" in res.stderr


async def test_demo_without_trainer_takes_faults_by_node_name_and_leaves_no_process(tmp_path: Path) -> None:
    import asyncio

    from gridwatch.console.demo.cluster import ClusterOptions
    from gridwatch.console.demo.session import DemoOptions, DemoSession

    lines: list[str] = []
    session = DemoSession(DemoOptions(cluster=ClusterOptions(nodes=2, gpus=1, interval=0.5, trainer=False),
                                      directory=str(tmp_path / "demo")), say=lines.append)
    pids: list[int] = []
    try:
        await session.start()
        pids = [c.pid for c in session.cluster.children()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        await session.attach()
        await session.wait_connected(timeout=30)
        # The CLI finds node-2 through the demo's state file and goes through the operator action.
        res = await asyncio.to_thread(_gridwatch, "fault", "node-2", "xid", "--code", "13", "--dir", str(tmp_path / "demo"))
        assert res.returncode == 0, res.stderr
        assert "XID 13" in res.stdout
        await wait_until(lambda: any(f.node == "node-2" and f.code == 13 for f in session.faults), 15, "the fault event")
        await wait_until(lambda: session.store.incidents(), 15, "an incident")
        incident = session.store.incidents()[0]
        assert (incident.node, incident.playbook) == ("node-2", "xid-application")
        unknown = await asyncio.to_thread(_gridwatch, "fault", "node-9", "thermal", "--dir", str(tmp_path / "demo"))
        assert unknown.returncode == 2 and "node-1, node-2" in unknown.stderr
        summary = session.summary()
        assert summary.faults == 1 and summary.incidents[0].detected_s is not None
    finally:
        await session.close()
    gone = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert gone == []
    assert not (tmp_path / "demo" / "demo.json").exists()


@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_demo_killed_outright_takes_every_process_it_started_with_it(tmp_path: Path) -> None:
    from gridwatch.console.demo.cluster import trainer_unavailable

    demo_dir = tmp_path / "demo"
    argv = [PY, "-m", "gridwatch", "demo", "--headless", "--duration", "600", "--nodes", "2", "--gpus", "1",
            "--interval", "0.5", "--dir", str(demo_dir)]
    with_trainer = trainer_unavailable() is None
    if with_trainer:
        argv += ["--train-arg=--dim=32", "--train-arg=--heads=2", "--train-arg=--layers=1",
                 "--train-arg=--micro-batches=1"]
    else:
        argv.append("--no-trainer")
    demo = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        def tree() -> list[psutil.Process]:
            try:
                return psutil.Process(demo.pid).children(recursive=True)
            except psutil.Error:
                return []

        def workers_up() -> bool:
            # Every node's worker serves its control socket once it trains.
            names = " ".join(_cmdline(p) for p in tree())
            return names.count("gridwatch.trainer.worker") >= 4 and len(list((demo_dir / "run" / "control").glob("*.sock"))) == 2

        if with_trainer:
            wait_until_sync(workers_up, 90, "two torchrun agents and their workers")
        else:
            wait_until_sync(lambda: len(tree()) >= 2, 60, "the two agents")
        started = tree()
        demo.kill()
        demo.wait(10)

        def survivors() -> list[str]:
            alive = []
            for proc in started:
                try:
                    if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                        alive.append(_cmdline(proc)[:120])
                except psutil.Error:
                    pass
            return alive

        wait_until_sync(lambda: not survivors(), 45, "every process the demo started to exit")
    finally:
        if demo.poll() is None:
            demo.kill()
        for proc in psutil.process_iter():
            if str(demo_dir) in _cmdline(proc):
                try:
                    proc.kill()
                except psutil.Error:
                    pass


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


class _Fleet:
    """Answers actions from a script, like an agent whose trainer is re-forming."""

    def __init__(self, answers: list[tuple[bool, str, str | None]]) -> None:
        self.answers = answers
        self.sent: list[str] = []

    async def action(self, node: str, action: str, args: dict | None = None, reason: str = "",
                     timeout: float = 30.0) -> object:
        from gridwatch.wire.protocol import ActionResult

        self.sent.append(action)
        ok, message, code = self.answers.pop(0) if self.answers else (True, "done", None)
        return ActionResult(id="a", action=action, ok=ok, message=message, code=code)


async def test_a_restart_waits_for_a_trainer_between_two_lives_and_other_failures_stand() -> None:
    from gridwatch.console.runtime.core import ConsoleRuntime

    # The agent says why in a code; the message is for people and may say anything.
    absent = (False, "trainer control socket /x.sock: no trainer is listening at /x.sock", "trainer_absent")
    fleet = _Fleet([absent, absent, (True, "restart_from accepted", None)])
    runtime = ConsoleRuntime(fleet=fleet, retry_every=0.0)
    result = await runtime.act("node-1", "restart_from", {"checkpoint": "newest"}, "test")
    assert result.ok and fleet.sent == ["restart_from"] * 3

    refused = _Fleet([(False, "restart_from: no valid checkpoint", None)])
    assert not (await ConsoleRuntime(fleet=refused, retry_every=0.0).act("node-1", "restart_from", {}, "test")).ok
    assert refused.sent == ["restart_from"]

    gone = _Fleet([absent] * 1000)
    assert not (await ConsoleRuntime(fleet=gone, retry_every=0.0, trainer_wait=0.0)
                .act("node-1", "restart_from", {}, "t")).ok


async def test_a_watch_only_runtime_sends_no_step_that_acts() -> None:
    from gridwatch.console.runtime.core import ConsoleRuntime

    fleet = _Fleet([])
    runtime = ConsoleRuntime(fleet=fleet, acting=False)
    assert not (await runtime.act("node-2", "isolate", {}, "xid 79")).ok
    assert (await runtime.act("node-2", "capture_scene", {}, "xid 79")).ok
    assert fleet.sent == ["capture_scene"]


async def test_chaos_repair_puts_the_node_back_and_its_next_fault_is_a_new_incident(tmp_path: Path) -> None:
    from gridwatch.console.demo.cluster import ClusterOptions
    from gridwatch.console.demo.session import DemoOptions, DemoSession

    # chaos_every long enough never to fire by itself: only the repairs of the faults below run.
    session = DemoSession(DemoOptions(cluster=ClusterOptions(nodes=2, gpus=1, interval=0.5, trainer=False),
                                      directory=str(tmp_path / "demo"), chaos_every=3600, repair_after=1.5,
                                      tick_interval=0.25))
    try:
        await session.start()
        await session.attach()
        await session.wait_connected(timeout=30)
        assert (await session.inject("node-2", FaultSpec("xid", 79))).ok
        await wait_until(lambda: any(i.playbook == "xid-hardware" for i in session.store.incidents()), 15, "an incident")
        first = next(i for i in session.store.incidents() if i.playbook == "xid-hardware")
        await wait_until(lambda: session.store.incident(first.id).state == "resolved", 30, "the repair to close it")
        await wait_until(lambda: not any(n.out for n in session.engine.nodes.values()), 15, "node-2 back in service")
        # Incident ids carry the second they opened in: the next one must not share it.
        await wait_until(lambda: int(session.clock()) > int(first.detected_at), 2, "the next second")
        assert (await session.inject("node-2", FaultSpec("xid", 48))).ok
        await wait_until(lambda: len([i for i in session.store.incidents() if i.playbook == "xid-hardware"]) == 2,
                         15, "a second incident for the second fault")
    finally:
        await session.close()
