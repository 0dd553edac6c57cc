"""A real Slurm for tests: scripts/slurm-cluster.sh started once per test run (node-1..node-4), stopped at its end."""

from __future__ import annotations

import atexit
import os
import pwd
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import wait_until_sync

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "slurm-cluster.sh"
NODES = ("node-1", "node-2", "node-3", "node-4")
_BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo")


def _which(name: str) -> str | None:
    return shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists() else None)


def missing() -> str | None:
    """Why no Slurm can run here, in one line; None when it can."""
    absent = [b for b in _BINARIES if _which(b) is None]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install slurmctld slurmd slurm-client munge)"
    return None


@dataclass
class SlurmCluster:
    """One running test cluster: its directory and its slurm.conf (clients need SLURM_CONF)."""

    directory: Path

    @property
    def conf(self) -> Path:
        return self.directory / "etc" / "slurm.conf"

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def scontrol(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(["scontrol", *args], env=self.env(), capture_output=True, text=True, timeout=30)
        if check and done.returncode != 0:
            raise AssertionError(f"scontrol {' '.join(args)} failed: {done.stdout}{done.stderr}")
        return done.stdout + done.stderr

    def node(self, name: str) -> tuple[str, str]:
        """(State, Reason) as ``scontrol show node`` prints them, read without the product's parser."""
        line = self.scontrol("show", "node", "-o", name)
        state = re.search(r"\bState=(\S+)", line)
        reason = re.search(r"\bReason=(.*?) \[[^\]]*\]", line)
        return (state.group(1) if state else "", reason.group(1) if reason else "")

    def drained(self, name: str) -> bool:
        return "DRAIN" in self.node(name)[0]

    def script(self, command: str) -> None:
        done = subprocess.run([str(SCRIPT), command, str(self.directory)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError((done.stderr.strip() or done.stdout.strip() or "failed").splitlines()[-1])

    def submit(self, workdir: Path, *, nodes: int, requeue: bool, seconds: int = 600) -> str:
        """A batch job that is not gridwatch's (it prints when it starts, then sleeps); its job id."""
        script = workdir / "job.sh"
        script.write_text("#!/bin/sh\necho \"started restart=${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST\"\n"
                          f"exec sleep {seconds}\n")
        script.chmod(0o755)
        done = subprocess.run(["sbatch", "--parsable", "-N", str(nodes), "--requeue" if requeue else "--no-requeue",
                               "-o", str(workdir / "job-%j.out"), "-J", "plain-job", str(script)],
                              env=self.env(), capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise AssertionError(f"sbatch failed: {done.stdout}{done.stderr}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as fields, read without the product's parser."""
        return dict(re.findall(r"(\w+)=(\S*)", self.scontrol("show", "job", "-o", job_id)))

    def cancel_jobs(self) -> None:
        subprocess.run(["scancel", "--full", "--user", pwd.getpwuid(os.getuid()).pw_name],
                       env=self.env(), capture_output=True, timeout=30)
        wait_until_sync(lambda: not subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env(), capture_output=True,
                                                   text=True, timeout=30).stdout.strip(),
                        timeout=60, what="every test job gone")

    def reset(self) -> None:
        """Every node back in the pool and answering, the controller up, no job left: what each test starts from."""
        self.script("start-controller")
        self.cancel_jobs()
        # After a controller restart the nodes are UNKNOWN until their slurmd registers again; RESUME waits for that.
        wait_until_sync(lambda: not any(w in self.node(n)[0] for n in NODES for w in ("UNKNOWN", "NOT_RESPONDING")),
                        timeout=60, what="every slurmd registered with the controller")
        for name in NODES:
            if self.drained(name):
                self.scontrol("update", f"NodeName={name}", "State=RESUME")
        wait_until_sync(lambda: all(self.node(n)[0] == "IDLE" for n in NODES), timeout=60,
                        what="every Slurm node back idle")


_running: dict[str, SlurmCluster] = {}


def shared(base: Path) -> SlurmCluster:
    """The run's one cluster, started under ``base`` on first use; RuntimeError with the script's reason if it cannot."""
    if "cluster" not in _running:
        cluster = SlurmCluster(base)
        atexit.register(cluster.script, "stop")  # even a run that dies leaves no daemons behind
        cluster.script("start")
        _running["cluster"] = cluster
    return _running["cluster"]
