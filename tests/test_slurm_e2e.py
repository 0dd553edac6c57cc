"""End to end through the product's own path: real agents named like real Slurm nodes, a real trainer across them,
`gridwatch console --headless --cluster cluster.toml` with `scheduler = "slurm"`, an XID 79 injected with
`gridwatch fault`, and the node put back with `gridwatch node return`.

Slurm is Debian's slurmctld with four `slurmd -N node-N` and munge, started by
scripts/slurm-cluster.sh; the agents simulate their GPUs; the trainer is
`gridwatch train` (tiny model, one CPU rank per node, gloo). What is checked is
what an operator would look at: `scontrol show node`, the incident's steps,
times and audit in the console's database (read with sqlite3), and the
trainer's own metrics file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gridwatch.console.demo.cluster import trainer_unavailable
from tests.conftest import PYTHON, ROOT, free_port, spawn_agent, wait_until
from tests.slurm_cluster import NODES, SlurmCluster, missing

pytestmark = pytest.mark.skipif(missing() is not None, reason=f"no Slurm here: {missing()}")

OPERATOR = "oncall-e2e"



TINY_TRAINER = ["--dim=32", "--heads=2", "--layers=1", "--seq-len=32", "--micro-batch=4", "--micro-batches=1",
                "--tiers=5,10,30"]


@dataclass
class Trainer:
    """``gridwatch train`` across the four nodes, as the job those nodes run: its run folder and what it printed."""

    proc: asyncio.subprocess.Process
    run_dir: Path
    lines: list[str] = field(default_factory=list)

    def points(self) -> list[tuple[int, int | None]]:
        """(step, world size) of every step rank 0 recorded, oldest first (the trainer's own metrics file)."""
        out = []
        with contextlib.suppress(OSError):
            for line in (self.run_dir / "metrics.jsonl").read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    record = json.loads(line)
                    out.append((int(record["step"]), record.get("world_size")))
        return out

    def step(self) -> int:
        return max((s for s, _ in self.points()), default=-1)

    def trained(self, world: int, past: int) -> bool:
        """Rank 0 has recorded a step beyond ``past`` that ``world`` nodes trained together."""
        return any(s > past and w == world for s, w in self.points())

    def tail(self) -> str:
        out = [f"trainer: {' | '.join(self.lines[-6:])}"]
        for log in sorted((self.run_dir / "logs").glob("node-*.log")):
            text = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip() and not ln.startswith(" ")]
            out.append(f"{log.stem}: " + " | ".join(t[:160] for t in text[-3:]))
        return "\n".join(out)


@dataclass
class Deployment:
    """Four agents, a console over them, and where to look."""

    slurm: SlurmCluster
    ports: dict[str, int]
    db: Path
    cluster: Path
    keys: object
    trainer: Trainer | None = None
    lines: list[str] = field(default_factory=list)

    def gridwatch(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The command line an operator runs on the head node."""
        return subprocess.run([PYTHON, "-m", "gridwatch", *args], cwd=ROOT, env=self.slurm.env(), capture_output=True,
                              text=True, timeout=120)

    def fault(self, node: str, code: int = 79) -> str:
        done = self.gridwatch("fault", f"127.0.0.1:{self.ports[node]}", "xid", "--code", str(code),
                              "--key", str(self.keys.operator_key),  # type: ignore[attr-defined]
                              "--known-hosts", str(self.keys.known_hosts))  # type: ignore[attr-defined]
        assert done.returncode == 0, done.stderr
        return done.stdout

    def query(self, sql: str, *args: object) -> list[tuple]:
        if not self.db.exists():
            return []
        with contextlib.closing(sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5)) as db:
            try:
                return db.execute(sql, args).fetchall()
            except sqlite3.OperationalError:
                return []  # the console has not made its tables yet

    def incident(self, playbook: str, node: str) -> str | None:
        rows = self.query("SELECT id FROM incidents WHERE playbook=? AND node=?", playbook, node)
        return rows[0][0] if rows else None

    def steps(self, incident: str) -> list[tuple[str, str, str]]:
        return [tuple(r) for r in self.query("SELECT step, state, outcome FROM steps WHERE incident=? ORDER BY idx",
                                             incident)]

    def step(self, incident: str, name: str) -> tuple[str, str]:
        return next(((s, o) for n, s, o in self.steps(incident) if n == name), ("", ""))

    def audit(self, incident: str | None = None) -> list[tuple[str, str, str, str, str]]:
        where, args = ("WHERE incident=?", (incident,)) if incident else ("", ())
        return [tuple(r) for r in self.query(f"SELECT who, what, why, phase, outcome FROM audit {where} ORDER BY id",
                                             *args)]


@contextlib.asynccontextmanager
async def _deploy(slurm: SlurmCluster, keys, tmp_path: Path, trainer: bool) -> AsyncIterator[Deployment]:  # noqa: ANN001
    slurm.reset()
    ports = {name: free_port() for name in NODES}
    run_dir = tmp_path / "run"
    # Each agent reads its node's trainer through the control socket the trainer serves for that node. A sample a
    # second (a heartbeat is lost after three missed): on a shared two-core box four busy ranks can hold an agent
    # back for a second, and a lost heartbeat would be a second, unplanned incident.
    agents = [spawn_agent(keys, port, name, "--interval", "1", "--trainer-socket",
                          str(run_dir / "control" / f"{name}.sock"), log=tmp_path / f"{name}.log")
              for name, port in ports.items()]
    db = tmp_path / "incidents.db"
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        f'nodes = [{", ".join(f"{chr(34)}127.0.0.1:{p}{chr(34)}" for p in ports.values())}]\n'
        f'key = "{keys.operator_key}"\nknown_hosts = "{keys.known_hosts}"\n'
        f'db = "{db}"\nscheduler = "slurm"\noperator = "{OPERATOR}"\n')
    console = await asyncio.create_subprocess_exec(
        PYTHON, "-m", "gridwatch", "console", "--headless", "--cluster", str(cluster),
        "--duration", "600", cwd=ROOT, env=slurm.env(), stdin=subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    deployment = Deployment(slurm, ports, db, cluster, keys)
    tasks: list[asyncio.Task[None]] = []

    async def read(stream: asyncio.StreamReader | None, into: list[str]) -> None:
        assert stream is not None
        async for raw in stream:
            into.append(raw.decode(errors="replace").rstrip())

    tasks.append(asyncio.create_task(read(console.stdout, deployment.lines)))
    job: asyncio.subprocess.Process | None = None
    try:
        if trainer:
            env = {k: v for k, v in os.environ.items() if k != "GRIDWATCH_TRAINER_SOCKET"}
            job = await asyncio.create_subprocess_exec(
                PYTHON, "-m", "gridwatch", "train", "--nodes", str(len(NODES)), "--node-names", ",".join(NODES),
                "--steps", "100000", "--run-dir", str(run_dir), *TINY_TRAINER, cwd=ROOT, env=env,
                stdin=subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True, preexec_fn=lambda: os.nice(10))  # the ranks yield to agents and console
            deployment.trainer = Trainer(job, run_dir)
            tasks.append(asyncio.create_task(read(job.stdout, deployment.trainer.lines)))
        await wait_until(lambda: all(f"node {n} ok" in deployment.lines for n in NODES) or console.returncode,
                         timeout=60, what="the console connected to all four agents")
        assert console.returncode is None, "\n".join(deployment.lines)
        yield deployment
    finally:
        if job is not None and job.returncode is None:
            job.send_signal(signal.SIGINT)  # the trainer's own way to stop: its nodes keep their newest checkpoint
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(job.wait(), 30)
            if job.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(job.pid, signal.SIGKILL)
                await job.wait()
        if console.returncode is None:
            console.send_signal(signal.SIGTERM)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(console.wait(), 30)
        if console.returncode is None:
            console.kill()
            await console.wait()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        for agent in agents:
            agent.terminate()
        for agent in agents:
            try:
                agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()


@pytest.fixture
async def deployment(slurm_cluster: SlurmCluster, keys, tmp_path: Path) -> AsyncIterator[Deployment]:  # noqa: ANN001
    async with _deploy(slurm_cluster, keys, tmp_path, trainer=False) as d:
        yield d


@pytest.fixture
async def trained(slurm_cluster: SlurmCluster, keys, tmp_path: Path) -> AsyncIterator[Deployment]:  # noqa: ANN001
    """The deployment with a real trainer across its four nodes."""
    if trainer_unavailable() is not None:
        pytest.skip(f"no trainer here: {trainer_unavailable()}")
    async with _deploy(slurm_cluster, keys, tmp_path, trainer=True) as d:
        yield d


def _explain(d: Deployment, incident: str | None = None) -> str:
    steps = [str(s) for s in d.steps(incident)] if incident else []
    return "\n".join([*d.lines[-30:], *steps, *([d.trainer.tail()] if d.trainer else [])])


async def _wait(d: Deployment, cond: Callable[[], object], timeout: float, what: str) -> None:
    """``wait_until``, failing with what the console printed, the incident's steps and the trainer's last words."""
    try:
        await wait_until(cond, timeout=timeout, what=what)
    except AssertionError as exc:
        incidents = [r[0] for r in d.query("SELECT id FROM incidents ORDER BY detected_at")]
        raise AssertionError("\n".join([str(exc), *(_explain(d, i) for i in incidents[-1:]), *([] if incidents
                                         else [_explain(d)])])) from None


async def test_an_xid_79_takes_the_node_out_in_slurm_the_job_goes_on_and_a_return_from_the_cli_brings_it_back(
        trained: Deployment) -> None:
    d = trained
    job = d.trainer
    assert job is not None
    # The job trains on all four nodes, and the console hears each node's trainer through its agent.
    await _wait(d, lambda: job.trained(world=4, past=5) or job.proc.returncode is not None, timeout=120,
                what="the trainer to train on all four nodes")
    assert job.proc.returncode is None, job.tail()
    await _wait(d, lambda: any(line.startswith("training: 4 of 4 nodes report a trainer, at step") for line in d.lines),
                timeout=30, what="the console to see the trainer on every node")

    assert "XID 79" in d.fault("node-2")
    await _wait(d, lambda: d.incident("xid-hardware", "node-2"), timeout=30, what="the xid-hardware incident")
    incident = d.incident("xid-hardware", "node-2")
    assert incident is not None
    await _wait(d, lambda: d.steps(incident) and all(s not in ("planned", "running") for _, s, _ in d.steps(incident)),
                     timeout=90, what="the plan to finish")
    for name in ("capture_scene", "isolate_node", "drain_node", "restart_from_checkpoint", "notify"):
        assert d.step(incident, name)[0] == "done", (name, _explain(d, incident))

    # Slurm took node-2 out of the pool, saying which incident, which playbook and who.
    state, reason = d.slurm.node("node-2")
    assert "DRAIN" in state
    assert reason.startswith("xid 79 on node-2")
    assert reason.endswith(f"(gridwatch incident {incident}, playbook xid-hardware, operator {OPERATOR})")
    assert [d.slurm.drained(n) for n in NODES] == [False, True, False, False]

    # Every step that ran is in the audit before and after, the drain with the very argv sent.
    audit = d.audit(incident)
    for name, state, _ in d.steps(incident):
        if state == "skipped":  # planned not to run: gridwatch's trainer leaves node-2 in place, no requeue
            assert name == "requeue_job", (name, _explain(d, incident))
            continue
        phases = [phase for _, what, _, phase, _ in audit if what.startswith(f"{name} on ")]
        assert phases == ["before", "after"], (name, audit)
    sent = [(what, why, phase) for _, what, why, phase, _ in audit if what.startswith("scontrol update")]
    argv = f"scontrol update NodeName=node-2 State=DRAIN 'Reason={reason}'"
    assert sent == [(argv, reason, "before"), (argv, reason, "after")]
    assert any(what == "scontrol show node -o node-2" for _, what, _, _, _ in audit)

    # The job goes on without node-2: the three left train past the step it was at when the fault came,
    # and the console marks the incident recovered, with its time to recover, in its database.
    await _wait(d, lambda: d.query("SELECT recovered_at FROM incidents WHERE id=?", incident)[0][0] is not None,
                     timeout=90, what="the incident marked recovered")
    ((fault_step, detect_s, recover_s),) = d.query(
        "SELECT i.fault_step, t.detect_s, t.recover_s FROM incidents i JOIN incident_times t ON t.id = i.id "
        "WHERE i.id=?", incident)
    assert fault_step is not None and 0 <= detect_s < 30 and 0 < recover_s < 90, (fault_step, detect_s, recover_s)
    await _wait(d, lambda: any(line.startswith(f"incident {incident} recovered: the job trains past step "
                                                 f"{fault_step}") for line in d.lines), timeout=10,
                     what="the console to say so")
    await _wait(d, lambda: job.trained(world=3, past=fault_step), timeout=60,
                     what=f"steps past {fault_step} trained by the three nodes left")

    # Return to service from the head node's command line, as on-call does with the service running.
    done = d.gridwatch("node", "return", "node-2", "--reason", "GPU reseated, burn-in passed", "--cluster",
                       str(d.cluster), "--operator", "tech-1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("node-2: returned to service; scheduler: "), done.stdout
    state, _ = d.slurm.node("node-2")
    assert "DRAIN" not in state, state  # Slurm took it back: the drain was gridwatch's
    audit = d.audit()
    assert ("tech-1", "unisolate on node-2", "GPU reseated, burn-in passed", "before", "") in audit
    assert any(who == "tech-1" and what == "scontrol update NodeName=node-2 State=RESUME" and phase == "after"
               for who, what, _, phase, _ in audit), audit[-8:]
    assert any(who == "tech-1" and what == "return_to_service node-2" and phase == "after"
               for who, what, _, phase, _ in audit)

    # Its trainer starts again, as a repaired node's launcher does, and joins the running job.
    from gridwatch.trainer.launch import request_rejoin

    rejoined_after = job.step()
    request_rejoin(job.run_dir, "node-2")
    await _wait(d, lambda: job.trained(world=4, past=rejoined_after), timeout=90,
                     what="node-2's trainer back in the job")
    assert "node-2 rejoins the run" in job.lines


async def test_with_the_controller_stopped_the_drain_stays_pending_and_happens_when_it_comes_back(
        deployment: Deployment) -> None:
    d = deployment
    d.slurm.script("stop-controller")
    d.fault("node-3")
    await _wait(d, lambda: d.incident("xid-hardware", "node-3"), timeout=30, what="the xid-hardware incident")
    incident = d.incident("xid-hardware", "node-3")
    assert incident is not None
    await _wait(d, lambda: d.step(incident, "drain_node")[0] == "pending", timeout=60,
                     what="the drain to be pending")
    assert d.step(incident, "drain_node")[1].startswith("controller unreachable, retrying")
    assert d.step(incident, "isolate_node")[0] == "done"  # the node stays isolated meanwhile
    d.slurm.script("start-controller")
    await _wait(d, lambda: d.step(incident, "drain_node")[0] != "pending", timeout=90,
                     what="the retried drain once slurmctld answers")
    assert d.step(incident, "drain_node")[0] == "done", _explain(d, incident)
    assert incident in d.slurm.node("node-3")[1]


async def test_a_node_returned_from_the_cli_while_its_drain_is_pending_is_not_drained_later(
        deployment: Deployment) -> None:
    d = deployment
    d.slurm.script("stop-controller")
    d.fault("node-3")
    await _wait(d, lambda: d.incident("xid-hardware", "node-3"), timeout=30, what="the xid-hardware incident")
    incident = d.incident("xid-hardware", "node-3")
    assert incident is not None
    await _wait(d, lambda: d.step(incident, "drain_node")[0] == "pending", timeout=60, what="the drain to be pending")

    # The technician fixed it before the controller came back: the console stops trying to drain it.
    done = d.gridwatch("node", "return", "node-3", "--reason", "false alarm: PCIe riser reseated", "--cluster",
                       str(d.cluster), "--operator", "tech-2")
    assert done.returncode == 0, done.stderr
    assert f"stopped the pending drain of {incident}" in done.stdout, done.stdout
    assert d.step(incident, "drain_node") == ("skipped", "not drained: node-3 was returned to service by tech-2")
    assert any(what == "drain_node on node-3" and outcome.startswith("skipped: not drained")
               for _, what, _, _, outcome in d.audit(incident))

    d.slurm.script("start-controller")
    await _wait(d, lambda: "NOT_RESPONDING" not in d.slurm.node("node-3")[0], timeout=60,
                what="node-3's slurmd registered again")
    assert not d.slurm.drained("node-3"), d.slurm.node("node-3")
    assert d.step(incident, "drain_node")[0] == "skipped"
