"""reset_gpu: the agent action over real SSH (sim), its refusals, the playbook step, and the repeat rule."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import asyncssh

from gridwatch.agent.actions import reset_argv, reset_gpu
from gridwatch.agent.agent import Agent
from gridwatch.agent.config import AgentConfig
from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.executor import Executor
from gridwatch.playbooks.loader import load_builtin
from gridwatch.playbooks.store import IncidentStore
from gridwatch.sshlink.server import Caller
from gridwatch.wire import protocol as p
from tests.conftest import wait_until


async def _session(keys: Any, port: int, key: Path) -> tuple[asyncssh.SSHClientConnection, Any]:
    conn = await asyncssh.connect("127.0.0.1", port, username="alice", client_keys=[str(key)],
                                  known_hosts=str(keys.known_hosts))
    proc = await conn.create_process(subsystem="gridwatch", encoding=None)
    assert isinstance(p.decode_agent_frame(await asyncio.wait_for(proc.stdout.readline(), 10)), p.Hello)
    return conn, proc


async def _ask(proc: Any, action: str, **args: Any) -> p.ActionResult:
    proc.stdin.write(p.encode(p.Action(id=p.Text(action), action=p.Text(action), args=args,
                                       reason=p.Text("xid-reset-gpu: XID 119 on gpu 1"))))
    while True:
        frame = p.decode_agent_frame(await asyncio.wait_for(proc.stdout.readline(), 10))
        if isinstance(frame, p.ActionResult):
            return frame


async def test_reset_gpu_over_ssh_clears_the_simulated_fault_and_is_audited(keys, agent) -> None:
    conn, proc = await _session(keys, agent.port, keys.operator_key)
    try:
        assert (await _ask(proc, "inject_fault", kind="ecc-dbe", gpu=1)).ok
        await wait_until(lambda: (agent.agent.gpus._gpus[1].ecc_dbe == 1), what="the fault")
        result = await _ask(proc, "reset_gpu", gpu=1)
        assert result.ok and "GPU 1 reset" in result.message, result.message
        assert result.data["argv"] == ["nvidia-smi", "--gpu-reset", "-i", "1"]
        reading = agent.agent.gpus.sample()[1]
        assert reading.ecc_dbe == 0 and not reading.remapped_rows_pending and reading.state == "ok"
        proc.stdin.write(p.encode(p.Subscribe(resume_from=0)))
        while True:  # the agent's own record: who reset which GPU, and why
            frame = p.decode_agent_frame(await asyncio.wait_for(proc.stdout.readline(), 10))
            if isinstance(frame, p.Event) and frame.kind == "action" and frame.details.get("action") == "reset_gpu":
                break
        assert frame.details["by"] == "alice" and "XID 119" in frame.details["reason"]
        assert (await _ask(proc, "reset_gpu", gpu=7)).message == "reset_gpu needs the GPU to reset: gpu 0 to 1"
    finally:
        conn.close()


async def test_reset_gpu_is_refused_for_a_viewer(keys, agent) -> None:
    conn, proc = await _session(keys, agent.port, keys.viewer_key)
    try:
        agent.agent.gpus.inject("ecc-dbe", gpu=0)
        result = await _ask(proc, "reset_gpu", gpu=0)
        assert not result.ok and "needs the operator role" in result.message
        assert agent.agent.gpus._gpus[0].ecc_dbe == 1  # nothing was reset
    finally:
        conn.close()


class _HeldGpu:
    """An NVML-like source whose GPU 0 is held by two compute processes."""

    name = "nvml"
    blocking = False

    def info(self) -> list[p.GpuInfo]:
        return [p.GpuInfo(index=0, uuid=p.Text("GPU-0"), name=p.Text("NVIDIA H100 80GB HBM3"))]

    def sample(self) -> list[p.GpuSample]:
        return [p.GpuSample(index=0, procs=2)]

    def poll_events(self) -> list[p.Event]:
        return []

    def close(self) -> None:
        return None


async def test_a_real_gpu_held_by_compute_processes_is_not_reset(tmp_path: Path) -> None:
    config = AgentConfig(node_name="n1", state_file=str(tmp_path / "state.json"))
    node = Agent(config, gpus=_HeldGpu())  # type: ignore[arg-type]
    result = await reset_gpu(node, Caller("alice", "operator", "SHA256:x"),
                             p.Action(id=p.Text("r"), action=p.Text("reset_gpu"), args={"gpu": 0}))
    assert not result.ok and result.message.startswith("GPU 0 not reset: 2 compute processes still hold it")
    assert reset_argv(0) == ["nvidia-smi", "--gpu-reset", "-i", "0"]


class _Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    async def act(self, node: str, action: str, args: dict[str, Any], reason: str) -> p.ActionResult:
        self.calls.append((node, action, args))
        return p.ActionResult(id=p.Text("x"), action=p.Text(action), ok=action != "reset_gpu" or self.reset_ok)

    reset_ok = True


class _Notifier:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bool]] = []

    async def notify(self, step: Any, incident: Any, text: str, escalation: bool) -> str:
        self.sent.append((text, escalation))
        return "sent"


def _cluster(engine: Engine) -> None:
    for name in ("node1", "node2", "node3", "node4"):
        engine.observe(name, p.Hello(node=p.Text(name), interval=600.0))
        engine.observe(name, p.Sample(node=p.Text(name), trainer=p.TrainerStatus(job=p.Text("llm"), step=50,
                                                                                 checkpoints={p.Text("1"): 40})))


def _xid(engine: Engine, code: int = 119) -> list[Any]:
    return engine.observe("node2", p.Event(node=p.Text("node2"), kind=p.Text("xid"), code=code, gpu=3,
                                           severity=p.Text("critical")))


async def test_the_reset_gpu_step_resets_the_incidents_gpu_and_is_audited(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    engine = Engine(load_builtin(), clock)
    _cluster(engine)
    (plan,) = _xid(engine)
    assert plan.incident.playbook == "xid-reset-gpu" and plan.incident.gpu == 3
    store, sink = IncidentStore(tmp_path / "incidents.db", clock), _Sink()
    records = await Executor(store, sink, clock=clock, notifier=_Notifier()).run(plan)
    assert [(r.step, r.state) for r in records] == [("capture_scene", "done"), ("reset_gpu", "done"),
                                                    ("restart_from_checkpoint", "done"), ("notify", "done")]
    assert ("node2", "reset_gpu", {"incident": plan.incident.id, "gpu": 3}) in sink.calls
    audit = [(a.what, a.phase) for a in store.audit_log(plan.incident.id) if a.what.startswith("reset_gpu")]
    assert audit == [("reset_gpu on node2", "before"), ("reset_gpu on node2", "after")]


async def test_a_failed_reset_stops_the_plan_and_pages_a_human(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    engine = Engine(load_builtin(), clock)
    _cluster(engine)
    (plan,) = _xid(engine, 120)
    sink, notifier = _Sink(), _Notifier()
    sink.reset_ok = False
    records = await Executor(IncidentStore(tmp_path / "i.db", clock), sink, clock=clock, notifier=notifier).run(plan)
    assert [(r.step, r.state) for r in records][1:] == [("reset_gpu", "failed"), ("restart_from_checkpoint", "skipped"),
                                                       ("notify", "skipped")]
    assert notifier.sent and notifier.sent[0][1] and "reset_gpu" in notifier.sent[0][0]


def test_the_same_xid_after_two_resets_escalates_to_hardware_inspection() -> None:
    clock = ManualClock(1000.0)
    engine = Engine(load_builtin(), clock)
    _cluster(engine)
    plans = []
    for _ in range(3):
        (plan,) = _xid(engine)
        plans.append([(s.step, s.decision) for s in plan.steps])
        clock.advance(3600.0)  # an hour later, past the dedup window: the XID is back
        _cluster(engine)
        engine.tick()
    reset = [("capture_scene", "act"), ("reset_gpu", "act"), ("restart_from_checkpoint", "act"), ("notify", "act")]
    assert plans[:2] == [reset, reset]
    assert plans[2] == [("capture_scene", "act"), ("isolate_node", "act"), ("drain_node", "act"),
                        ("requeue_job", "skip"), ("restart_from_checkpoint", "act"), ("notify", "act")]
    (inspected,) = [i for i in engine.incidents(include_closed=True) if "hardware inspection" in i.summary]
    assert "came back after 2 reset_gpu within 1d" in inspected.summary
    # Another XID code on the same GPU, or the same code on another GPU, is not a repeat.
    (other,) = engine.observe("node3", p.Event(node=p.Text("node3"), kind=p.Text("xid"), code=119, gpu=3))
    assert [s.step for s in other.steps][1] == "reset_gpu"


def test_resets_older_than_the_window_do_not_count() -> None:
    clock = ManualClock(1000.0)
    engine = Engine(load_builtin(), clock)
    _cluster(engine)
    for _ in range(2):
        _xid(engine)
        clock.advance(13 * 3600.0)  # two resets, but 13 h apart: only one within any 24 h
        _cluster(engine)
        engine.tick()
    (plan,) = _xid(engine)
    assert "reset_gpu" in [s.step for s in plan.steps]
