"""Checkpoint stall per save: our snapshot (copy into reused buffers, written by a thread) vs a synchronous torch.save.

Usage: python benchmarks/bench_checkpoint.py [--sizes 20,200] [--dir DIR]
Prints one line per size: params, sync torch.save stall, our stall, ratio,
background write time, and the step-time slowdown while the write runs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gridwatch.trainer.checkpoint import Manifest
from gridwatch.trainer.config import TrainConfig
from gridwatch.trainer.model import ByteGPT, ModelConfig, param_count
from gridwatch.trainer.state import init_optimizer_state, live_tensors
from gridwatch.trainer.tiers import TieredCheckpointer

SHAPES = {20: ModelConfig(dim=512, layers=6, heads=8, seq_len=64), 200: ModelConfig(dim=1280, layers=10, heads=16, seq_len=64)}


def _step(model: ByteGPT, opt: torch.optim.Optimizer) -> float:
    x = torch.randint(0, 256, (2, model.cfg.seq_len))
    t0 = time.perf_counter()
    model(x, x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def bench(size: int, root: Path) -> str:
    torch.manual_seed(0)
    model = ByteGPT(SHAPES[size])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    init_optimizer_state(opt)
    live = live_tensors(model, opt)
    t0 = time.perf_counter()
    torch.save({k: v for k, v in live.items()}, root / f"sync-{size}.pt")
    sync = time.perf_counter() - t0
    quiet = [_step(model, opt) for _ in range(3)]
    cfg = TrainConfig(run_dir=str(root / f"run-{size}"), tier0_dir=str(root / f"t0-{size}"), keep=(1, 1, 1))
    ckpt = TieredCheckpointer(cfg, "node-1", lambda o: None)
    stalls, writes, busy = [], [], []
    for i in range(3):
        m = Manifest(step=i + 1, epoch=0, sampler_position=0, tier=1, world_size=1, model="bench")
        stalls.append(ckpt.snapshot(live, m, {1}, tier2_owner=False))
        w0 = time.perf_counter()
        while ckpt.busy():
            busy.append(_step(model, opt))
        writes.append(time.perf_counter() - w0)
    ckpt.stop()
    ours = statistics.median(stalls)
    return (
        f"{param_count(model) / 1e6:.1f}M params: sync torch.save {sync * 1e3:.0f} ms | ours (stall) {ours * 1e3:.0f} ms "
        f"= {100 * ours / sync:.1f}% | background write (tiers 0+1) {statistics.median(writes):.2f} s | "
        f"step {statistics.median(quiet) * 1e3:.0f} ms quiet, {statistics.median(busy) * 1e3:.0f} ms beside the write"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="20,200")
    parser.add_argument("--dir", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            print(bench(size, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
