"""What the benchmark scripts share: CPU and memory of a process, and a swarm of agents."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def cpu_seconds(pid: int, children: bool = True) -> float:
    """User + system CPU seconds of a process (and its children, alive ones)."""
    ps = psutil.Process(pid)
    total = 0.0
    for p in [ps, *(ps.children(recursive=True) if children else [])]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def cpu_percent_over(pid: int, seconds: float) -> float:
    """CPU % of one core used by ``pid`` over the next ``seconds``."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return 100 * (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


def peak_rss_mb(pid: int) -> float:
    """Peak resident memory (VmHWM) of a process and its children, in MB."""
    total = 0.0
    ps = psutil.Process(pid)
    for p in [ps, *ps.children(recursive=True)]:
        try:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def start_swarm(count: int, base_port: int, keys_dir: Path, per_process: int = 250, gpus: int = 8) -> list[subprocess.Popen]:
    """``count`` simulated agents on consecutive loopback ports, ``per_process`` to a process."""
    swarms = []
    for start in range(0, count, per_process):
        n = min(per_process, count - start)
        swarms.append(subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "swarm.py"), "--count", str(n), "--base-port", str(base_port + start),
             "--keys", str(keys_dir), "--gpus", str(gpus)], stdout=subprocess.PIPE, text=True))
    for s in swarms:
        if s.stdout is None or not s.stdout.readline().startswith("ready"):
            stop_all(swarms)
            raise RuntimeError("a swarm process did not start")
    return swarms


def stop_all(procs: Sequence[subprocess.Popen | None]) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.terminate()
    for p in procs:
        if p is not None:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
