"""Which scheduler jobs hold this node: read from the processes' own cgroups and environment, never from the
controller.

Asking slurmctld (``squeue -w``) from every node of a 10,000-node cluster every few seconds is the load
Slurm's own documentation warns about; the kernel already knows. Slurm puts each job's processes in a cgroup
named after it (cgroup v1 ``/slurm/uid_1000/job_4242/step_0``, v2
``/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0``), and a Kubernetes pod's containers live
under ``kubepods.../pod<uid>``. Where Slurm tracks jobs without cgroups (``ProctrackType=proctrack/linuxproc``)
a process's own ``SLURM_JOB_ID`` says it, and ``SLURMD_NODENAME`` which node's job it is (several
``slurmd -N`` on one host). Slurm's environment (``SLURM_JOB_ID``, ``SLURM_JOB_USER``,
``SLURM_JOB_NAME``, ``SLURM_JOB_NODELIST``) adds the names where the agent may read it (as root, or the
job's own user); without it the job id and the process owner still say whose it is.

What is read is untrusted text from other users' processes: it is clipped and cleaned, and never run.
"""

from __future__ import annotations

import os
import pwd
import re
from dataclasses import dataclass, field
from pathlib import Path

from gridwatch.wire.protocol import clean_text

_SLURM_CGROUP = re.compile(r"/job_(\d+)(?:/|$)")
_POD_CGROUP = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_ENV_KEYS = (b"SLURM_JOB_ID", b"SLURM_JOB_USER", b"SLURM_JOB_NAME", b"SLURM_JOB_NODELIST", b"SLURMD_NODENAME",
             b"SLURM_RESTART_COUNT")
MAX_ENVIRON = 256 * 1024  # an environment longer than this is not read past it
MAX_JOBS = 64  # a node with more jobs than this has something odd going on; the rest are counted, not named


@dataclass
class NodeJob:
    """One scheduler job with processes on this node."""

    scheduler: str  # slurm | kubernetes
    id: str
    user: str = ""
    name: str = ""
    nodes: str = ""
    pids: list[int] = field(default_factory=list)
    # Slurm's SLURM_RESTART_COUNT: how often the job was requeued. A requeued job is a new life of the same id;
    # progress its log printed before this life began is not this life's.
    restarts: int = 0


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _read(path: str, limit: int) -> bytes:
    """Up to ``limit`` bytes of a /proc file; raises OSError. Plain ``os`` calls on a string path: the walk reads
    two or three files of every process on the node (a thousand and more), and pathlib's objects and buffered
    files cost several times the read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, limit)
        while data and len(data) < limit:
            more = os.read(fd, limit - len(data))
            if not more:
                break
            data += more
    finally:
        os.close(fd)
    return data


def _environ(proc: str) -> dict[bytes, str]:
    try:
        raw = _read(f"{proc}/environ", MAX_ENVIRON)
    except OSError:  # another user's process and we are not root, or it ended
        return {}
    if b"SLURM" not in raw:  # every key looked for starts so: most processes' environments hold none
        return {}
    found: dict[bytes, str] = {}
    for entry in raw.split(b"\0"):
        key, _, value = entry.partition(b"=")
        if key in _ENV_KEYS:
            found[key] = clean_text(value.decode("utf-8", "replace"), 200)
    return found


def _job_key(cgroup: str, env: dict[bytes, str] | None) -> tuple[str, str] | None:
    """The job a process belongs to, by its cgroup, else by its Slurm environment (when read)."""
    slurm = _SLURM_CGROUP.search(cgroup)
    if slurm is not None:
        return ("slurm", slurm.group(1))
    pod = _POD_CGROUP.search(cgroup)
    if pod is not None:
        return ("kubernetes", pod.group(1).replace("_", "-"))
    job_id = (env or {}).get(b"SLURM_JOB_ID", "")
    return ("slurm", job_id) if job_id.isdigit() else None


def _own_job(root: Path) -> tuple[str, str] | None:
    """The job the agent itself runs in (a DaemonSet's pod, a test run inside a Slurm job): never reported."""
    try:
        cgroup = (root / "self" / "cgroup").read_text(errors="replace")[:8192]
    except OSError:
        cgroup = ""
    own_id = os.environ.get("SLURM_JOB_ID", "")
    return _job_key(cgroup, {b"SLURM_JOB_ID": own_id} if own_id else None)


def jobs_on_node(proc_root: str | Path = "/proc", node: str = "") -> list[NodeJob]:
    """The scheduler jobs whose processes run here (on ``node``, where Slurm names it), by the processes'
    cgroups or else their Slurm environment; by scheduler, then job id."""
    root = Path(proc_root)
    jobs: dict[tuple[str, str], NodeJob] = {}
    own = _own_job(root)
    try:
        entries = [e for e in os.scandir(root) if e.name.isdigit()]
    except OSError:
        return []
    for entry in entries:
        proc = f"{root}/{entry.name}"
        try:
            cgroup = _read(f"{proc}/cgroup", 1 << 16).decode("utf-8", "replace")[:8192]
            uid = os.stat(f"{proc}/status").st_uid
        except OSError:
            continue  # it ended while we looked
        env: dict[bytes, str] | None = None
        key = _job_key(cgroup, None)
        if key is None:
            env = _environ(proc)
            key = _job_key(cgroup, env)
            if key is None or (node and env.get(b"SLURMD_NODENAME", node) != node):
                continue
        if key == own:
            continue
        job = jobs.get(key)
        if job is None:
            if len(jobs) >= MAX_JOBS:
                continue
            job = jobs[key] = NodeJob(scheduler=key[0], id=key[1], user=_user(uid))
        job.pids.append(int(entry.name))
        if key[0] == "slurm" and not job.name:
            env = _environ(proc) if env is None else env
            if env.get(b"SLURM_JOB_ID") == job.id:
                job.user = env.get(b"SLURM_JOB_USER") or job.user
                job.name = env.get(b"SLURM_JOB_NAME", "")
                job.nodes = env.get(b"SLURM_JOB_NODELIST", "")
                count = env.get(b"SLURM_RESTART_COUNT", "")
                job.restarts = int(count) if count.isdigit() and len(count) < 6 else 0
    for job in jobs.values():
        job.pids.sort()
    return sorted(jobs.values(), key=lambda j: (j.scheduler, len(j.id), j.id))
