"""What a scene keeps of a scheduler job gridwatch did not write: its processes' stacks and its output's tail.

The reference trainer tells its own stacks and collectives; a Megatron or Hugging Face job under Slurm tells
nothing, so the agent reads its processes (found by their cgroup or environment, see jobs.py) from outside:
the kernel's stack of every thread, and py-spy's Python stacks where it is installed and may trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gridwatch.agent.proc_stacks import process_stacks, py_spy_dump
from gridwatch.wire import protocol as p

if TYPE_CHECKING:
    from gridwatch.agent.logs import LogTailer

MAX_JOBS = 4  # jobs per scene: a node with more has its first ones kept
MAX_PROCESSES = 8  # processes per job, Python ones first (the ranks)
PY_SPY_BUDGET_S = 10.0  # for all py-spy dumps of one scene: the capture comes before the plan's next step
PY_SPY_EACH_S = 3.0
OUTPUT_TAIL = 500  # lines of the job's own output (the log its progress is read from)


def _name_part(text: str) -> str:
    cleaned = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "-_.") else "_" for ch in text[:60])
    return cleaned.strip(".") or "_"


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{int(pid)}/cmdline").read_bytes()
    except OSError:
        return ""
    return p.clean_text(raw.replace(b"\0", b" ").decode(errors="replace").strip(), 300)


def _pythons_first(pids: list[int]) -> list[int]:
    return sorted(pids, key=lambda pid: ("python" not in _cmdline(pid).split(" ")[0], pid))[:MAX_PROCESSES]


def job_stacks(pids: list[int], budget_s: float = PY_SPY_BUDGET_S,
               clock: Callable[[], float] = time.monotonic) -> str:
    """Each process's command, kernel stacks and (for a Python one, within the budget) py-spy's dump."""
    deadline = clock() + budget_s
    parts = []
    chosen = _pythons_first(pids)
    for pid in chosen:
        command = _cmdline(pid)
        if not command and not Path(f"/proc/{int(pid)}").exists():
            parts.append(f"# pid {pid}: gone")
            continue
        text = [f"# pid {pid}: {command or '?'}", process_stacks(pid)]
        if "python" in command.split(" ")[0]:
            left = deadline - clock()
            if left <= 0.5:
                text.append(f"# py-spy skipped: this scene's {budget_s:g} s for Python stacks is spent")
            else:
                dump, why = py_spy_dump(pid, timeout=min(PY_SPY_EACH_S, left))
                text.append(dump if dump is not None else f"# {why}")
        parts.append("\n".join(text))
    if len(pids) > len(chosen):
        parts.append(f"# {len(pids) - len(chosen)} more processes of this job not kept (at most {MAX_PROCESSES})")
    return "\n\n".join(parts) + "\n"


def job_evidence(jobs: list[p.SchedulerJob], job_pids: dict[tuple[str, str], list[int]], trainer_pid: int | None,
                 tailer: LogTailer | None) -> list[tuple[str, bytes]]:
    """The scene's files for the node's scheduler jobs: ``job-<scheduler>-<id>-stacks.txt`` per job (its
    processes but gridwatch's own trainer, whose stacks the scene has already) and ``job-output.txt``."""
    files: list[tuple[str, bytes]] = []
    for job in jobs[:MAX_JOBS]:
        pids = [pid for pid in job_pids.get((str(job.scheduler), str(job.id)), []) if pid != trainer_pid]
        if not pids:
            continue
        head = (f"# {job.scheduler} job {job.id} user {job.user or '?'} name {job.name or '?'} "
                f"nodes {job.nodes or '?'}: {len(pids)} processes here\n\n")
        name = f"job-{_name_part(str(job.scheduler))}-{_name_part(str(job.id))}-stacks.txt"
        files.append((name, (head + job_stacks(pids)).encode()))
    found = tailer.job_progress() if tailer is not None else None
    if found is not None:
        path = found[0]
        lines = [(ts, line) for src, line, ts in tailer.entries() if src == path][-OUTPUT_TAIL:] if tailer else []
        text = f"# the last {len(lines)} lines of {path}, the job's own output\n" + "".join(
            f"{ts:.3f} {line}\n" for ts, line in lines)
        files.append(("job-output.txt", text.encode()))
    return files
