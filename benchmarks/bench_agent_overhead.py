"""Agent overhead at 1 s: CPU % of one core and peak RSS, beside two baselines.

Runs, one after another and measured the same way (CPU time of the process
tree over a steady window after warm-up, peak RSS from /proc):
  1. ``gridwatch agent`` with 8 simulated GPUs and 2 tailed logs (being written to),
  2. a bare psutil sampling loop (CPU, memory, NICs, disks every second),
  3. ``glances`` in quiet mode at 1 s, if it is installed (``pip install glances``).

    .venv/bin/python benchmarks/bench_agent_overhead.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure import ROOT, cpu_percent_over, peak_rss_mb, stop_all  # noqa: E402

BARE_LOOP = """
import time, psutil
while True:
    psutil.cpu_percent(None); psutil.virtual_memory(); psutil.getloadavg()
    psutil.net_io_counters(pernic=True); psutil.disk_io_counters()
    time.sleep(1)
"""


def measure(cmd: list[str], seconds: float, warmup: float = 5.0) -> tuple[float, float]:
    """CPU % of one core over the window after warm-up, and peak RSS (MB) of the process tree."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        time.sleep(warmup)
        cpu = cpu_percent_over(proc.pid, seconds)
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited early with {proc.returncode}")
        return cpu, peak_rss_mb(proc.pid)
    finally:
        stop_all([proc])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="measured window per program (default 60)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    from gridwatch.sshlink.keys import init_keys

    keys = init_keys(tmp / "keys", shared_host_key=True)  # one key for many loopback agents: a bench, not a deployment
    logs = [tmp / "train.log", tmp / "nccl.log"]
    stop = threading.Event()

    def writer() -> None:  # a trainer-like log rate: a few lines a second per file
        n = 0
        while not stop.is_set():
            for log in logs:
                with log.open("a") as fh:
                    fh.write(f"step {n} loss {2.5 - n * 1e-4:.4f} tokens/s 123456\n")
            n += 1
            time.sleep(0.25)

    for log in logs:
        log.touch()
    threading.Thread(target=writer, daemon=True).start()
    agent = [
        sys.executable, "-m", "gridwatch", "agent", "--node-name", "bench", "--listen", "127.0.0.1:0",
        "--host-key", str(keys.host_key), "--authorized-viewers", str(keys.authorized_viewers),
        "--authorized-operators", str(keys.authorized_operators), "--simulate-gpus", "8", "--interval", "1",
        "--log", str(logs[0]), "--log", str(logs[1]),
    ]
    results = {"gridwatch agent (8 sim GPUs, 2 logs)": measure(agent, args.seconds)}
    results["bare psutil loop"] = measure([sys.executable, "-c", BARE_LOOP], args.seconds)
    glances = shutil.which("glances") or (str(Path(sys.executable).parent / "glances") if (Path(sys.executable).parent / "glances").exists() else None)
    if glances:
        results["glances -q -t 1"] = measure([glances, "-q", "-t", "1"], args.seconds)
    stop.set()
    print(f"machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; window {args.seconds:.0f} s after 5 s warm-up")
    base_cpu, base_rss = results["bare psutil loop"]
    print(f"{'program':40} {'CPU % of a core':>16} {'peak RSS MB':>12} {'CPU vs bare':>12}")
    for name, (cpu, rss) in results.items():
        ratio = cpu / base_cpu if base_cpu > 0 else float("nan")
        print(f"{name:40} {cpu:16.2f} {rss:12.1f} {ratio:11.2f}x")
    if not glances:
        print("(glances not installed: pip install glances to add it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
