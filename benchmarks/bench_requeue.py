"""Fault to the requeued job's first step past its checkpoint, on this machine's Slurm: requeue_job vs by hand.

Usage: python benchmarks/bench_requeue.py [--runs 1] [--dir DIR] [--job shell|torch] [--modes gridwatch,baseline]

Starts the repo's test Slurm (scripts/slurm-cluster.sh: munged, slurmctld, four `slurmd -N`) and submits a
job gridwatch did not write (a shell loop: one iteration every 0.2 s, a checkpoint every 10, resumes from
it), `sbatch --requeue -N 3`. At the fault (an XID 79 on one of its nodes) it measures, from the fault to
the job's first iteration after its restart:

- gridwatch: the shipped xid-hardware plan run by the executor (drain_node, then requeue_job);
- baseline: what an operator types (drain, then `scontrol requeue`), which waits out Slurm's requeue hold.

The shell job's own start-up is near zero (no torch import), so its figure is the orchestration's own time.
``--job torch`` runs tests/jobs/ddp_job.py instead (torch DDP over gloo, one task per node under srun,
``torch.save`` every 10 iterations, resume from the newest): each run also says how much of the figure is the
job's own start-up in its new life (its first line to its first step: torch's import, the process group), so
the rest is what the requeue itself cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from gridwatch.playbooks.clock import SystemClock
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.executor import Executor
from gridwatch.playbooks.loader import load_builtin
from gridwatch.playbooks.store import IncidentStore
from gridwatch.wire.protocol import ActionResult, Event, Hello, Sample

ROOT = Path(__file__).resolve().parent.parent
NODES = ("node-1", "node-2", "node-3", "node-4")
JOB = """#!/bin/bash
ckpt={work}/ckpt
step=$(cat "$ckpt" 2>/dev/null || echo 0)
echo "start $(date +%s.%N) restart=${{SLURM_RESTART_COUNT:-0}} from $step on $SLURM_JOB_NODELIST"
while true; do
    step=$((step + 1))
    echo " iteration $step/ 1000000 | at $(date +%s.%N)"
    [ $((step % 10)) -eq 0 ] && echo "$step" > "$ckpt"
    sleep 0.2
done
"""


class Sink:
    async def act(self, node: str, action: str, args: dict[str, Any], reason: str) -> ActionResult:
        return ActionResult(node=node, id="bench", action=action, ok=True, message="done")


def _run(*argv: str, env: dict[str, str]) -> str:
    done = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {done.stdout}{done.stderr}")
    return done.stdout


def _job_field(job: str, key: str, env: dict[str, str]) -> str:
    found = re.search(rf"\b{key}=(\S*)", _run("scontrol", "show", "job", "-o", job, env=env))
    return found.group(1) if found else ""


def _wait(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


class Life(msgspec.Struct):
    """One life of the job (its first run, or a run after a requeue), as its output shows it."""

    started: float  # its first line
    first_step: float | None = None  # its first iteration
    step: int | None = None


def _lives(out: Path, job: str) -> list[Life]:
    """The job's lives in its output file, in order. The shell loop prints ``start T ...`` and
    ``iteration N/ M | at T``; the torch job starts each line with its time, each task says
    ``start ... restart=K`` and rank 0 prints the iterations."""
    lives: list[Life] = []
    restart = None
    for line in out.read_text(errors="replace").splitlines():
        words = line.split()
        if job == "shell":
            if line.startswith("start "):
                lives.append(Life(started=float(words[1])))
            elif " iteration " in line and lives and lives[-1].first_step is None:
                lives[-1].first_step, lives[-1].step = float(words[-1]), int(words[1].rstrip("/"))
            continue
        if len(words) < 3 or not re.fullmatch(r"\d+\.\d+", words[0]):
            continue
        if words[1] == "start" and words[-1] != restart:
            restart = words[-1]  # the first task of a new life: its start-up begins here
            lives.append(Life(started=float(words[0])))
        elif words[1] == "iteration" and lives and lives[-1].first_step is None:
            lives[-1].first_step, lives[-1].step = float(words[0]), int(words[2].rstrip("/"))
    return lives


def _first_step_after(out: Path, since: float, job: str = "shell") -> Life | None:
    """The first life that began after ``since`` and has trained a step."""
    for life in _lives(out, job):
        if life.started > since and life.first_step is not None:
            return life
    return None


TORCH_JOB = """#!/bin/bash
srun --kill-on-bad-exit=1 {python} {root}/tests/jobs/ddp_job.py {work} 0.2 10
"""


def one_run(mode: str, work: Path, env: dict[str, str], job_kind: str = "shell") -> tuple[float, Life]:
    for n in NODES:  # every node back in the pool from the run before
        if "DRAIN" in _run("scontrol", "show", "node", "-o", n, env=env):
            _run("scontrol", "update", f"NodeName={n}", "State=RESUME", env=env)
    job_dir = work / mode
    job_dir.mkdir()
    script = JOB if job_kind == "shell" else TORCH_JOB
    (job_dir / "job.sh").write_text(script.format(work=job_dir, python=sys.executable, root=ROOT))
    (job_dir / "job.sh").chmod(0o755)
    job = _run("sbatch", "--parsable", "--requeue", "-N", "3", "--open-mode=append",
               "-o", str(job_dir / "out"), str(job_dir / "job.sh"), env=env).strip()
    _wait("the job to run", lambda: _job_field(job, "JobState", env) == "RUNNING", 60)
    ckpt = job_dir / ("ckpt" if job_kind == "shell" else "checkpoint.pt")
    _wait("ten iterations", lambda: ckpt.exists(), 180)
    fault = time.time()
    if mode == "gridwatch":
        engine = Engine(load_builtin(), SystemClock())
        for n in NODES:
            engine.observe(n, Hello(node=n))
            engine.observe(n, Sample(node=n))
        (plan,) = engine.observe("node-2", Event(node="node-2", kind="xid", code=79, gpu=0, severity="critical",
                                                 message="GPU has fallen off the bus"))
        store = IncidentStore(work / f"{mode}.db")
        executor = Executor(store, Sink(), scheduler="slurm", who="bench")
        os.environ["SLURM_CONF"] = env["SLURM_CONF"]
        asyncio.run(executor.run(plan))
        requeue = next(s for s in store.steps(plan.incident.id) if s.step == "requeue_job")
        print(f"  requeue_job: {requeue.state}: {requeue.outcome}")
    else:
        _run("scontrol", "update", "NodeName=node-2", "State=DRAIN", "Reason=xid79 by hand", env=env)
        _run("scontrol", "requeue", job, env=env)
    _wait("the job's first step after its restart",
          lambda: _first_step_after(job_dir / "out", fault, job_kind) is not None, 300)
    life = _first_step_after(job_dir / "out", fault, job_kind)
    assert life is not None and life.first_step is not None
    _run("scancel", job, env=env)
    _wait("the job to end", lambda: _job_field(job, "JobState", env) in ("CANCELLED", ""), 60)
    return life.first_step - fault, life


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--job", choices=("shell", "torch"), default="shell",
                        help="the shell loop (start-up near zero), or tests/jobs/ddp_job.py: torch DDP, gloo, "
                             "torch.save checkpoints, one task per node under srun")
    parser.add_argument("--modes", default="gridwatch,baseline", help="which of gridwatch,baseline to run")
    args = parser.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench-requeue-"))
    cluster = base / "slurm"
    subprocess.run([str(ROOT / "scripts" / "slurm-cluster.sh"), "start", str(cluster), "4"], check=True,
                   stdout=subprocess.DEVNULL)
    env = {**os.environ, "SLURM_CONF": str(cluster / "etc" / "slurm.conf")}
    try:
        results: dict[str, list[float]] = {m: [] for m in args.modes.split(",")}
        for run in range(args.runs):
            for mode in results:
                (base / f"run{run}").mkdir(exist_ok=True)
                seconds, life = one_run(mode, base / f"run{run}", env, args.job)
                results[mode].append(seconds)
                own = (life.first_step or life.started) - life.started
                print(f"run {run + 1} {mode}: fault -> first step after the restart {seconds:.1f} s (step "
                      f"{life.step}); of it the job's own start-up (its first line to its first step) {own:.1f} s, "
                      f"the rest {seconds - own:.1f} s")
        if "gridwatch" in results and "baseline" in results:
            ours, theirs = min(results["gridwatch"]), min(results["baseline"])
            print(f"gridwatch requeue_job {ours:.1f} s vs scontrol requeue by hand {theirs:.1f} s: "
                  f"{ours / theirs:.3f}x ({theirs / ours:.0f} times sooner)")
    finally:
        subprocess.run([str(ROOT / "scripts" / "slurm-cluster.sh"), "stop", str(cluster)], check=False)


if __name__ == "__main__":
    main()
