"""The agent's tick in one process, by stage: 8 simulated GPUs, 8 simulated HCA ports, 2 tailed logs, /metrics on.

The tick is the agent's own (``Agent.tick_async``, sources in their reader
threads as in ``gridwatch agent``); between ticks, outside the timing, each log
gets 4 lines (a trainer's second of output). Per tick: process CPU time
(all threads, not wall time: the machine may be shared), median and p90 over
``--ticks``. Then the same ticks again with every stage timed in its own thread's
CPU clock (GPU read, host, IB read and judge, log poll, detectors, the agent's
own stats, summary, encode, ring, metrics, GC), and the rest of the tick
(guards, threads, asyncio, building the Sample) as what is left over.

With ``--against DIR`` (a copy of the package tree from before a change), each
run alternates the two trees in fresh processes (DIR first) and the ratio is
taken within the run. ``--seconds`` adds the whole process (``gridwatch agent``,
CPU % of a core over that window after a 5 s warm-up, peak RSS) for each tree.

    .venv/bin/python benchmarks/bench_agent_tick.py [--ticks 2000] [--runs 3] [--against DIR] [--seconds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LINES_PER_TICK = 4  # per log: the overhead bench's writer (a line every 0.25 s) over one 1 s tick
# Stages as printed; "rest" is the tick's CPU time less every timed stage.
STAGES = ("GPU read", "GPM", "host", "IB read", "IB judge", "log poll", "detectors", "agent stats", "summary",
          "encode", "ring", "metrics", "GC", "rest")


class _Clock:
    """CPU nanoseconds per stage, each taken in the thread that ran it (reader threads included)."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = dict.fromkeys(STAGES, 0)
        self._lock = threading.Lock()

    def add(self, stage: str, ns: int) -> None:
        with self._lock:
            self.ns[stage] += ns

    def wrap(self, owner: Any, attr: str, stage: str) -> None:
        inner = getattr(owner, attr)
        clock = time.thread_time_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                self.add(stage, clock() - t)

        setattr(owner, attr, timed)


def _instrument(agent: Any, clock: _Clock) -> None:
    """Time each stage where it is called (attributes replaced on this process's objects only)."""
    from gridwatch.agent import logs as logs_module
    from gridwatch.wire import protocol as p

    clock.wrap(agent.gpus, "sample", "GPU read")
    clock.wrap(agent.gpus, "poll_events", "GPU read")
    for dev in getattr(agent.gpus, "_devices", []) or []:  # NVML: GPM read per device (simulated: inside GPU read)
        if getattr(dev, "gpm", None) is not None:
            clock.wrap(dev.gpm, "read", "GPM")
    clock.wrap(agent.host, "read", "host")
    clock.wrap(agent.infiniband.reader, "read_ports", "IB read")
    clock.wrap(agent.infiniband.judge, "judge", "IB judge")
    clock.wrap(agent.tailer, "poll", "log poll")
    clock.wrap(logs_module, "_events", "detectors")  # inside poll: subtracted from it below
    if hasattr(agent, "_own_stats"):
        clock.wrap(agent, "_own_stats", "agent stats")
    else:  # before: psutil's Process, asked each tick
        clock.wrap(agent._proc, "cpu_percent", "agent stats")
        clock.wrap(agent._proc, "memory_info", "agent stats")
    clock.wrap(p, "summarize", "summary")
    clock.wrap(p, "encode", "encode")
    clock.wrap(agent.ring, "append", "ring")
    for attr in ("update", "record_sources", "record_event"):
        clock.wrap(agent.metrics, attr, "metrics")
    started: list[int] = []

    def on_gc(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.thread_time_ns())
        elif started:
            clock.add("GC", time.thread_time_ns() - started.pop())

    gc.callbacks.append(on_gc)


def _child(ticks: int, warmup: int) -> dict[str, Any]:
    """One tree, in this process: the tick timed plain, then by stage; what it found, as JSON."""
    from gridwatch.agent.config import AgentConfig
    from gridwatch.agent.runner import build_agent

    tmp = Path(tempfile.mkdtemp(prefix="gw-tick-"))
    logs = [tmp / "train.log", tmp / "nccl.log"]
    for log in logs:
        log.touch()
    # The kernel log stays off: its lines (this machine's) would make the runs differ.
    config = AgentConfig(node_name="bench", simulate_gpus=8, log=[str(log) for log in logs], kernel_log=False,
                         metrics_listen="127.0.0.1:0")
    agent = build_agent(config)
    written = [0]

    def write() -> None:
        for log in logs:
            with log.open("a") as fh:
                for _ in range(LINES_PER_TICK):
                    n = written[0]
                    fh.write(f"step {n} loss {2.5 - n * 1e-4:.4f} tokens/s 123456\n")
                    written[0] += 1

    async def run(count: int) -> list[int]:
        cpu = time.process_time_ns
        out = []
        for _ in range(count):
            write()
            t = cpu()
            await agent.tick_async()
            out.append(cpu() - t)
        return out

    async def main() -> dict[str, Any]:
        await run(warmup)
        plain = await run(ticks)
        clock = _Clock()
        _instrument(agent, clock)
        staged = await run(ticks)
        await agent.stop_readers()
        return {"plain": plain, "staged": staged, "stages": clock.ns}

    found = asyncio.run(main())
    scrape = _scrape_cost(agent)
    agent.close_sources()
    frame = agent.ring.since(agent.ring.last_seq - 1)[0]
    sample = next((f for f in reversed(frame) if b'"type":"sample"' in f), b"")
    stages = found["stages"]
    stages["log poll"] -= stages["detectors"]
    stages["rest"] = sum(found["staged"]) - sum(v for k, v in stages.items() if k != "rest")
    return {"plain": found["plain"], "staged": found["staged"], "stages": stages, "sample_bytes": len(sample),
            "scrape_us": scrape[0], "scrape_link_families": scrape[1], "pid_rss_mb": _rss_mb()}


def _scrape_cost(agent: Any) -> tuple[float, int]:
    """CPU µs of one /metrics render (median of 20), and how many per-link NVLink families it held."""
    times = []
    for _ in range(20):
        t = time.process_time_ns()
        text = agent.metrics.render()
        times.append(time.process_time_ns() - t)
    links = sum(1 for line in text.decode().splitlines()
                if line.startswith("# TYPE DCGM_FI_PROF_NVLINK_L") and "_BYTES" in line)
    return statistics.median(times) / 1000, links


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _run_child(tree: Path, ticks: int, warmup: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # cwd is the tree itself: "python -m" and "-c" put the working directory first on sys.path.
    out = subprocess.run([sys.executable, str(HERE / "bench_agent_tick.py"), "--child", "--ticks", str(ticks),
                          "--warmup", str(warmup)], cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _whole_process(tree: Path, seconds: float) -> tuple[float, float]:
    """``gridwatch agent`` from ``tree`` as in bench_agent_overhead.py: CPU % of a core and peak RSS (MB)."""
    sys.path.insert(0, str(HERE))
    from measure import cpu_percent_over, peak_rss_mb, stop_all

    from gridwatch.sshlink.keys import init_keys

    tmp = Path(tempfile.mkdtemp(prefix="gw-tickproc-"))
    keys = init_keys(tmp / "keys", shared_host_key=True)
    logs = [tmp / "train.log", tmp / "nccl.log"]
    for log in logs:
        log.touch()
    stop = threading.Event()

    def writer() -> None:
        n = 0
        while not stop.is_set():
            for log in logs:
                with log.open("a") as fh:
                    fh.write(f"step {n} loss {2.5 - n * 1e-4:.4f} tokens/s 123456\n")
            n += 1
            time.sleep(0.25)

    threading.Thread(target=writer, daemon=True).start()
    cmd = [sys.executable, "-m", "gridwatch", "agent", "--node-name", "bench", "--listen", "127.0.0.1:0",
           "--host-key", str(keys.host_key), "--authorized-viewers", str(keys.authorized_viewers),
           "--authorized-operators", str(keys.authorized_operators), "--simulate-gpus", "8", "--interval", "1",
           "--log", str(logs[0]), "--log", str(logs[1]), "--metrics-listen", "127.0.0.1:0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tree,
                            env={**os.environ, "PYTHONPATH": str(tree)})
    try:
        time.sleep(5.0)
        cpu = cpu_percent_over(proc.pid, seconds)
        if proc.poll() is not None:
            raise RuntimeError(f"the agent exited early with {proc.returncode}")
        return cpu, peak_rss_mb(proc.pid)
    finally:
        stop.set()
        stop_all([proc])


def _us(ns: float) -> float:
    return ns / 1000


def _summary(found: dict[str, Any]) -> dict[str, float]:
    plain = sorted(found["plain"])
    return {"median": _us(statistics.median(plain)), "p90": _us(plain[int(len(plain) * 0.9)]),
            "mean": _us(statistics.fmean(plain))}


def _print_run(label: str, found: dict[str, Any], load: float) -> None:
    s = _summary(found)
    print(f"{label:10} tick CPU median {s['median']:7.1f} us  p90 {s['p90']:7.1f} us  mean {s['mean']:7.1f} us  "
          f"sample {found['sample_bytes']} B  /metrics render {found['scrape_us']:.0f} us "
          f"({found['scrape_link_families']} per-link NVLink families)  load {load:.2f}")


def _print_stages(runs: dict[str, list[dict[str, Any]]]) -> None:
    labels = list(runs)
    print(f"\n{'stage (CPU us per tick, mean of runs)':40}" + "".join(f"{lab:>12}" for lab in labels))
    for stage in STAGES:
        row = []
        for lab in labels:
            per_tick = [r["stages"][stage] / len(r["staged"]) for r in runs[lab]]
            row.append(f"{_us(statistics.fmean(per_tick)):12.1f}")
        print(f"{stage:40}" + "".join(row))
    totals = [f"{_us(statistics.fmean(sum(r['staged']) / len(r['staged']) for r in runs[lab])):12.1f}" for lab in labels]
    print(f"{'whole tick (timed pass)':40}" + "".join(totals))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ticks", type=int, default=2000, help="ticks timed per pass (default 2000)")
    ap.add_argument("--warmup", type=int, default=100, help="ticks before the timing (default 100)")
    ap.add_argument("--runs", type=int, default=3, help="runs per tree (default 3)")
    ap.add_argument("--against", type=Path, help="a package tree from before a change, run alternately with this one")
    ap.add_argument("--seconds", type=float, default=0.0, help="also the whole process over this window (0: not)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.ticks, args.warmup)))
        return 0
    trees = {"before": args.against.resolve()} if args.against else {}
    trees["this tree"] = ROOT
    print(f"machine: {os.cpu_count()} cores; {args.ticks} ticks per pass after {args.warmup} warm-up; "
          f"8 simulated GPUs, 8 simulated HCA ports, 2 logs at {LINES_PER_TICK} lines a tick, /metrics on")
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    for i in range(args.runs):
        for label, tree in trees.items():
            found = _run_child(tree, args.ticks, args.warmup)
            runs[label].append(found)
            _print_run(f"{label} {i + 1}", found, os.getloadavg()[0])
        if args.against:
            new, old = _summary(runs["this tree"][-1]), _summary(runs["before"][-1])
            print(f"run {i + 1}: this tree / before = {new['median'] / old['median']:.2f}x (median tick CPU)")
    _print_stages(runs)
    if args.seconds > 0:
        print(f"\nwhole process, {args.seconds:.0f} s after 5 s warm-up (gridwatch agent, same sources, /metrics on):")
        for i in range(args.runs):
            for label, tree in trees.items():
                cpu, rss = _whole_process(tree, args.seconds)
                print(f"{label} {i + 1}: CPU {cpu:.3f} % of a core, peak RSS {rss:.1f} MB, load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
