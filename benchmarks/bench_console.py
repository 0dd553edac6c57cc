"""Console cost at 1,250 nodes x 8 GPUs: one redraw tick, and the process CPU at 1 Hz, against a DataTable baseline.

Run: ``.venv/bin/python benchmarks/bench_console.py [--seconds 20]``; prints a
Markdown table (also written to benchmarks/results/console.md with --write).
Times are CPU time of this process (``time.process_time``), so another busy
process on the machine inflates them less than wall time would.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gridwatch.console.fleet.state import ManualClock, StateStore  # noqa: E402
from gridwatch.wire.protocol import (  # noqa: E402
    GpuInfo,
    GpuSample,
    Hello,
    HostSample,
    NicSample,
    Sample,
    StackFingerprint,
    Text,
    decode_agent_frame,
    encode,
)

NODES = 1250
GPUS = 8
SIZE = (200, 60)


def hello_line(i: int) -> bytes:
    name = f"node{i:04d}"
    return encode(Hello(node=Text(name), role=Text("operator"), stack=StackFingerprint(hash=Text("s1")),
                        gpus=[GpuInfo(index=g, uuid=Text(f"GPU-{i}-{g}"), name=Text("NVIDIA H100")) for g in range(GPUS)]))


def sample_line(i: int, seq: int) -> bytes:
    """A ~1.5 KB sample like an 8-GPU node sends every second."""
    gpus = [GpuSample(index=g, util=float((i * 7 + g * 13 + seq) % 100), mem_util=40.0, mem_used_mb=40_000.0 + g,
                      mem_total_mb=81_920.0, temp_c=50.0 + (i + g + seq) % 35, power_w=300.0 + g * 10, energy_j=1e9,
                      sm_clock_mhz=1980.0, mem_clock_mhz=2619.0, ecc_sbe=0, ecc_dbe=0, procs=1) for g in range(GPUS)]
    host = HostSample(cpu_percent=35.0, mem_used_mb=2e5, mem_total_mb=1e6, load1=12.0,
                      nics=[NicSample(name=Text(f"ib{n}"), rx_bps=1e9 + seq, tx_bps=1e9) for n in range(4)])
    return encode(Sample(node=Text(f"node{i:04d}"), seq=seq, ts=1.7e9 + seq, gpus=gpus, host=host))


def feed(store: StateStore, lines: list[bytes]) -> None:
    for line in lines:
        store.apply(decode_agent_frame(line))


def make_store(clock: ManualClock) -> tuple[StateStore, list[list[bytes]]]:
    store = StateStore(clock)
    feed(store, [hello_line(i) for i in range(NODES)])
    rounds = [[sample_line(i, seq) for i in range(NODES)] for seq in range(4)]
    feed(store, rounds[0])
    return store, rounds


def cpu_ms(fn) -> float:  # noqa: ANN001
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1000


async def bench_console_tick(ticks: int) -> dict[str, float]:
    """Fan-in of one round of 1,250 frames, and one redraw tick of the fleet view (render included)."""
    from gridwatch.console.runtime.core import ConsoleRuntime
    from gridwatch.console.tui.app import GridwatchApp

    clock = ManualClock(1_700_000_000.0)
    store, rounds = make_store(clock)
    app = GridwatchApp(ConsoleRuntime(store), tick_seconds=3600, start_runtime=False)
    fan_in, tick = [], []
    async with app.run_test(size=SIZE) as pilot:
        while not getattr(app.screen, "ready", False):
            await pilot.pause(0.01)
        for n in range(ticks):
            clock.advance(1.0)
            fan_in.append(cpu_ms(lambda: feed(store, rounds[n % len(rounds)])))
            start = time.process_time()
            app.tick()
            await pilot.pause()  # let the compositor draw what the tick invalidated
            tick.append((time.process_time() - start) * 1000)
    return {"fan_in_ms": statistics.median(fan_in), "tick_ms": statistics.median(tick),
            "tick_p95_ms": sorted(tick)[int(len(tick) * 0.95) - 1]}


async def bench_datatable_baseline(ticks: int) -> dict[str, float]:
    """The naive way: a DataTable of 10,000 GPU rows, one update_cell per changed value."""
    from textual.app import App, ComposeResult
    from textual.widgets import DataTable

    class Baseline(App[None]):
        def compose(self) -> ComposeResult:
            yield DataTable(id="t")

    app = Baseline()
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(DataTable)
        cols = table.add_columns("gpu", "util", "temp")
        for i in range(NODES * GPUS):
            table.add_row(f"node{i // GPUS:04d}/{i % GPUS}", "0", "0", key=str(i))
        await pilot.pause()
        times = []
        for n in range(ticks):
            start = time.process_time()
            for i in range(NODES * GPUS):
                table.update_cell(str(i), cols[1], str((i + n) % 100))
            await pilot.pause()
            times.append((time.process_time() - start) * 1000)
    return {"tick_ms": statistics.median(times)}


async def bench_cpu_at_1hz(seconds: float) -> dict[str, float]:
    """The whole console process for ``seconds``: 1,250 frames a second decoded and applied, the UI ticking at 1 Hz."""
    from gridwatch.console.runtime.core import ConsoleRuntime
    from gridwatch.console.tui.app import GridwatchApp

    store, rounds = make_store(ManualClock(1_700_000_000.0))
    store.clock = type("Wall", (), {"now": staticmethod(time.time)})()
    app = GridwatchApp(ConsoleRuntime(store), tick_seconds=1.0, start_runtime=False)
    async with app.run_test(size=SIZE) as pilot:
        while not getattr(app.screen, "ready", False):
            await pilot.pause(0.01)
        loop = asyncio.get_running_loop()
        start_cpu, start = time.process_time(), loop.time()
        n = 0
        while loop.time() - start < seconds:
            # Frames trickle in spread over the second, as they do from 1,250 agents.
            chunk = rounds[n % len(rounds)]
            for k in range(0, len(chunk), 125):
                feed(store, chunk[k:k + 125])
                await asyncio.sleep(0.1)
            n += 1
        cpu = time.process_time() - start_cpu
        wall = loop.time() - start
    return {"cpu_percent": 100 * cpu / wall, "seconds": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/console.md")
    args = ap.parse_args()
    ours = asyncio.run(bench_console_tick(args.ticks))
    base = asyncio.run(bench_datatable_baseline(max(args.ticks // 3, 2)))
    cpu = asyncio.run(bench_cpu_at_1hz(args.seconds))
    rows = [
        ("fan-in: decode + apply one round of 1,250 sample frames", f"{ours['fan_in_ms']:.1f} ms", "-"),
        ("redraw tick, fleet view, 1,250 nodes x 8 GPUs (median)", f"{ours['tick_ms']:.1f} ms", "< 100 ms"),
        ("redraw tick, p95", f"{ours['tick_p95_ms']:.1f} ms", "< 100 ms"),
        ("baseline: DataTable of 10,000 rows, update_cell per value (median)", f"{base['tick_ms']:.1f} ms", "-"),
        (f"console process CPU at 1 Hz ({cpu['seconds']:.0f} s, 1,250 frames/s, no SSH)",
         f"{cpu['cpu_percent']:.1f} % of one core", "< 50 %"),
    ]
    out = ["| measure | result | target |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)]
    text = "\n".join(out)
    print(text)
    if args.write:
        head = (f"# Console benchmark\n\n`.venv/bin/python benchmarks/bench_console.py --write` on "
                f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
                f"{time.strftime('%Y-%m-%d')}. CPU time of the console process.\n\n")
        (ROOT / "benchmarks" / "results" / "console.md").write_text(head + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
