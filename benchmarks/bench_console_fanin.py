"""Fan-in at scale: the real console, headless, attached to 1,250 nodes x 8 GPUs at 1 Hz.

A swarm of simulated agents (benchmarks/swarm.py: many real SSH servers per
process) on this machine's loopback; `gridwatch console --headless` connects to
all of them with the playbook engine running. Measured: the console's CPU % of
one core and peak RSS over a steady window, and the frames it received, lost
(gap frames) and could not decode. Baseline in the same run, on the same
swarm: `gridwatch tail` (the same fan-in without state store and engine).

    .venv/bin/python benchmarks/bench_console_fanin.py [--agents 1250] [--seconds 60]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure import ROOT, cpu_percent_over, peak_rss_mb, start_swarm, stop_all  # noqa: E402

SUMMARY = re.compile(r"summary (\d+)/(\d+) nodes connected.*frames (\d+), lost (\d+), bad (\d+)")


def _wait_connected(log: Path, total: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = SUMMARY.findall(log.read_text()) if log.exists() else []
        if found and int(found[-1][0]) >= total:
            return
        time.sleep(2)
    raise RuntimeError(f"the console did not connect to all {total} agents within {timeout:.0f} s")


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=1250)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--base-port", type=int, default=23000)
    args = ap.parse_args()
    from agents.keys import init_keys

    tmp = Path(tempfile.mkdtemp(prefix="gw-console-fanin-"))
    keys = init_keys(tmp / "keys", shared_host_key=True)  # one key for many loopback agents: a bench, not a deployment
    spec = f"127.0.0.1:[{args.base_port}-{args.base_port + args.agents - 1}]"
    console = tail = None
    swarms = start_swarm(args.agents, args.base_port, keys.dir)
    try:
        log = tmp / "console.log"
        console = subprocess.Popen(
            [sys.executable, "-m", "console", "console", "--headless", "--nodes", spec, "--key", str(keys.viewer_key),
             "--known-hosts", str(keys.known_hosts), "--db", str(tmp / "incidents.db")],
            cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
        _wait_connected(log, args.agents, 300)
        time.sleep(10)  # let the connection storm settle
        before = SUMMARY.findall(log.read_text())[-1]
        console_cpu = cpu_percent_over(console.pid, args.seconds)
        time.sleep(11)  # one more summary line after the window
        after = SUMMARY.findall(log.read_text())[-1]
        console_rss = peak_rss_mb(console.pid)
        stop_all([console])
        tail = subprocess.Popen(
            [sys.executable, "-m", "console", "tail", "--nodes", spec, "--key", str(keys.viewer_key),
             "--known-hosts", str(keys.known_hosts), "--json"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(60)
        tail_cpu = cpu_percent_over(tail.pid, args.seconds)
        tail_rss = peak_rss_mb(tail.pid)
    finally:
        stop_all([console, tail, *swarms])
    frames = int(after[2]) - int(before[2])
    rate = frames / (args.seconds + 11)
    print(f"machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
          f"{args.agents} agents x 8 simulated GPUs in {len(swarms)} swarm processes on the same cores")
    print(f"console: connected {after[0]}/{after[1]}, ~{rate:.0f} frames/s, lost (gap) {after[3]}, bad {after[4]} (totals since start)")
    print(f"console --headless: {console_cpu:.1f} % of a core, peak RSS {console_rss:.0f} MB")
    print(f"baseline gridwatch tail --json: {tail_cpu:.1f} % of a core, peak RSS {tail_rss:.0f} MB; "
          f"console/tail CPU ratio {console_cpu / tail_cpu:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
