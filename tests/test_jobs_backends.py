"""How requeue_job reads each scheduler's answers, and what it refuses (no scheduler runs here: scripted answers)."""

from __future__ import annotations

import json

import pytest

from gridwatch.playbooks.jobs import Job, JobRequeuer, KubernetesJobs, SlurmJobs
from gridwatch.playbooks.notify import CommandOutcome
from gridwatch.playbooks.scheduler import Kubernetes, SchedulerClient, SchedulerError

# As Debian's Slurm 22.05 prints it (scontrol show job -o 12), trimmed of fields nothing reads.
SHOW_JOB = ("JobId=12 JobName=pretrain-7b UserId=alice(1001) GroupId=alice(1001) MCS_label=N/A Priority=4294901758 "
            "Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 "
            "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:07 TimeLimit=UNLIMITED NodeList=node-[1-3] "
            "BatchHost=node-1 NumNodes=3 NumCPUs=3 StdOut=/home/alice/slurm-12.out Power=")


def test_a_slurm_job_is_read_with_its_user_nodes_and_requeue_flag() -> None:
    job = SlurmJobs().parse_job(Job(id="12"), SHOW_JOB)
    assert (job.user, job.name, job.nodes, job.state, job.requeue, job.batch, job.restarts) == (
        "alice", "pretrain-7b", "node-[1-3]", "RUNNING", True, True, 0)
    assert job.describe() == "job 12 (pretrain-7b, user alice, node-[1-3])"
    assert SlurmJobs().refusal(job) is None


def test_a_slurm_job_that_did_not_opt_in_or_is_not_batch_is_refused_saying_why() -> None:
    backend = SlurmJobs()
    no = backend.parse_job(Job(id="12"), SHOW_JOB.replace("Requeue=1", "Requeue=0"))
    assert "did not opt in to requeue (Requeue=0; submit it with sbatch --requeue)" in (backend.refusal(no) or "")
    interactive = backend.parse_job(Job(id="12"), SHOW_JOB.replace("BatchFlag=1", "BatchFlag=0"))
    assert "not a batch job" in (backend.refusal(interactive) or "")


def test_a_requeued_slurm_job_is_held_but_one_the_user_asked_to_begin_later_is_not() -> None:
    backend = SlurmJobs()
    requeued = SHOW_JOB.replace("JobState=RUNNING Reason=None", "JobState=PENDING Reason=BeginTime")
    assert backend.held(backend.parse_job(Job(id="12"), requeued.replace("Restarts=0", "Restarts=1")))
    assert not backend.held(backend.parse_job(Job(id="12"), requeued))  # --begin: never requeued, left alone


@pytest.mark.parametrize("line", ["12; rm -rf /", "--all", "12\x1b[31m", "abc"])
def test_a_job_id_that_is_not_one_is_refused_before_any_command_is_built(line: str) -> None:
    with pytest.raises(SchedulerError, match="where a job id belongs"):
        SlurmJobs().parse_list(line + "\n")


def test_garbage_from_scontrol_is_an_error_not_a_job() -> None:
    with pytest.raises(SchedulerError, match="gave no JobState"):
        SlurmJobs().parse_job(Job(id="12"), "slurm_load_jobs error: Invalid job id specified")


def _pod(name: str, *, owner: str | None = "Job", phase: str = "Running", deleting: bool = False) -> dict[str, object]:
    meta: dict[str, object] = {"name": name, "namespace": "train"}
    if owner:
        meta["ownerReferences"] = [{"kind": owner, "name": "llm-7b", "controller": True}]
    if deleting:
        meta["deletionTimestamp"] = "2026-12-02T06:00:00Z"
    return {"metadata": meta, "status": {"phase": phase}}


class Scripted:
    """A kubectl that answers from a script and records what it was asked."""

    def __init__(self, pods: list[dict[str, object]]) -> None:
        self.pods = pods
        self.argvs: list[list[str]] = []

    async def run(self, argv: list[str], timeout: float) -> CommandOutcome:
        self.argvs.append(argv)
        if argv[:3] == ["kubectl", "get", "pods"]:
            return CommandOutcome(0, json.dumps({"items": self.pods}))
        return CommandOutcome(0, "pod deleted")


async def test_kubernetes_deletes_only_the_pods_a_controller_recreates_and_says_which_it_left() -> None:
    runner = Scripted([_pod("llm-7b-worker-2"), _pod("debug-shell", owner=None), _pod("done", phase="Succeeded"),
                       _pod("llm-7b-worker-9", deleting=True)])
    records: list[tuple[list[str], str | None]] = []
    client = SchedulerClient(Kubernetes(), runner, lambda argv, outcome: records.append((argv, outcome)))
    done = await JobRequeuer(client, KubernetesJobs()).requeue("node-2", [])
    assert runner.argvs[0] == ["kubectl", "get", "pods", "--all-namespaces", "--field-selector",
                               "spec.nodeName=node-2", "-o", "json"]
    assert runner.argvs[1:] == [["kubectl", "delete", "pod", "--namespace", "train", "llm-7b-worker-2", "--wait=false"]]
    assert done.done == ["requeued pod train/llm-7b-worker-2 (Job/llm-7b)"]
    assert done.refused == ["pod train/debug-shell has no controller to recreate it: not deleted"]
    assert ([argv for argv, outcome in records if outcome is None]
            == [["kubectl", "delete", "pod", "--namespace", "train", "llm-7b-worker-2", "--wait=false"]])


def test_a_pod_name_that_could_pose_as_an_option_is_refused() -> None:
    with pytest.raises(SchedulerError, match="pod or namespace name"):
        KubernetesJobs().parse_list(json.dumps({"items": [_pod("--all")]}))


class ScriptedSlurm:
    """squeue and scontrol answering from a script: the job runs until requeued, then waits with BeginTime."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.requeued = False

    async def run(self, argv: list[str], timeout: float) -> CommandOutcome:
        self.log.append(" ".join(argv[:2]))
        if argv[0] == "squeue":
            return CommandOutcome(0, "12\n")
        if argv[:2] == ["scontrol", "requeue"]:
            self.requeued = True
            return CommandOutcome(0, "")
        if argv[:2] == ["scontrol", "show"]:
            if not self.requeued:
                return CommandOutcome(0, SHOW_JOB)
            return CommandOutcome(0, SHOW_JOB.replace("JobState=RUNNING Reason=None", "JobState=PENDING Reason=BeginTime")
                                  .replace("Restarts=0", "Restarts=1"))
        return CommandOutcome(0, "")


async def test_a_requeued_slurm_job_is_let_start_only_past_the_second_its_credential_was_revoked() -> None:
    # slurmd revokes the job's credential at the requeue, to the second: one issued in that second fails the job
    # for good ("Killing non-startable batch job: Job credential revoked"), as a real slurmctld did in CI.
    from gridwatch.playbooks.jobs import REVOKE_S
    from gridwatch.playbooks.scheduler import Slurm

    log: list[str] = []

    async def sleep(seconds: float) -> None:
        log.append(f"sleep {seconds}")

    client = SchedulerClient(Slurm(), ScriptedSlurm(log), lambda argv, outcome: None)
    done = await JobRequeuer(client, SlurmJobs(), sleep=sleep).requeue("node-2", [])
    assert done.done == ["requeued job 12 (pretrain-7b, user alice, node-[1-3]); pending again, asked to start now"]
    assert REVOKE_S > 1.0
    assert log[log.index("scontrol requeue"):] == ["scontrol requeue", "scontrol show", f"sleep {REVOKE_S}",
                                                   "scontrol update"]
