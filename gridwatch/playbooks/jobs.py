"""The scheduler's jobs on a node, and requeueing them: the ``requeue_job`` step.

A job gridwatch did not write (Megatron, torchtitan, a plain DDP script under
``sbatch``) cannot leave a bad node in place; what heals it is its scheduler.
After ``drain_node`` the job is requeued, so it starts again on other nodes and
resumes from its own newest checkpoint:

- Slurm: ``squeue -w NODE`` finds the jobs on the node, ``scontrol show job -o``
  reads each one's state and Requeue flag, ``scontrol requeue`` ends it, and
  ``scontrol update JobId=N StartTime=now`` lifts the hold Slurm puts on a
  requeued job (its BeginTime, about two minutes on) once it is pending again.
- Kubernetes: the node's pods that a controller owns (a Job, a StatefulSet, a
  ReplicaSet...) are deleted, so the controller recreates them on another node
  (the node is cordoned by then).

Opt-in: a Slurm job without ``Requeue=1`` (``sbatch --requeue``, or
``JobRequeue=1`` for the cluster), one that is not a batch job, or a pod no
controller owns is not requeued, and the step says so (it fails, so the
incident pages). Idempotent: each job is read before anything is sent to it;
one no longer running (requeued already, by this incident or another of the
same job, or ended) is not requeued again.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from gridwatch.playbooks.model import SchedulerKind
from gridwatch.playbooks.scheduler import SchedulerClient, SchedulerError, check_node
from gridwatch.wire.protocol import clean_text


@dataclass(frozen=True)
class Job:
    """One scheduler job on a node, as the scheduler said it."""

    id: str
    state: str = ""
    user: str = ""
    name: str = ""
    nodes: str = ""  # as the scheduler prints them (a hostlist: node-[1-3])
    requeue: bool = False  # it opted in to being requeued (Slurm Requeue=1; a pod a controller owns)
    batch: bool = True  # Slurm: only batch jobs can be requeued
    restarts: int = 0
    reason: str = ""  # why it waits (Slurm: BeginTime once requeued)
    namespace: str = ""  # Kubernetes
    owner: str = ""  # Kubernetes: the controller that recreates the pod (Job/train-llm)
    deleting: bool = False  # Kubernetes: a deletion is under way already

    def describe(self) -> str:
        if self.namespace:
            return f"pod {self.namespace}/{self.id}" + (f" ({self.owner})" if self.owner else "")
        who = ", ".join(part for part in (self.name, f"user {self.user}" if self.user else "", self.nodes) if part)
        return f"job {self.id}" + (f" ({who})" if who else "")


@dataclass
class Requeued:
    """What one requeue step did, job by job; ``refused`` say why a job was left running."""

    done: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)  # every job found on the node, as first read

    def outcome(self, title: str, node: str) -> str:
        if not self.jobs:
            return f"no {title} job runs on {node}: nothing to requeue"
        return "; ".join(self.done + self.refused)


class JobBackend(Protocol):
    """One scheduler's commands for the jobs on a node, and how to read their answers."""

    def list_argv(self, node: str) -> list[str]: ...

    def parse_list(self, output: str) -> list[Job]: ...

    def read_argv(self, job: Job) -> list[str] | None: ...  # None: the list says all there is to know

    def parse_job(self, job: Job, output: str) -> Job: ...

    def refusal(self, job: Job) -> str | None: ...  # why this job must not be requeued; None: it may

    def running(self, job: Job) -> bool: ...  # still running (so not requeued yet)

    def requeue_argvs(self, job: Job) -> list[list[str]]: ...

    def held(self, job: Job) -> bool: ...  # requeued and held back from starting (Slurm's BeginTime)

    def start_now_argv(self, job: Job) -> list[str] | None: ...


_SLURM_JOB_ID = re.compile(r"^\d+(?:_\d+)?(?:\+\d+)?$")  # 123, an array task 123_4, a het job 123+0
_SLURM_FIELD = re.compile(r"(?:^|\s)(\w+)=(\S*)")
# A running job's states that hold the node: not yet requeued.
_SLURM_RUNNING = ("RUNNING", "CONFIGURING", "SUSPENDED", "STOPPED", "RESIZING")


def _slurm_id(text: str) -> str:
    if not _SLURM_JOB_ID.match(text):
        raise SchedulerError(f"squeue gave {text[:40]!r} where a job id belongs")
    return text


class SlurmJobs:
    """``squeue -w`` to find, ``scontrol show job -o`` to read, ``scontrol requeue`` and ``StartTime=now``."""

    def list_argv(self, node: str) -> list[str]:
        return ["squeue", "--noheader", "--nodelist", check_node(node), "--format", "%i"]

    def parse_list(self, output: str) -> list[Job]:
        return [Job(id=_slurm_id(line.strip())) for line in output.splitlines() if line.strip()]

    def read_argv(self, job: Job) -> list[str] | None:
        return ["scontrol", "show", "job", "-o", _slurm_id(job.id)]

    def parse_job(self, job: Job, output: str) -> Job:
        line = next((ln for ln in output.splitlines() if ln.startswith(f"JobId={job.id} ")), "")
        if not line:
            # An array task is shown under its own JobId with ArrayJobId/ArrayTaskId beside it; any one line will do.
            line = next((ln for ln in output.splitlines() if ln.startswith("JobId=")), "")
        fields = dict(_SLURM_FIELD.findall(line))
        if "JobState" not in fields:
            raise SchedulerError(f"scontrol show job {job.id} gave no JobState: {output.strip()[-200:]!r}")

        def text(key: str) -> str:
            return clean_text(fields.get(key, ""), 120)

        user = re.sub(r"\(\d+\)$", "", text("UserId"))
        restarts = text("Restarts")
        return Job(id=job.id, state=text("JobState"), user=user, name=text("JobName"), nodes=text("NodeList"),
                   requeue=fields.get("Requeue") == "1", batch=fields.get("BatchFlag", "1") == "1",
                   restarts=int(restarts) if restarts.isdigit() else 0, reason=text("Reason"))

    def refusal(self, job: Job) -> str | None:
        if not job.batch:
            return f"{job.describe()} is not a batch job (srun or salloc): Slurm requeues only batch jobs"
        if not job.requeue:
            return f"{job.describe()} did not opt in to requeue (Requeue=0; submit it with sbatch --requeue)"
        return None

    def running(self, job: Job) -> bool:
        return job.state in _SLURM_RUNNING

    def requeue_argvs(self, job: Job) -> list[list[str]]:
        return [["scontrol", "requeue", _slurm_id(job.id)]]

    def held(self, job: Job) -> bool:
        # A requeued job waits with reason BeginTime; a --begin the user asked for is left alone (no restart).
        return job.state == "PENDING" and job.reason == "BeginTime" and job.restarts > 0

    def start_now_argv(self, job: Job) -> list[str] | None:
        return ["scontrol", "update", f"JobId={_slurm_id(job.id)}", "StartTime=now"]


_KUBE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _kube_name(text: object) -> str:
    if not isinstance(text, str) or not _KUBE_NAME.match(text):
        raise SchedulerError(f"kubectl gave {str(text)[:60]!r} where a pod or namespace name belongs")
    return text


class KubernetesJobs:
    """``kubectl get pods --field-selector spec.nodeName=NODE``; a pod a controller owns is deleted to requeue."""

    def list_argv(self, node: str) -> list[str]:
        return ["kubectl", "get", "pods", "--all-namespaces", "--field-selector",
                f"spec.nodeName={check_node(node)}", "-o", "json"]

    def parse_list(self, output: str) -> list[Job]:
        try:
            data = json.loads(output)
        except ValueError:
            raise SchedulerError(f"kubectl get pods did not give JSON: {output.strip()[-200:]!r}") from None
        items = data.get("items") if isinstance(data, dict) else None
        jobs = []
        for pod in items if isinstance(items, list) else []:
            meta = pod.get("metadata") if isinstance(pod, dict) else None
            if not isinstance(meta, dict):
                continue
            status = pod.get("status") if isinstance(pod.get("status"), dict) else {}
            phase = status.get("phase") if isinstance(status, dict) else None
            if phase not in ("Running", "Pending"):
                continue  # Succeeded or Failed: nothing left on the node to move
            owners = meta.get("ownerReferences")
            owner = next((o for o in owners if isinstance(o, dict) and o.get("controller") is True), None) \
                if isinstance(owners, list) else None
            owned = f"{clean_text(str(owner.get('kind', '')), 40)}/{clean_text(str(owner.get('name', '')), 80)}" \
                if owner else ""
            jobs.append(Job(id=_kube_name(meta.get("name")), namespace=_kube_name(meta.get("namespace", "default")),
                            state=str(phase), name=owned, owner=owned, requeue=owner is not None,
                            deleting=meta.get("deletionTimestamp") is not None))
        return jobs

    def read_argv(self, job: Job) -> list[str] | None:
        return None

    def parse_job(self, job: Job, output: str) -> Job:
        return job

    def refusal(self, job: Job) -> str | None:
        if not job.owner:
            return f"pod {job.namespace}/{job.id} has no controller to recreate it: not deleted"
        return None

    def running(self, job: Job) -> bool:
        return not job.deleting

    def requeue_argvs(self, job: Job) -> list[list[str]]:
        return [["kubectl", "delete", "pod", "--namespace", _kube_name(job.namespace), _kube_name(job.id),
                 "--wait=false"]]

    def held(self, job: Job) -> bool:
        return False

    def start_now_argv(self, job: Job) -> list[str] | None:
        return None


def jobs_backend_for(kind: SchedulerKind) -> JobBackend | None:
    if kind is SchedulerKind.SLURM:
        return SlurmJobs()
    if kind is SchedulerKind.KUBERNETES:
        return KubernetesJobs()
    return None


Sleep = Callable[[float], Awaitable[None]]
# How long after a requeue the job's new credentials are safe from the old one's revocation (whole seconds).
REVOKE_S = 1.2


class JobRequeuer:
    """Requeues the jobs on one node through a :class:`SchedulerClient` (every command audited with its argv)."""

    def __init__(self, client: SchedulerClient, jobs: JobBackend, *, poll: float = 0.25,
                 sleep: Sleep = asyncio.sleep) -> None:
        self.client = client
        self.jobs = jobs
        self.poll = poll
        self.sleep = sleep

    async def find(self, node: str) -> list[Job]:
        """The jobs on ``node``, each read whole."""
        listed = self.jobs.parse_list(await self.client.read(self.jobs.list_argv(node)))
        return [await self.read(job) for job in listed]

    async def read(self, job: Job) -> Job:
        argv = self.jobs.read_argv(job)
        return job if argv is None else self.jobs.parse_job(job, await self.client.read(argv))

    async def requeue(self, node: str, seen: list[Job]) -> Requeued:
        """Requeue every job on ``node`` that opted in. ``seen`` holds the jobs earlier tries found there (one
        whose outcome is unknown) and gains the ones found now: each is read again, so a job requeued
        already is only let start, never requeued twice."""
        found = await self.find(node)
        ids = {job.id for job in found}
        for job in list(seen):
            if job.id not in ids:
                found.append(await self.read(job))
        seen[:] = found
        result = Requeued(jobs=found)
        for job in found:
            refused = self.jobs.refusal(job)
            if job.id not in ids and self.jobs.running(job):
                continue  # off this node now: requeued already and started again elsewhere
            if self.jobs.running(job) and refused:
                result.refused.append(refused)
                continue
            if self.jobs.running(job):
                for argv in self.jobs.requeue_argvs(job):
                    await self.client.act(argv)
                said = f"requeued {job.describe()}"
            elif self.jobs.held(job):
                said = f"{job.describe()} was requeued already"
            else:
                continue  # ended, or requeued and started again: nothing to do
            result.done.append(said + await self._start_now(job))
        return result

    async def _start_now(self, job: Job) -> str:
        """Once a requeued job waits again, lift the scheduler's hold so it starts at once."""
        if self.jobs.start_now_argv(job) is None:
            return ""
        current = await self.read(job)
        while self.jobs.running(current) or current.state in ("COMPLETING", "REQUEUED", "REQUEUE_HOLD",
                                                               "REQUEUE_FED"):
            await self.sleep(self.poll)  # the step's timeout bounds this wait
            current = await self.read(current)
        if not self.jobs.held(current):
            return f"; it is {current.state or 'gone'} now"
        # Each node's slurmd revoked the job's credential at the requeue, to the second: one issued in that same
        # second reads as revoked, and slurmctld then fails the job for good ("Killing non-startable batch job:
        # Job credential revoked"). The requeue happened before the job read as pending, so a little over a
        # second from here is past it; a later StartTime instead would wait for the scheduler's next pass.
        await self.sleep(REVOKE_S)
        argv = self.jobs.start_now_argv(current)
        if argv is not None:
            await self.client.act(argv)
        return "; pending again, asked to start now"
