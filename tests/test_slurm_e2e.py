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
import datetime
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
from tests.conftest import PYTHON, ROOT, free_ports, spawn_agent, wait_until
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
async def _deploy(slurm: SlurmCluster, keys, tmp_path: Path, trainer: bool,  # noqa: ANN001
                  agent_args: Callable[[str], list[str]] | None = None) -> AsyncIterator[Deployment]:
    slurm.reset()
    ports = dict(zip(NODES, free_ports(len(NODES))))  # distinct: chosen together
    run_dir = tmp_path / "run"
    # Each agent reads its node's trainer through the control socket the trainer serves for that node. A sample a
    # second (a heartbeat is lost after three missed): on a shared two-core box four busy ranks can hold an agent
    # back for a second, and a lost heartbeat would be a second, unplanned incident.
    agents = [spawn_agent(keys, port, name, "--interval", "1", "--trainer-socket",
                          str(run_dir / "control" / f"{name}.sock"), *(agent_args(name) if agent_args else []),
                          log=tmp_path / f"{name}.log")
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


# A plain torch DDP job (gloo, torch.save, resume from the newest, Megatron's progress lines): nothing of gridwatch.
JOB = ROOT / "tests" / "jobs" / "ddp_job.py"


@pytest.fixture
async def plain_job(slurm_cluster: SlurmCluster, keys, tmp_path: Path) -> AsyncIterator[tuple[Deployment, Path]]:  # noqa: ANN001
    """The deployment, each agent tailing its node's log of a job gridwatch did not write and reading its jobs
    every second (from the processes' Slurm environment: these slurmds share one host and use no cgroups)."""
    work = tmp_path / "job"
    (work / "logs").mkdir(parents=True)

    def args(name: str) -> list[str]:
        config = tmp_path / f"{name}.toml"
        config.write_text("[agent]\njobs_every = 1\n")
        return ["--config", str(config), "--log", str(work / "logs" / f"{name}.log"), "--scene-dir",
                str(tmp_path / "scenes" / name)]

    try:
        async with _deploy(slurm_cluster, keys, tmp_path, trainer=False, agent_args=args) as d:
            yield d, work
    finally:
        slurm_cluster.cancel_jobs()  # its tasks end with it: none is left running after the test


def _expand(slurm: SlurmCluster, nodelist: str) -> list[str]:
    """Slurm's NodeList (node-[1,3-4]) as names, read by Slurm's own scontrol, not the product's hostlist."""
    return slurm.scontrol("show", "hostnames", nodelist).split()


def _iteration(log: Path) -> int:
    """The newest iteration a node's log printed, read without the product's parser."""
    import re

    found = re.findall(r"iteration +(\d+)/", log.read_text(errors="replace")) if log.exists() else []
    return int(found[-1]) if found else -1


async def test_a_slurm_job_gridwatch_did_not_write_is_requeued_off_a_bad_node_and_recovers_from_its_checkpoint(
        plain_job: tuple[Deployment, Path]) -> None:
    d, work = plain_job
    script = work / "job.sh"
    script.write_text(f"#!/bin/sh\nexec srun --kill-on-bad-exit=1 {PYTHON} {JOB} {work} 0.2 10\n")
    script.chmod(0o755)
    done = subprocess.run(["sbatch", "--parsable", "--requeue", "-N", "3", "-J", "pretrain",
                           "-o", str(work / "slurm-%j.out"), str(script)], env=d.slurm.env(), capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip().split(";")[0]
    logs = work / "logs"
    await _wait(d, lambda: d.slurm.job(job_id).get("JobState") == "RUNNING", timeout=30, what="the job started")
    ran_on = [n for n in NODES if n in _expand(d.slurm, d.slurm.job(job_id)["NodeList"])]
    bad, spare = ran_on[1], next(n for n in NODES if n not in ran_on)
    await _wait(d, lambda: min(_iteration(logs / f"{n}.log") for n in ran_on) > 15,
                timeout=60, what=f"the job iterating on {', '.join(ran_on)}")
    # The agents name the job and read its progress from its log, so the console knows its step.
    await _wait(d, lambda: any(line.startswith("training: ") and "at step" in line for line in d.lines), timeout=30,
                what="the console to hear the job's progress")

    assert "XID 79" in d.fault(bad)
    await _wait(d, lambda: d.incident("xid-hardware", bad), timeout=30, what="the xid-hardware incident")
    incident = d.incident("xid-hardware", bad)
    assert incident is not None
    await _wait(d, lambda: d.steps(incident) and all(s not in ("planned", "running", "pending")
                                                     for _, s, _ in d.steps(incident)),
                timeout=90, what="the plan to finish")
    for name in ("capture_scene", "isolate_node", "drain_node", "requeue_job", "notify"):
        assert d.step(incident, name)[0] == "done", (name, _explain(d, incident))
    assert d.step(incident, "restart_from_checkpoint")[0] == "skipped"  # the requeue restarted it
    assert f"slurm job {job_id}" in d.query("SELECT summary FROM incidents WHERE id=?", incident)[0][0]
    # The scene, kept before anything touched the node, holds the job's own processes' stacks and output.
    scene = next((Path(o.split("scene kept in ", 1)[1].split(";")[0].strip()) for n, _, o in d.steps(incident)
                  if n == "capture_scene" and "scene kept in " in o), None)
    assert scene is not None and (scene / f"job-slurm-{job_id}-stacks.txt").exists(), d.step(incident, "capture_scene")
    assert "iteration" in (scene / "job-output.txt").read_text()

    # Slurm requeued it once, off the bad node (drained), and it runs again from its checkpoint on three nodes.
    assert d.slurm.drained(bad)
    try:
        await wait_until(lambda: d.slurm.job(job_id).get("JobState") == "RUNNING"
                         and d.slurm.job(job_id).get("Restarts") == "1", timeout=60,
                         what="the job running again, requeued once")
    except AssertionError as exc:
        log = (d.slurm.directory / "log" / "slurmctld.log").read_text(errors="replace").splitlines()
        raise AssertionError("\n".join([str(exc), d.slurm.scontrol("show", "job", "-o", job_id), *log[-40:],
                                        _explain(d, incident)])) from None
    nodes = _expand(d.slurm, d.slurm.job(job_id)["NodeList"])
    assert bad not in nodes and spare in nodes, nodes
    ((fault_step,),) = d.query("SELECT fault_step FROM incidents WHERE id=?", incident)
    assert fault_step is not None and fault_step > 15
    await _wait(d, lambda: _iteration(logs / f"{spare}.log") > fault_step, timeout=60,
                what=f"the requeued job past the fault's step on {spare}")
    assert "restart 1: rank" in (logs / f"{spare}.log").read_text()
    # Recovered when the job's own log passed the fault's step; the times and the cost are in the database.
    await _wait(d, lambda: d.query("SELECT recovered_at FROM incidents WHERE id=?", incident)[0][0] is not None,
                timeout=60, what="the incident marked recovered")
    ((detect_s, recover_s),) = d.query("SELECT detect_s, recover_s FROM incident_times WHERE id=?", incident)
    assert 0 <= detect_s < 10 and 0 < recover_s < 60, (detect_s, recover_s)
    # Not before the job ran again: its old ranks print on as they die, and those steps are not a recovery.
    ((recovered_at,),) = d.query("SELECT recovered_at FROM incidents WHERE id=?", incident)
    started = datetime.datetime.fromisoformat(d.slurm.job(job_id)["StartTime"]).timestamp()
    assert recovered_at >= started, (recovered_at, started)
    await _wait(d, lambda: d.query("SELECT steps_lost FROM incidents WHERE id=?", incident)[0][0] is not None,
                timeout=30, what="the incident's cost recorded")
