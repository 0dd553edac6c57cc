"""Fan-in at scale: the real console, headless, attached to 1,250 nodes x 8 GPUs at 1 Hz.

Simulated agents (many real SSH servers per process) on this machine's
loopback; `gridwatch console --headless` connects to all of them with the
playbook engine running. Measured: the console's CPU % of one core and peak
RSS over a steady window, and whether it received every frame the agents sent
in that window: the agents are paused at both ends of the window (every frame
they published written out), the console's totals are read when it reports
every node stale, and the two counts are compared, whatever the window's
length. Baseline in the same run, on the same agents: `gridwatch tail` (the
same fan-in without state store and engine).

    .venv/bin/python benchmarks/bench_console_fanin.py [--agents 1250] [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure import ROOT, cpu_percent_over, peak_rss_mb, stop_all  # noqa: E402

SUMMARY = re.compile(r"summary (\d+)/(\d+) nodes connected.*frames (\d+), lost (\d+), bad (\d+)")
PER_PROCESS = 250
SWARM = Path(__file__).resolve().parent / "swarm.py"


# ------------------------------------------------------------------------------------ the agents' side


@dataclass
class Totals:
    published: int = 0
    clients: int = 0
    dropped: int = 0


def start_agents(count: int, base_port: int, keys_dir: Path, gpus: int = 8) -> list[subprocess.Popen]:
    procs = []
    for start in range(0, count, PER_PROCESS):
        n = min(PER_PROCESS, count - start)
        procs.append(subprocess.Popen(
            # swarm.py --control: pause writes out what was published, as JSON; resume starts sampling again.
            [sys.executable, str(SWARM), "--control", "--count", str(n), "--base-port", str(base_port + start),
             "--keys", str(keys_dir), "--gpus", str(gpus)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for proc in procs:
        if not proc.stdout.readline().startswith("ready"):  # type: ignore[union-attr]
            stop_all(procs)
            raise RuntimeError("an agent process did not start")
    return procs


def tell(procs: list[subprocess.Popen], command: str) -> Totals:
    for proc in procs:
        proc.stdin.write(command + "\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
    totals = Totals()
    for proc in procs:
        answer = proc.stdout.readline()  # type: ignore[union-attr]
        if command == "pause":
            said = json.loads(answer) if answer.startswith("{") else {"error": answer.strip()}
            if "error" in said:
                raise RuntimeError(f"agents could not write out what they published: {said['error']}")
            totals.published += int(said["published"])
            totals.clients += int(said["clients"])
            totals.dropped += int(said["dropped"])
    return totals


# ------------------------------------------------------------------------------------ the console's side


def _summaries(log: Path, offset: int = 0) -> list[tuple[str, ...]]:
    return SUMMARY.findall(log.read_text()[offset:]) if log.exists() else []


def _wait_summary(log: Path, offset: int, connected: int, timeout: float, what: str) -> tuple[str, ...]:
    """The first summary line after ``offset`` that reports ``connected`` nodes connected."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for found in _summaries(log, offset):
            if int(found[0]) == connected:
                return found
        time.sleep(0.5)
    raise RuntimeError(f"the console did not report {what} within {timeout:.0f} s")


def quiesce(agents: list[subprocess.Popen], log: Path, total: int) -> tuple[Totals, tuple[str, ...]]:
    """Pause every agent, then read the console's totals once it calls every node stale (no frame in flight)."""
    offset = len(log.read_text())  # "0 connected" can only come after the pause
    sent = tell(agents, "pause")
    return sent, _wait_summary(log, offset, 0, 60, f"all {total} nodes stale after the pause")


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=1250)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--base-port", type=int, default=23000)
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args()
    from gridwatch.sshlink.keys import init_keys

    tmp = Path(tempfile.mkdtemp(prefix="gw-console-fanin-"))
    keys = init_keys(tmp / "keys", shared_host_key=True)  # one key for many loopback agents: a bench, not a deployment
    spec = f"127.0.0.1:[{args.base_port}-{args.base_port + args.agents - 1}]"
    console = tail = None
    agents = start_agents(args.agents, args.base_port, keys.dir, args.gpus)
    try:
        log = tmp / "console.log"
        console = subprocess.Popen(
            [sys.executable, "-m", "gridwatch", "console", "--headless", "--nodes", spec, "--key", str(keys.viewer_key),
             "--known-hosts", str(keys.known_hosts), "--db", str(tmp / "incidents.db")],
            cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
        _wait_summary(log, 0, args.agents, 300, f"all {args.agents} agents connected")
        time.sleep(10)  # let the connection storm settle
        sent0, before = quiesce(agents, log, args.agents)
        offset = len(log.read_text())
        tell(agents, "resume")
        started = time.monotonic()
        _wait_summary(log, offset, args.agents, 60, "every node back after the resume")
        console_cpu = cpu_percent_over(console.pid, args.seconds)
        window = time.monotonic() - started  # the agents published from the resume to the pause
        sent1, after = quiesce(agents, log, args.agents)
        console_rss = peak_rss_mb(console.pid)
        stop_all([console])
        tell(agents, "resume")
        tail = subprocess.Popen(
            [sys.executable, "-m", "gridwatch", "tail", "--nodes", spec, "--key", str(keys.viewer_key),
             "--known-hosts", str(keys.known_hosts), "--json"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(min(60.0, 10 + args.agents / 25))  # connected and settled
        tail_cpu = cpu_percent_over(tail.pid, args.seconds)
        tail_rss = peak_rss_mb(tail.pid)
    finally:
        stop_all([console, tail, *agents])
    published = sent1.published - sent0.published
    received = int(after[2]) - int(before[2])
    lost = int(after[3]) - int(before[3])
    bad = int(after[4]) - int(before[4])
    print(f"machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
          f"{args.agents} agents x {args.gpus} simulated GPUs in {len(agents)} agent processes on the same cores")
    print(f"window {window:.0f} s (agents paused at both ends, every published frame written out): "
          f"agents sent {published}, console received {received} ({received / window:.0f} frames/s), "
          f"missing {published - received}, lost (gap) {lost}, bad {bad}, dropped by agents {sent1.dropped - sent0.dropped}; "
          f"sessions {sent1.clients}/{args.agents}")
    print(f"console --headless: {console_cpu:.1f} % of a core, peak RSS {console_rss:.0f} MB")
    print(f"baseline gridwatch tail --json: {tail_cpu:.1f} % of a core, peak RSS {tail_rss:.0f} MB; "
          f"console/tail CPU ratio {console_cpu / tail_cpu:.2f}x")
    return 0 if published == received and lost == 0 and bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
