"""Recovery after losing a node, and the cost of a node rejoining: the coordinator against torchrun's rendezvous.

Usage: python benchmarks/bench_recovery.py [--nodes 3] [--cases coordinator:kill:node-2,torchrun:kill:node-2,...]

Each case starts ``--nodes`` nodes (one worker each), waits for step 10, then
loses one node and times the survivors' first step in the smaller job:

- ``leave``: the node is asked to leave (what isolating it does);
- ``kill``: SIGKILL of its torchrun agent and worker (the node died);
- ``crash``: SIGKILL of its worker only (torchrun restarts it);
- ``freeze``: SIGSTOP of its agent and worker (a hung node; thawed afterwards).

Then (except for ``crash``, where torchrun brings it back) the node is started
again and the case reports how long the job stalled while it rejoined (the
longest gap between two steps) and when it trained with every node again.
Membership ``coordinator`` re-forms the job in place; ``torchrun`` (tuned
rendezvous) and ``torchrun-default`` are the baselines, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import psutil

from gridwatch.trainer.config import TrainConfig
from gridwatch.trainer.launch import LocalRun, start_local_run
from gridwatch.wire.controlsock import request

WINDOW_S = 120.0


def _lines(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def _first(run: LocalRun, after: float, world: int, timeout: float = WINDOW_S) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = [r for r in _lines(run.metrics_path) if r["time"] > after and r["world_size"] == world]
        if recs:
            return recs[0]
        time.sleep(0.05)
    return None


def _longest_gap(run: LocalRun, start: float, end: float) -> float:
    times = [r["time"] for r in _lines(run.metrics_path) if start <= r["time"] <= end]
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def _lose(run: LocalRun, fault: str, node: str) -> None:
    if fault == "kill":
        run.kill_node(node)
    elif fault == "freeze":
        run.freeze_node(node)
    elif fault == "crash":
        for child in psutil.Process(run.nodes[node].pid).children(recursive=True):
            child.kill()
    elif fault == "leave":
        asyncio.run(request(run.socket_path(node), "leave", {}))
    else:
        raise SystemExit(f"unknown fault {fault!r}")


def case(root: Path, membership: str, fault: str, node: str, nodes: int, dim: int, layers: int) -> str:
    name = f"{membership}-{fault}-{node}"
    mode, rdzv = ("torchrun", "default") if membership == "torchrun-default" else (membership, "tuned")
    cfg = TrainConfig(run_dir=str(root / name), steps=100_000, dim=dim, layers=layers, heads=4,
                      tier0_every=5, tier1_every=20, tier2_every=60, tier0_dir=str(root / f"t0-{name}"),
                      progress_deadline_s=5.0)
    names = [f"node-{i}" for i in range(1, nodes + 1)]
    run = start_local_run(cfg, names, rdzv=rdzv, membership=mode)
    label = f"{membership:16} {fault:6} {node}"
    try:
        while run.last_step() < 10:
            time.sleep(0.05)
        lost_at = run.last_step()
        t_fault = time.time()
        _lose(run, fault, node)
        smaller = nodes if (fault == "crash" and mode == "torchrun") else nodes - 1
        first = _first(run, t_fault, smaller)
        if first is None:
            return f"{label}: not recovered within {WINDOW_S:.0f} s"
        restored = first["step"] - 1
        out = (f"{label}: first step of the re-formed job {first['time'] - t_fault:5.1f} s after the loss; "
               f"{max(0, lost_at - restored)} steps lost")
        if fault == "freeze":
            run.kill_node(node)  # a frozen node is dead to the job; it comes back as a new process
            run.thaw_node(node)
        if fault != "crash":
            while run.nodes[node].poll() is None:
                time.sleep(0.05)
            t_back = time.time()
            run.add_node(node)
        else:
            t_back = first["time"]
        full = _first(run, t_back, nodes)
        if full is None:
            return out + f"; the node did not rejoin within {WINDOW_S:.0f} s"
        time.sleep(2.0)
        stall = _longest_gap(run, t_back, time.time())
        return out + (f"; back in the job {full['time'] - t_back:5.1f} s after its restart, "
                      f"the job stalled {stall:4.1f} s for it")
    finally:
        run.thaw_node(node) if fault == "freeze" else None
        run.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(
        f"{m}:{f}" for f in ("leave:node-2", "kill:node-2", "kill:node-1", "crash:node-2", "freeze:node-2")
        for m in ("coordinator", "torchrun")))
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs; {args.nodes} nodes, dim {args.dim}, "
          f"{args.layers} layers, tier 0 every 5 steps, progress deadline 5 s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.cases.split(","):
            membership, fault, node = spec.split(":")
            print(case(Path(tmp), membership, fault, node, args.nodes, args.dim, args.layers), flush=True)


if __name__ == "__main__":
    main()
