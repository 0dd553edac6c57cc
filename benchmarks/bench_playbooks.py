"""Playbook engine cost: replaying a fleet's trace through the shipped playbooks.

A synthetic trace of NODES nodes x 8 GPUs, one sample per node per second, is
replayed with `gridwatch.playbooks.replay.replay` (decode + engine + 1 s ticks). Baseline,
measured in the same run on the same lines: decoding them alone with the
protocol decoder (the floor any consumer of the stream pays).

    .venv/bin/python benchmarks/bench_playbooks.py [--nodes 64] [--seconds 300]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gridwatch.agent.sources.simulated import SimulatedGpus  # noqa: E402
from gridwatch.playbooks.loader import load_builtin  # noqa: E402
from gridwatch.playbooks.replay import replay  # noqa: E402
from gridwatch.wire import protocol as p  # noqa: E402


def trace(nodes: int, seconds: int) -> list[bytes]:
    sims = [SimulatedGpus(8, seed=i) for i in range(nodes)]
    lines = []
    for n in range(nodes):
        lines.append(p.encode(p.Hello(node=p.Text(f"node{n:04d}"), gpus=sims[n].info(), ts=1000.0, seq=0)))
    for t in range(seconds):
        for n, sim in enumerate(sims):
            lines.append(p.encode(p.Sample(node=p.Text(f"node{n:04d}"), ts=1000.0 + t + n / nodes, seq=t + 1, gpus=sim.sample())))
    return lines


def _decode_all(lines: list[bytes]) -> None:
    # Frames are dropped as they go, as the engine's consumer does: keeping them
    # all would bill the baseline for garbage-collector scans of a growing list.
    for line in lines:
        p.decode_any_frame(line)


def best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--seconds", type=int, default=300)
    args = ap.parse_args()
    lines = trace(args.nodes, args.seconds)
    playbooks = load_builtin()
    replay(lines, playbooks)  # warm up both paths before timing either
    decode = best(lambda: _decode_all(lines))
    engine = best(lambda: replay(lines, playbooks))
    n = len(lines)
    print(f"machine: {os.cpu_count()} cores; {len(playbooks)} builtin playbooks; {n} frames ({args.nodes} nodes x 8 GPUs, {args.seconds} s)")
    print(f"decode only (baseline): {decode:.3f} s = {n / decode:,.0f} frames/s")
    print(f"replay through the engine: {engine:.3f} s = {n / engine:,.0f} frames/s; ratio {engine / decode:.2f}x the decode")
    print(f"at 1 sample/node/s: {100 * 1000 * engine / n:.1f} % of a core per 1,000 nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
