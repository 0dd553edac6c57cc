"""What the engine's tick costs a console as the fleet grows: the walk for lost heartbeats, twice a second.

N nodes on summaries every 5 s (as ``auto`` sends them from 1,250 nodes up), a tenth of them heard between two
ticks 0.5 s apart, a heartbeat playbook loaded (the shipped ones): CPU per tick, the frames observed between
ticks not counted. ``--against DIR`` runs the same in the tree at DIR (its ``gridwatch`` package) in turn with
this one, in one sitting, and prints the ratio.

    .venv/bin/python benchmarks/bench_silence_checks.py [--nodes 1000,2500,12500] [--ticks 400] [--against DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(nodes: int, ticks: int) -> float:
    """CPU µs per engine tick with ``nodes`` nodes (this process's ``gridwatch``)."""
    from loguru import logger

    from gridwatch.playbooks.clock import ManualClock
    from gridwatch.playbooks.engine import Engine
    from gridwatch.playbooks.loader import load_builtin
    from gridwatch.wire import protocol as p

    logger.remove()
    clock = ManualClock(1_700_000_000.0)
    engine = Engine(load_builtin(), clock)
    names = [f"node{i:05d}" for i in range(nodes)]
    for name in names:
        engine.observe(name, p.Hello(node=p.Text(name), ts=clock.now(), interval=1.0))
        engine.observe(name, p.Summary(node=p.Text(name), seq=1, ts=clock.now(), every=5.0))
    seq = 1
    heard = nodes // 10  # a node a summary every 5 s: a tenth of them in each half second
    spent = 0.0
    for k in range(ticks):
        clock.advance(0.5)
        seq += 1
        for i in range(k * heard, (k + 1) * heard):
            name = names[i % nodes]
            engine.observe(name, p.Summary(node=p.Text(name), seq=seq, ts=clock.now(), every=5.0))
        started = time.process_time()
        engine.tick()
        spent += time.process_time() - started
    return spent / ticks * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1000,2500,12500", help="fleet sizes, comma-separated")
    ap.add_argument("--ticks", type=int, default=400)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--against", metavar="DIR", help="a tree to measure in turn with this one (the baseline)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: one size, its result as JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.ticks)))
        return 0
    trees = [("this tree", ROOT)] + ([("against", Path(args.against).resolve())] if args.against else [])
    print(f"machine: {os.cpu_count()} cores, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for size in (int(n) for n in args.nodes.split(",")):
        results: dict[str, list[float]] = {label: [] for label, _ in trees}
        for _ in range(args.runs):  # alternated, so a drift of the machine's speed falls on both
            for label, tree in trees:
                out = subprocess.run([sys.executable, __file__, "--one", str(size), "--ticks", str(args.ticks)],
                                     env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree,
                                     capture_output=True, text=True, check=True).stdout
                results[label].append(json.loads(out.strip().splitlines()[-1]))
        line = f"{size:>6,} nodes: " + "; ".join(
            f"{label} {', '.join(f'{v:,.0f}' for v in vals)} us a tick" for label, vals in results.items())
        if args.against:
            mine, base = sorted(results["this tree"])[args.runs // 2], sorted(results["against"])[args.runs // 2]
            line += f"; ratio of medians {mine / base:.3f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
