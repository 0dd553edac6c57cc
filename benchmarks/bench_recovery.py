"""Recovery after losing a node: seconds from the loss to the first step of the re-formed job, and steps lost.

Usage: python benchmarks/bench_recovery.py [--cases tuned:kill:node-2,tuned:kill:node-1,tuned:freeze:node-2,default:kill:node-2]
Each case starts 2 nodes, waits for step 10, then kills (SIGKILL agent and
workers) or freezes (SIGSTOP) one node and times the survivor's first new step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from trainer.config import TrainConfig
from trainer.launch import start_local_run


def _lines(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def case(root: Path, rdzv: str, fault: str, node: str, dim: int, layers: int) -> str:
    cfg = TrainConfig(run_dir=str(root / f"{rdzv}-{fault}-{node}"), steps=100_000, dim=dim, layers=layers, heads=4,
                      tier0_every=5, tier1_every=20, tier2_every=60, tier0_dir=str(root / f"t0-{rdzv}-{fault}-{node}"),
                      progress_deadline_s=5.0)
    run = start_local_run(cfg, ["node-1", "node-2"], rdzv=rdzv)
    try:
        while run.last_step() < 10:
            time.sleep(0.05)
        lost_at = run.last_step()
        t_fault = time.time()
        (run.kill_node if fault == "kill" else run.freeze_node)(node)
        deadline = time.monotonic() + 240
        first = None
        while time.monotonic() < deadline and first is None:
            recs = [r for r in _lines(run.metrics_path) if r["time"] > t_fault and r["world_size"] == 1]
            first = recs[0] if recs else None
            time.sleep(0.05)
        if first is None:
            return f"{rdzv:8} {fault:6} {node}: not recovered within 240 s"
        restored = first["step"] - 1
        return (f"{rdzv:8} {fault:6} {node}: first step of the re-formed job {first['time'] - t_fault:5.1f} s after the loss; "
                f"last step before {lost_at}, resumed from {restored}: {lost_at - restored} steps lost (tier-0 interval 5)")
    finally:
        run.thaw_node(node) if fault == "freeze" else None
        run.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="tuned:kill:node-2,tuned:kill:node-1,tuned:freeze:node-2,default:kill:node-2")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.cases.split(","):
            rdzv, fault, node = spec.split(":")
            print(case(Path(tmp), rdzv, fault, node, args.dim, args.layers), flush=True)


if __name__ == "__main__":
    main()
