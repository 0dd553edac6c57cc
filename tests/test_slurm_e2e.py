"""End to end through the product's own path: real agents named like real Slurm nodes, `gridwatch console
--headless --cluster cluster.toml` with `scheduler = "slurm"`, and an XID 79 injected with `gridwatch fault`.

Slurm is Debian's slurmctld with four `slurmd -N node-N` and munge, started by
scripts/slurm-cluster.sh; the agents simulate their GPUs. What is checked is
what an operator would look at: `scontrol show node`, and the incident's steps
and audit in the console's database.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import PYTHON, ROOT, free_port, spawn_agent, wait_until
from tests.slurm_cluster import NODES, SlurmCluster, missing, shared

pytestmark = pytest.mark.skipif(missing() is not None, reason=f"no Slurm here: {missing()}")

OPERATOR = "oncall-e2e"


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> SlurmCluster:
    try:
        return shared(tmp_path_factory.mktemp("slurm"))
    except RuntimeError as exc:
        pytest.skip(f"Slurm would not start here: {exc}")


@dataclass
class Deployment:
    """Four agents, a console over them, and where to look."""

    slurm: SlurmCluster
    ports: dict[str, int]
    db: Path
    keys: object
    lines: list[str] = field(default_factory=list)

    def fault(self, node: str, code: int = 79) -> str:
        done = subprocess.run([PYTHON, "-m", "console", "fault", f"127.0.0.1:{self.ports[node]}", "xid",
                               "--code", str(code), "--key", str(self.keys.operator_key),  # type: ignore[attr-defined]
                               "--known-hosts", str(self.keys.known_hosts)],  # type: ignore[attr-defined]
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
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

    def audit(self, incident: str) -> list[tuple[str, str, str, str, str]]:
        return [tuple(r) for r in self.query("SELECT who, what, why, phase, outcome FROM audit WHERE incident=? "
                                             "ORDER BY id", incident)]


@pytest.fixture
async def deployment(slurm_cluster: SlurmCluster, keys, tmp_path: Path) -> AsyncIterator[Deployment]:  # noqa: ANN001
    slurm_cluster.reset()
    ports = {name: free_port() for name in NODES}
    agents = [spawn_agent(keys, port, name, log=tmp_path / f"{name}.log") for name, port in ports.items()]
    db = tmp_path / "incidents.db"
    (tmp_path / "cluster.toml").write_text(
        f'nodes = [{", ".join(f"{chr(34)}127.0.0.1:{p}{chr(34)}" for p in ports.values())}]\n'
        f'key = "{keys.operator_key}"\nknown_hosts = "{keys.known_hosts}"\n'
        f'db = "{db}"\nscheduler = "slurm"\noperator = "{OPERATOR}"\n')
    console = await asyncio.create_subprocess_exec(
        PYTHON, "-m", "console", "console", "--headless", "--cluster", str(tmp_path / "cluster.toml"),
        "--duration", "600", cwd=ROOT, env=slurm_cluster.env(), stdin=subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    deployment = Deployment(slurm_cluster, ports, db, keys)

    async def read() -> None:
        assert console.stdout is not None
        async for raw in console.stdout:
            deployment.lines.append(raw.decode(errors="replace").rstrip())

    reader = asyncio.create_task(read())
    try:
        await wait_until(lambda: all(f"node {n} ok" in deployment.lines for n in NODES) or console.returncode,
                         timeout=60, what="the console connected to all four agents")
        assert console.returncode is None, "\n".join(deployment.lines)
        yield deployment
    finally:
        if console.returncode is None:
            console.send_signal(signal.SIGTERM)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(console.wait(), 30)
        if console.returncode is None:
            console.kill()
            await console.wait()
        await asyncio.wait_for(reader, 10)
        for agent in agents:
            agent.terminate()
        for agent in agents:
            try:
                agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()


def _explain(d: Deployment, incident: str | None) -> str:
    steps = [str(s) for s in d.steps(incident)] if incident else []
    return "\n".join([*d.lines[-30:], *steps])


async def test_an_xid_79_isolates_the_node_and_drains_it_in_slurm_with_the_incident_in_the_reason(
        deployment: Deployment) -> None:
    d = deployment
    assert "XID 79" in d.fault("node-2")
    await wait_until(lambda: d.incident("xid-hardware", "node-2"), timeout=30, what="the xid-hardware incident")
    incident = d.incident("xid-hardware", "node-2")
    assert incident is not None
    await wait_until(lambda: d.step(incident, "drain_node")[0] not in ("", "planned", "running"), timeout=60,
                     what="the drain step to finish")
    assert d.step(incident, "capture_scene")[0] == "done", _explain(d, incident)
    assert d.step(incident, "isolate_node")[0] == "done", _explain(d, incident)
    assert d.step(incident, "drain_node")[0] == "done", _explain(d, incident)

    # Slurm took node-2 out of the pool, saying which incident, which playbook and who.
    state, reason = d.slurm.node("node-2")
    assert "DRAIN" in state
    assert reason.startswith(f"gridwatch: incident {incident} (playbook xid-hardware, operator {OPERATOR}): ")
    assert [d.slurm.drained(n) for n in NODES] == [False, True, False, False]

    # Every step that ran is in the audit before and after, the drain with the very argv sent.
    await wait_until(lambda: all(s not in ("planned", "running") for _, s, _ in d.steps(incident)), timeout=60,
                     what="the rest of the plan")
    audit = d.audit(incident)
    for name, state_now, _ in d.steps(incident):
        phases = [phase for _, what, _, phase, _ in audit if what.startswith(f"{name} on ")]
        if state_now in ("done", "failed"):
            assert phases == ["before", "after"], (name, audit)
    sent = [(what, why, phase) for _, what, why, phase, _ in audit if what.startswith("scontrol update")]
    argv = f"scontrol update NodeName=node-2 State=DRAIN 'Reason={reason}'"
    assert sent == [(argv, reason, "before"), (argv, reason, "after")]
    assert any(what == "scontrol show node -o node-2" for _, what, _, _, _ in audit)


async def test_with_the_controller_stopped_the_drain_stays_pending_and_happens_when_it_comes_back(
        deployment: Deployment) -> None:
    d = deployment
    d.slurm.script("stop-controller")
    d.fault("node-3")
    await wait_until(lambda: d.incident("xid-hardware", "node-3"), timeout=30, what="the xid-hardware incident")
    incident = d.incident("xid-hardware", "node-3")
    assert incident is not None
    await wait_until(lambda: d.step(incident, "drain_node")[0] == "pending", timeout=60,
                     what="the drain to be pending")
    assert d.step(incident, "drain_node")[1].startswith("controller unreachable, retrying")
    assert d.step(incident, "isolate_node")[0] == "done"  # the node stays isolated meanwhile
    d.slurm.script("start-controller")
    await wait_until(lambda: d.step(incident, "drain_node")[0] != "pending", timeout=90,
                     what="the retried drain once slurmctld answers")
    assert d.step(incident, "drain_node")[0] == "done", _explain(d, incident)
    assert incident in d.slurm.node("node-3")[1]
