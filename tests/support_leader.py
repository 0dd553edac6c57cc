"""Consoles under an etcd election: headless consoles as real processes, what their databases and the agents recorded."""

from __future__ import annotations

import os
import sqlite3
import subprocess
from pathlib import Path

from gridwatch.sshlink.server import Caller
from gridwatch.trainer.control_server import ControlServer
from gridwatch.wire import protocol as p
from tests.conftest import PYTHON, ROOT

OPERATOR = Caller(username="test", role="operator", key="SHA256:test")


def action_events(agent: object, action: str, ok: bool = True) -> list[p.Event]:
    """The agent's own record of what it did: an ``action`` event per action that changed something."""
    frames, _ = agent.ring.since(0)  # type: ignore[attr-defined]
    out = []
    for data in frames:
        frame = p.decode_agent_frame(data)
        if isinstance(frame, p.Event) and frame.kind == "action" and frame.details.get("action") == action:
            if (": ok:" in str(frame.message)) == ok:
                out.append(frame)
    return out


class Job:
    """Three nodes' trainers as their control sockets show them; a node's socket can be down (re-forming)."""

    def __init__(self, tmp_path: Path, names: list[str]) -> None:
        self.paths = {n: str(tmp_path / f"{n}.sock") for n in names}
        self.servers: dict[str, ControlServer] = {}
        self.step = 40

    def status(self) -> p.TrainerStatus:
        return p.TrainerStatus(job=p.Text("run"), phase=p.Text("training"), step=self.step,
                               checkpoints={p.Text("0"): 35}, world_size=3)

    def up(self, name: str) -> None:
        server = ControlServer(self.paths[name], self.status, node=name)
        server.start()
        self.servers[name] = server

    def down(self, name: str) -> None:
        server = self.servers.pop(name, None)  # a node taken down twice (the test and a stop) is down once
        if server is not None:
            server.stop()

    def stop(self) -> None:
        for name in list(self.servers):
            self.down(name)


def console(keys, spec: str, db: Path, etcd: str, who: str, log: Path) -> subprocess.Popen:  # noqa: ANN001
    cmd = [PYTHON, "-m", "gridwatch", "console", "--headless", "--nodes", spec, "--key", str(keys.operator_key),
           "--known-hosts", str(keys.known_hosts), "--db", str(db), "--etcd", etcd, "--operator", who,
           "--control-socket", str(db.with_suffix(".sock"))]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def plan_steps(db: Path, playbook: str) -> dict[str, tuple[str, str]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT s.step, s.state, s.outcome FROM steps s JOIN incidents i ON i.id = s.incident"
                            " WHERE i.playbook = ?", (playbook,)).fetchall()
    return {step: (state, outcome) for step, state, outcome in rows}


def incidents(db: Path, playbook: str) -> list[str]:
    if not db.exists():
        return []
    try:
        with sqlite3.connect(db) as conn:
            return [r[0] for r in conn.execute("SELECT id FROM incidents WHERE playbook = ?", (playbook,))]
    except sqlite3.Error:
        return []
