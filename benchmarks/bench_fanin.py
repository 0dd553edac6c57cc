"""Fan-in: one ``gridwatch tail`` receiving 1,000 agents' streams at 1 Hz.

Agents are served by a few swarm processes (benchmarks/swarm.py). Measured in
the same run, against the same agents: a bare asyncssh reader that only counts
newlines (the transport's own cost, the floor). Reports each one's CPU % of a
core over a steady window, and whether tail lost any frame (seq continuity per
node, and gap frames), and each one's CPU per 1,000 frames/s, as a loaded machine's
agents may not keep 1 Hz. Exits 1 when an agent never connected or a frame was lost.

    .venv/bin/python benchmarks/bench_fanin.py [--agents 1000] [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure import ROOT, cpu_percent_over, start_swarm, stop_all  # noqa: E402

RAW_READER = r"""
import asyncio, os, sys, asyncssh
async def one(port, key, known, counts):
    while True:
        try:
            async with asyncssh.connect("127.0.0.1", port, username="bench", client_keys=[key], known_hosts=known,
                                        encryption_algs=["aes128-gcm@openssh.com"]) as conn:
                proc = await conn.create_process(subsystem="gridwatch", encoding=None)
                proc.stdin.write(b'{"type":"subscribe","v":1}\n')
                while True:
                    data = await proc.stdout.read(65536)
                    if not data:
                        break
                    counts[0] += data.count(b"\n")
        except (OSError, asyncssh.Error):
            await asyncio.sleep(1)
async def report(counts, path):
    while True:  # the frames read so far, for the bench to take a rate over its window
        with open(path + ".tmp", "w") as fh:
            fh.write(str(counts[0]))
        os.replace(path + ".tmp", path)
        await asyncio.sleep(0.5)
async def main():
    base, n, key, known, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    counts = [0]
    await asyncio.gather(report(counts, out), *(one(base + i, key, known, counts) for i in range(n)))
asyncio.run(main())
"""


def main() -> int:
    # A terminated benchmark still stops the processes it started (finally blocks run).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--per-process", type=int, default=250)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--base-port", type=int, default=21000)
    args = ap.parse_args()
    from gridwatch.sshlink.keys import init_keys

    tmp = Path(tempfile.mkdtemp(prefix="gw-fanin-"))
    keys = init_keys(tmp / "keys", shared_host_key=True)  # one key for many loopback agents: a bench, not a deployment
    tail = raw = None
    swarms = start_swarm(args.agents, args.base_port, keys.dir, args.per_process)
    try:
        spec = f"127.0.0.1:[{args.base_port}-{args.base_port + args.agents - 1}]"
        out = tmp / "tail.jsonl"
        tail = subprocess.Popen(
            [sys.executable, "-m", "gridwatch", "tail", "--nodes", spec, "--key", str(keys.viewer_key), "--known-hosts",
             str(keys.known_hosts), "--json", "--duration", str(args.seconds + 60)],
            cwd=ROOT, stdout=out.open("wb"), stderr=subprocess.DEVNULL)
        # Wait until every node said hello (connections take a while to open).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            hellos = sum(1 for line in out.open("rb") if b'"type":"hello"' in line)
            if hellos >= args.agents:
                break
            time.sleep(2)
        time.sleep(5)  # let the connection storm settle
        lines0 = sum(1 for _ in out.open("rb"))
        tail_cpu = cpu_percent_over(tail.pid, args.seconds)
        rate = (sum(1 for _ in out.open("rb")) - lines0) / args.seconds
        tail.terminate()
        tail.wait(30)
        counted = tmp / "raw.count"
        raw = subprocess.Popen([sys.executable, "-c", RAW_READER, str(args.base_port), str(args.agents), str(keys.viewer_key),
                                str(keys.known_hosts), str(counted)])
        time.sleep(40)
        raw0 = int(counted.read_text())
        raw_cpu = cpu_percent_over(raw.pid, args.seconds)
        # On a loaded machine the agents may not keep 1 Hz: the baseline's own rate makes the ratio per frame.
        raw_rate = (int(counted.read_text()) - raw0) / args.seconds
    finally:
        stop_all([tail, raw, *swarms])
    seqs: dict[str, list[int]] = {}
    gaps = frames = 0
    for line in out.open("rb"):
        f = json.loads(line)
        frames += 1
        if f["type"] == "gap":
            gaps += 1
        elif f["seq"] and f["type"] != "hello":
            seqs.setdefault(f["node"], []).append(f["seq"])
    missing = sum((s[-1] - s[0] + 1) - len(set(s)) for s in seqs.values() if s)
    print(f"machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; agents served by {len(swarms)} swarm processes on the same cores")
    print(f"agents connected: {len(seqs)} of {args.agents}; frames received by tail: {frames}; gap frames: {gaps}; missing seqs: {missing}")
    print(f"frames/s into tail during the window: {rate:.0f}")
    tail_per, raw_per = 1000 * tail_cpu / max(rate, 1), 1000 * raw_cpu / max(raw_rate, 1)
    print(f"gridwatch tail CPU: {tail_cpu:.1f} % of a core ({tail_per:.1f} % per 1,000 frames/s); "
          f"bare asyncssh reader (baseline): {raw_cpu:.1f} % at {raw_rate:.0f} frames/s ({raw_per:.1f} % per 1,000 frames/s); "
          f"ratio {tail_cpu / raw_cpu:.2f}x, per frame {tail_per / max(raw_per, 1e-9):.2f}x")
    if len(seqs) < args.agents or gaps or missing:
        print(f"not a valid run: {len(seqs)} of {args.agents} agents connected, {gaps} gap frames, {missing} missing seqs")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
