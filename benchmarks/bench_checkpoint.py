"""Checkpoint stall per save against a synchronous torch.save, and the training steps beside the background write.

Usage: python benchmarks/bench_checkpoint.py [--sizes 20,200] [--saves 3] [--dir DIR]

Trains the reference model (ByteGPT, AdamW, one CPU thread) and saves it
through the trainer's own checkpointer (tiers 0 and 1 under DIR, a temporary
directory by default). Prints the machine and the load average first, then per
size: the synchronous torch.save of the same state, the loop's stall per save
(the snapshot call plus any wait for its copy before the next optimizer step:
median, and the first save, which also allocates the staging memory) and its
share of the torch.save, the time to write tiers 0 and 1, and the median step
with no write running against the steps taken while a write runs. Run it with
PYTHONPATH pointing at another checkout to measure that checkout's
checkpointer with the same yardstick.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import gridwatch
from gridwatch.trainer.checkpoint import Manifest
from gridwatch.trainer.config import TrainConfig
from gridwatch.trainer.model import ByteGPT, ModelConfig, param_count
from gridwatch.trainer.state import init_optimizer_state, live_tensors
from gridwatch.trainer.tiers import TieredCheckpointer

SHAPES = {20: ModelConfig(dim=512, layers=6, heads=8, seq_len=64), 200: ModelConfig(dim=1280, layers=10, heads=16, seq_len=64)}


def machine() -> str:
    """The machine in one line: CPU, cores, memory, Python and torch, and which checkout's gridwatch runs."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    src = Path(gridwatch.__file__).resolve().parent.parent
    rev = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "gridwatch"], capture_output=True, text=True).stdout
    return (f"machine: {cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}; gridwatch {rev or '?'}{'+changes' if dirty else ''}")


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


def _step(model: ByteGPT, opt: torch.optim.Optimizer) -> float:
    x = torch.randint(0, 256, (2, model.cfg.seq_len))
    t0 = time.perf_counter()
    model(x, x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def bench(size: int, root: Path, saves: int) -> str:
    torch.manual_seed(0)
    model = ByteGPT(SHAPES[size])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    init_optimizer_state(opt)
    live = live_tensors(model, opt)
    quiet = [_step(model, opt) for _ in range(2)]
    t0 = time.perf_counter()
    torch.save(dict(live), root / f"sync-{size}.pt")
    sync = time.perf_counter() - t0
    (root / f"sync-{size}.pt").unlink()
    quiet += [_step(model, opt) for _ in range(2)]
    cfg = TrainConfig(run_dir=str(root / f"run-{size}"), tier0_dir=str(root / f"t0-{size}"), keep=(1, 1, 1))
    ckpt = TieredCheckpointer(cfg, "node-1", lambda o: None)
    time.sleep(3)  # the checkpointer may start helpers; they are up before the first save
    stalls, writes, beside = [], [], []
    for i in range(saves):
        m = Manifest(step=i + 1, epoch=0, sampler_position=0, tier=1, world_size=1, model="bench")
        w0 = time.perf_counter()
        ckpt.snapshot(live, m, {0, 1}, tier2_owner=False)
        steps = 0
        while steps == 0 or ckpt.busy():
            # The first step after the snapshot includes any wait for its copy: that wait is the stall's, so
            # the step's time beside the write is counted without it.
            before = ckpt.stalls[-1]
            t = _step(model, opt)
            beside.append(t - (ckpt.stalls[-1] - before))
            steps += 1
        stalls.append(ckpt.stalls[-1])
        writes.append(time.perf_counter() - w0)
    ckpt.stop()
    quiet += [_step(model, opt) for _ in range(2)]
    median = statistics.median(stalls)
    q, b = statistics.median(quiet), statistics.median(beside)
    return (
        f"{param_count(model) / 1e6:.1f}M params: sync torch.save {sync * 1e3:.0f} ms | stall per save {median * 1e3:.1f} ms "
        f"(first {stalls[0] * 1e3:.1f} ms) = {100 * median / sync:.1f}% of it | tiers 0+1 written in {statistics.median(writes):.1f} s | "
        f"step {q * 1e3:.0f} ms without a write, {b * 1e3:.0f} ms beside it ({100 * (b / q - 1):+.0f}%, {len(beside)} steps) | {load()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20,200", help="model sizes in millions of parameters: 20, 200")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", default="", help="where tiers 0 and 1 and the torch.save go (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine(), flush=True)
    print(f"start: {load()}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            print(bench(size, Path(tmp), args.saves), flush=True)


if __name__ == "__main__":
    main()
