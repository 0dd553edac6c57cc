"""A job gridwatch did not write: its agent reads how far it is from the job's own progress lines."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

from gridwatch.agent.logs import LogTailer
from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.loader import load_builtin
from gridwatch.wire.protocol import Hello, Sample, decode_agent_frame, summarize
from tests.conftest import start_agent, stop_agent, wait_until

CORPUS = Path(__file__).parent / "data" / "progress" / "progress.jsonl"


def _latest(agent: object) -> Sample | None:
    """The newest sample the agent published, read back from its ring as a console would get it."""
    frames, _ = agent.ring.since(max(agent.ring.last_seq - 20, 0))  # type: ignore[attr-defined]
    samples = [f for f in map(decode_agent_frame, frames) if isinstance(f, Sample)]
    return samples[-1] if samples else None


def _megatron_lines() -> list[str]:
    rows = [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]
    return [r["line"] for r in rows if r["framework"] == "megatron" and "lm loss" in r["line"]][:2]


async def test_a_megatron_job_s_log_gives_the_console_its_step_loss_and_step_time(keys, tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text("")
    ra = await start_agent(keys, interval=0.05, tailer=LogTailer([str(log)], kernel=False))
    try:
        first, second = _megatron_lines()
        with log.open("a") as fh:
            fh.write("building GPT model ...\n" + first + "\n" + second + "\n")
        await wait_until(lambda: (s := _latest(ra.agent)) is not None and s.trainer is not None
                         and s.trainer.step == _iteration(second),
                         timeout=10, what="a sample carrying the job's progress")
        sample = _latest(ra.agent)
        status = sample.trainer
        assert status.read_from == str(log) and status.phase == "training"
        assert status.step == _iteration(second)  # the newest iteration printed
        assert status.loss is not None and status.step_time_s is not None and status.step_time_s > 1.0
        assert summarize(sample).trainer.read_from == str(log)  # the fleet's summaries say it too
        # Read from a log, it is no trainer of gridwatch's: the engine does not count on it to leave in place.
        engine = Engine(load_builtin(), ManualClock(1000.0))
        engine.observe("node-1", Hello(node="node-1"))
        engine.observe("node-1", summarize(sample))
        node = engine.nodes["node-1"]
        assert node.trainer_step == status.step and not node.trainer_attached
    finally:
        await stop_agent(ra)


async def test_a_scene_keeps_a_slurm_job_s_process_stacks_and_the_tail_of_its_output(keys, tmp_path: Path) -> None:
    # A job gridwatch did not write tells nothing itself: the agent reads its processes from outside.
    import subprocess
    import sys

    from gridwatch.sshlink.server import Caller
    from gridwatch.wire import protocol as p

    operator = Caller(username="op", role="operator", key="SHA256:op")

    log = tmp_path / "train.log"
    log.write_text("")
    rank = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.2)"])
    ra = await start_agent(keys, interval=0.05, tailer=LogTailer([str(log)], kernel=False),
                           scene_dir=str(tmp_path / "scenes"), jobs_every=0)  # the test says the jobs
    try:
        first, second = _megatron_lines()
        with log.open("a") as fh:
            fh.write(first + "\n" + second + "\n")
        await wait_until(lambda: (s := _latest(ra.agent)) is not None and s.trainer is not None, timeout=10,
                         what="the job's progress read")
        ra.agent.jobs = [p.SchedulerJob(scheduler="slurm", id="4242", user="alice", name="pretrain", nodes="node-[1-3]",
                                        pids=1)]
        ra.agent.job_pids = {("slurm", "4242"): [rank.pid]}  # as jobs_on_node finds them by their cgroup
        res = await ra.agent.act(operator, p.Action(id=p.Text("s1"), action=p.Text("capture_scene"), args={}))
        assert res.ok, res.message
        where = Path(res.data["path"])
        stacks = (where / "job-slurm-4242-stacks.txt").read_text()
        assert stacks.startswith("# slurm job 4242 user alice name pretrain nodes node-[1-3]")
        assert f"# pid {rank.pid}: {sys.executable} -c" in stacks and "wchan:" in stacks
        assert "py-spy" in stacks  # its Python stack, or why there is none
        output = (where / "job-output.txt").read_text()
        assert second in output and first in output
        assert "job-slurm-4242-stacks.txt" in res.data["files"]
    finally:
        rank.kill()
        rank.wait()
        await stop_agent(ra)


@contextlib.asynccontextmanager
async def _agent_on_a_slurm_job_s_log(keys, tmp_path: Path) -> AsyncIterator[tuple[object, Path]]:  # noqa: ANN001
    """An agent tailing a job's log, told (as jobs_on_node would find it) that Slurm job 4242 runs here."""
    from gridwatch.wire import protocol as p

    log = tmp_path / "train.log"
    log.write_text("")
    ra = await start_agent(keys, interval=0.05, tailer=LogTailer([str(log)], kernel=False), jobs_every=0)
    try:
        ra.agent.jobs = [p.SchedulerJob(scheduler="slurm", id="4242")]
        yield ra, log
    finally:
        await stop_agent(ra)


def _iteration(line: str) -> int:
    """The iteration a Megatron progress line names (`` iteration  1700/ 100000 | ...``)."""
    return int(line.split("/")[0].split()[-1])


async def test_a_job_s_name_outlives_its_processes_while_its_log_is_fresh(keys, tmp_path: Path) -> None:
    # Requeued, the job's processes leave the node before its log goes stale: still the same job to the console.
    async with _agent_on_a_slurm_job_s_log(keys, tmp_path) as (ra, log):
        first, second = _megatron_lines()
        with log.open("a") as fh:
            fh.write(first + "\n")
        await wait_until(lambda: (s := _latest(ra.agent)) is not None and s.trainer is not None
                         and s.trainer.job == "slurm-4242", timeout=10, what="the job named after its Slurm job")
        ra.agent.jobs = []
        seq = ra.agent.ring.last_seq
        await wait_until(lambda: ra.agent.ring.last_seq > seq + 3, timeout=10, what="more samples")
        sample = _latest(ra.agent)
        assert sample is not None and sample.trainer is not None and sample.trainer.job == "slurm-4242"


async def test_a_requeued_job_s_new_life_reports_no_step_until_it_prints_one(keys, tmp_path: Path) -> None:
    # Requeued, a job's old ranks print on as they die; once its next life (SLURM_RESTART_COUNT up) runs here,
    # what the log said before is not this life's step, or the console would call it recovered too soon.
    from gridwatch.wire import protocol as p

    async with _agent_on_a_slurm_job_s_log(keys, tmp_path) as (ra, log):
        first, second = _megatron_lines()
        with log.open("a") as fh:
            fh.write(second + "\n")
        await wait_until(lambda: (s := _latest(ra.agent)) is not None and s.trainer is not None
                         and s.trainer.step == _iteration(second), timeout=10, what="the first life's step")
        ra.agent.jobs = [p.SchedulerJob(scheduler="slurm", id="4242", restarts=1)]
        await wait_until(lambda: (s := _latest(ra.agent)) is not None and s.trainer is not None
                         and s.trainer.step is None, timeout=10, what="the new life without a step yet")
        sample = _latest(ra.agent)
        assert sample is not None and sample.trainer is not None
        assert sample.trainer.job == "slurm-4242" and sample.trainer.phase == "starting"
        with log.open("a") as fh:
            fh.write(first + "\n")  # the new life's first line, from its checkpoint (an earlier iteration)
        await wait_until(lambda: (s := _latest(ra.agent)) is not None and s.trainer is not None
                         and s.trainer.step == _iteration(first), timeout=10, what="the new life's own step")
