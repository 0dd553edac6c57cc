"""Time to detect and time to recover, over injected faults of mixed kinds, against a baseline.

Each round starts a headless demo (3 nodes x 2 simulated GPUs, the tiny
trainer), waits for training, injects a fault that must not take a node out,
then one that must, each through the operator action, and watches until the
plans are done and training moves again (at most ``--window`` seconds a fault).
Per fault: detected (fault to incident), stalled (time without a step, gaps
over 2 s), resumed (fault to the third step after the last such gap; 0 when
training never stopped), and the world size training ended on. The baseline
runs the same rounds either with the trainer re-forming through torchrun's
rendezvous (``--baseline torchrun``, the default: every worker restarts on a
change of members, as before the membership coordinator) or with ``act=False``
(``--baseline watch-only``: incidents are made, no step that acts is sent).

    .venv/bin/python benchmarks/bench_loop.py --out /tmp/loop.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loguru import logger  # noqa: E402

from gridwatch.console.demo.chaos import FaultSpec  # noqa: E402
from gridwatch.console.demo.cluster import ClusterOptions  # noqa: E402
from gridwatch.console.demo.progress import StepPoint  # noqa: E402
from gridwatch.console.demo.session import DemoOptions, DemoSession  # noqa: E402

TINY_TRAINER = ["--dim=32", "--heads=2", "--layers=1", "--micro-batches=1", "--tiers=5,10,30"]
GAP_S = 1.0  # steps come every ~0.05-0.3 s here (checkpoints are written in the background); a longer gap is a stall
RESUMED_STEPS = 3

# (node, fault) pairs per round: first one that must not take the node out, then one that must.
ROUNDS: list[list[tuple[str, FaultSpec]]] = [
    [("node-1", FaultSpec("xid", 13)), ("node-2", FaultSpec("xid", 79))],
    [("node-3", FaultSpec("thermal")), ("node-1", FaultSpec("xid", 48))],
    [("node-2", FaultSpec("xid", 31)), ("node-3", FaultSpec("ecc-dbe"))],
    [("node-1", FaultSpec("trainer-crash")), ("node-2", FaultSpec("fell-off-bus"))],
    [("node-3", FaultSpec("trainer-hang")), ("node-1", FaultSpec("agent-kill"))],
]


@dataclass
class FaultResult:
    mode: str
    round: int
    node: str
    fault: str
    detected_s: float | None
    stalled_s: float
    resumed_s: float | None  # None: training had not resumed when the window closed
    world_end: int | None
    actions: list[str]
    playbooks: list[str]
    should_remove: bool  # the second fault of a round: the node must leave the job


def stall(points: list[StepPoint], t0: float, end: float) -> tuple[float, float | None]:
    """(seconds without a step in [t0, end], fault to the RESUMED_STEPS-th step after the last gap)."""
    before = [p for p in points if p.at < t0]
    after = [p for p in points if t0 <= p.at <= end]
    marks = [before[-1].at if before else t0, *[p.at for p in after]]
    stalled, last_gap_end = 0.0, None
    for a, b in zip(marks, marks[1:]):
        if b - a > GAP_S:
            stalled += b - max(a, t0)  # a stall an earlier fault left counts from this fault on
            last_gap_end = b
    tail_start = marks[-1]
    if end - tail_start > GAP_S:
        return stalled + end - max(tail_start, t0), None  # still stalled when the window closed
    if last_gap_end is None:
        return stalled, 0.0
    later = [p for p in after if p.at >= last_gap_end]
    if len(later) < RESUMED_STEPS:
        return stalled, None
    return stalled, later[RESUMED_STEPS - 1].at - t0


async def one_round(index: int, faults: list[tuple[str, FaultSpec]], mode: str, window: float,
                    base: Path) -> list[FaultResult]:
    act = mode != "watch-only"
    trainer = TINY_TRAINER + (["--membership=torchrun"] if mode == "torchrun" else [])
    session = DemoSession(DemoOptions(
        cluster=ClusterOptions(nodes=3, gpus=2, interval=0.5, trainer_args=trainer),
        directory=str(base / f"{mode}-round{index}"), tick_interval=0.25, act=act,
    ))
    results = []
    try:
        await session.start()
        await session.attach()
        await session.wait_connected(30)
        await until(lambda: (session.watch.last_step or 0) >= 20, 90)
        for slot, (node, spec) in enumerate(faults):
            t0 = time.time()
            result = await session.inject(node, spec, gpu=1)
            if not result.ok:
                print(f"  {spec.label} on {node} refused: {result.message}")
                continue

            def settled() -> bool:
                now = time.time()
                if now - t0 < 15 or session.runtime.busy:
                    return False
                if not any(i.node == node and i.detected_at >= t0 - 0.5 for i in session.store.incidents()):
                    return False  # a metric playbook (thermal: 60 s) may still be counting
                pts = session.watch.points
                return bool(pts) and now - pts[-1].at < 1.0 and stall(pts, t0, now)[1] is not None

            await until(settled, window)
            end = time.time()
            session.watch.poll()
            stalled, resumed = stall(session.watch.points, t0, end)
            mine = [i for i in session.store.incidents() if i.node == node and i.detected_at >= t0 - 0.5]
            detected = min((i.detected_at - t0 for i in mine), default=None)
            actions = [s.step for i in mine for s in session.store.steps(i.id) if s.state == "done"]
            last = session.watch.points[-1] if session.watch.points else None
            results.append(FaultResult(mode, index, node, spec.label,
                                       round(detected, 3) if detected is not None else None, round(stalled, 2),
                                       round(resumed, 2) if resumed is not None else None,
                                       last.world if last else None, actions, sorted({i.playbook for i in mine}),
                                       should_remove=slot == 1))
            print(f"  {mode} r{index} {spec.label:<14} {node}: detected {fmt(results[-1].detected_s)}, stalled "
                  f"{results[-1].stalled_s:.1f} s, resumed {fmt(results[-1].resumed_s)}, world {results[-1].world_end}, "
                  f"actions {','.join(actions) or '-'}", flush=True)
    finally:
        await session.close()
    return results


async def until(cond, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.25)
    return True


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def aggregate(rows: list[FaultResult], window: float) -> dict[str, object]:
    detect = [r.detected_s for r in rows if r.detected_s is not None]
    # A fault training never came back from within the window counts as the window.
    resumed = [r.resumed_s if r.resumed_s is not None else window for r in rows]
    return {
        "faults": len(rows), "detected": len(detect),
        "detect_median_s": statistics.median(detect) if detect else None, "detect_worst_s": max(detect, default=None),
        "resumed_median_s": statistics.median(resumed) if resumed else None,
        "resumed_worst_s": max(resumed, default=None),
        "not_resumed": sum(r.resumed_s is None for r in rows),
        "stalled_total_s": round(sum(r.stalled_s for r in rows), 1),
        # The world after a fault that should take its node out: 3 means the node still trains.
        "faulty_node_left_in_job": sum(1 for r in rows if r.should_remove and r.world_end == 3),
    }


async def main_async(args: argparse.Namespace) -> int:
    base = Path(args.keep or tempfile.mkdtemp(prefix="gridwatch-bench-loop-"))
    rows: list[FaultResult] = []
    modes = ["acting"] if args.no_baseline else ["acting", args.baseline]
    for mode in modes:
        for index, faults in enumerate(ROUNDS[: args.rounds], start=1):
            rows += await one_round(index, faults, mode, args.window, base)
            if args.out:
                Path(args.out).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"3 nodes x 2 simulated GPUs, trainer {' '.join(TINY_TRAINER)}; window {args.window:g} s a fault")
    print("\n| mode | round | fault | node | detected | stalled | resumed | world after | actions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.mode} | {r.round} | {r.fault} | {r.node} | {fmt(r.detected_s)} | {r.stalled_s:.1f} s | "
              f"{fmt(r.resumed_s) if r.resumed_s is not None else f'> {args.window:g} s'} | {r.world_end} | "
              f"{','.join(r.actions) or '-'} |")
    summary = {}
    for mode in modes:
        mine = [r for r in rows if r.mode == mode]
        if mine:
            summary[mode] = aggregate(mine, args.window)
            print(f"\n{mode}: {json.dumps(summary[mode])}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": [asdict(r) for r in rows], "summary": summary}, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=len(ROUNDS), help=f"rounds of two faults (at most {len(ROUNDS)})")
    parser.add_argument("--window", type=float, default=80.0, help="longest watch per fault, seconds")
    parser.add_argument("--baseline", choices=("torchrun", "watch-only"), default="torchrun",
                        help="the rounds to compare with (default: acting, with torchrun re-forming the job)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the baseline rounds")
    parser.add_argument("--keep", metavar="DIR", help="keep each round's demo directory under DIR")
    parser.add_argument("--out", metavar="PATH", help="write every fault's result and the summary as JSON")
    args = parser.parse_args()
    logger.remove()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
