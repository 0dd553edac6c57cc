"""The agent finds the scheduler jobs on its node from a /proc laid out like the real one."""

from __future__ import annotations

from pathlib import Path

from gridwatch.agent.jobs import jobs_on_node

# cgroup files as Slurm 22.05 (cgroup v1 and v2) and the kubelet (systemd driver) write them.
SLURM_V1 = ("12:pids:/slurm/uid_1000/job_4242/step_0\n11:memory:/slurm/uid_1000/job_4242/step_0\n"
            "1:name=systemd:/system.slice/slurmd.service\n")
SLURM_V2 = "0::/system.slice/slurmstepd.scope/job_4242/step_batch/user/task_0\n"
POD = ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
       "1f5d2a3c_8b7e_4c1d_9a2b_3c4d5e6f7a8b.slice/cri-containerd-0123abcd.scope\n")
PLAIN = "0::/user.slice/user-1000.slice/session-3.scope\n"


def _proc(root: Path, pid: int, cgroup: str, environ: bytes | None = None) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)
    (d / "status").write_text(f"Name:\tpython\nPid:\t{pid}\n")
    if environ is not None:
        (d / "environ").write_bytes(environ)


def test_a_slurm_job_and_a_pod_are_found_by_their_cgroups_and_named_from_the_environment(tmp_path: Path) -> None:
    env = (b"PATH=/usr/bin\0SLURM_JOB_ID=4242\0SLURM_JOB_USER=alice\0SLURM_JOB_NAME=pretrain\x1b[31m-7b\0"
           b"SLURM_JOB_NODELIST=gpu-[001-003]\0")
    _proc(tmp_path, 100, SLURM_V1, env)
    _proc(tmp_path, 101, SLURM_V2)  # the same job's batch step, environment unreadable
    _proc(tmp_path, 102, POD)
    _proc(tmp_path, 103, PLAIN)
    (tmp_path / "self").mkdir()
    pod, slurm = jobs_on_node(tmp_path)  # by scheduler, then job id
    assert (slurm.scheduler, slurm.id, slurm.user, slurm.name, slurm.nodes, slurm.pids) == (
        "slurm", "4242", "alice", "pretrain[31m-7b", "gpu-[001-003]", [100, 101])  # no escape reaches a screen
    assert (pod.scheduler, pod.id, pod.pids) == ("kubernetes", "1f5d2a3c-8b7e-4c1d-9a2b-3c4d5e6f7a8b", [102])


def test_without_cgroups_a_process_s_slurm_environment_names_its_job_and_its_node(tmp_path: Path) -> None:
    # ProctrackType=proctrack/linuxproc, and two slurmd on one host: each node sees only its own job.
    _proc(tmp_path, 200, PLAIN, b"SLURM_JOB_ID=7\0SLURM_JOB_USER=bob\0SLURMD_NODENAME=node-1\0")
    _proc(tmp_path, 201, PLAIN, b"SLURM_JOB_ID=8\0SLURMD_NODENAME=node-2\0")
    _proc(tmp_path, 202, PLAIN, b"SLURM_JOB_ID=$(reboot)\0")
    assert [(j.id, j.user) for j in jobs_on_node(tmp_path, node="node-1")] == [("7", "bob")]
    assert [j.id for j in jobs_on_node(tmp_path, node="node-2")] == ["8"]


def test_a_process_that_ends_while_it_is_read_is_skipped(tmp_path: Path) -> None:
    _proc(tmp_path, 100, SLURM_V1)
    (tmp_path / "101").mkdir()  # gone: no cgroup file any more
    assert [j.id for j in jobs_on_node(tmp_path)] == ["4242"]
    assert jobs_on_node(tmp_path / "absent") == []


def test_this_machine_s_own_proc_reads_without_error() -> None:
    found = jobs_on_node("/proc")
    assert all(j.pids and j.scheduler in ("slurm", "kubernetes") for j in found)


def test_the_job_the_agent_itself_runs_in_is_not_reported(tmp_path: Path) -> None:
    # A DaemonSet's agent, or a test run inside a pod: its own pod is not a job on the node.
    _proc(tmp_path, 100, SLURM_V1)
    _proc(tmp_path, 102, POD)
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "cgroup").write_text(POD)
    assert [(j.scheduler, j.id) for j in jobs_on_node(tmp_path)] == [("slurm", "4242")]


def test_a_requeued_job_says_how_often_it_was_restarted_and_a_bogus_count_is_none(tmp_path: Path) -> None:
    # Slurm sets SLURM_RESTART_COUNT in a requeued job's environment: each requeue is a new life of the same id.
    _proc(tmp_path, 300, PLAIN, b"SLURM_JOB_ID=9\0SLURM_RESTART_COUNT=2\0SLURMD_NODENAME=node-1\0")
    _proc(tmp_path, 301, PLAIN, b"SLURM_JOB_ID=10\0SLURM_RESTART_COUNT=-1; reboot\0SLURMD_NODENAME=node-1\0")
    _proc(tmp_path, 302, PLAIN, b"SLURM_JOB_ID=11\0SLURMD_NODENAME=node-1\0")
    assert [(j.id, j.restarts) for j in jobs_on_node(tmp_path, node="node-1")] == [("9", 2), ("10", 0), ("11", 0)]
