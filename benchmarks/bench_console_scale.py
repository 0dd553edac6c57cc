"""The console at scale: CPU per node per second, full stream vs summaries side by side, and the fleet view's redraw.

Part 1, over SSH: simulated agents (benchmarks/swarm.py, many real SSH servers
per process) on this machine's loopback, and two consoles attached to all of
them at once, each a real runtime from ``build_runtime`` (engine running, not
acting) with the Textual app headless drawing the fleet view once a second:
one takes every sample whole, the other summaries. Measured over a window that
the agents are paused at both ends of (everything published written out):
each console's CPU per node per second, memory per node, frames each node sent
to each console against the frames that console received from it, gaps, and
the time from an XID injected on a node to the console's engine holding it.

Part 2, in one process: the fleet view's redraw (tick and paint) with
``--redraw-nodes`` nodes of 8 GPUs in the state store, fed a fresh summary per
node between ticks, in the heatmap's two zooms and two sorts.

    .venv/bin/python benchmarks/bench_console_scale.py [--agents 2500] [--seconds 30] [--summary-every 1] [--redraw-nodes 12500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure import ROOT, stop_all  # noqa: E402

PER_PROCESS = 250
PROJECT_TO = 12_500
XID_CODE = 79
SIZE = (200, 60)


# ------------------------------------------------------------------------------ one console


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


async def serve_console(mode: str, spec: str, key: str, known_hosts: str, db: str, summary_every: float) -> None:
    """A runtime and its app headless; answers ``stats`` on stdin with one JSON line."""
    from loguru import logger

    from agents.protocol import Event, StreamMode
    from console.fleet.hostlist import parse_endpoints
    from console.runtime.core import RuntimeOptions, build_runtime
    from console.tui.app import GridwatchApp

    logger.remove()
    logger.add(sys.stderr, level="ERROR")
    rss0 = _rss_mb()
    runtime = build_runtime(RuntimeOptions(endpoints=parse_endpoints(spec), key_path=key, known_hosts=known_hosts,
                                           db_path=db, acting=False, summary_every=summary_every))
    fleet: Any = runtime.fleet
    if mode == "full":
        fleet.options.mode = StreamMode.FULL  # today's stream: every sample whole
    xids: list[tuple[str, float]] = []

    def on_frame(link: Any, frame: Any) -> None:
        # Called after the engine took the frame: the XID is an incident (or part of one) now.
        if isinstance(frame, Event) and frame.kind == "xid":
            xids.append((str(link.endpoint), time.time()))

    runtime.hooks.frame.append(on_frame)
    app = GridwatchApp(runtime, tick_seconds=1.0)
    ticks: list[float] = []
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        screen: Any = app.screen
        draw = screen.tick

        def timed_tick() -> None:
            t0 = time.process_time()
            draw()
            ticks.append(time.process_time() - t0)

        screen.tick = timed_tick
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
            if line != "stats":
                continue
            links = {str(lk.endpoint).rsplit(":", 1)[-1]: [lk.frames, lk.gaps, lk.bad_frames]
                     for lk in fleet.links.values()}
            connected = sum(1 for lk in fleet.links.values() if str(lk.state) == "connected")
            print(json.dumps({"cpu": time.process_time(), "rss": _rss_mb(), "rss0": rss0, "links": links,
                              "connected": connected, "xids": xids,
                              "redraw_ms": 1000 * statistics.median(ticks[-30:]) if ticks else None}), flush=True)
        await runtime.stop()


# ------------------------------------------------------------------------------ the driver


def _ask(proc: subprocess.Popen, command: str) -> str:
    proc.stdin.write(command + "\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    return proc.stdout.readline().strip()  # type: ignore[union-attr]


def start_swarm(count: int, base_port: int, keys_dir: Path) -> list[subprocess.Popen]:
    procs = []
    for start in range(0, count, PER_PROCESS):
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "swarm.py"), "--control", "--count", str(min(PER_PROCESS, count - start)),
             "--base-port", str(base_port + start), "--keys", str(keys_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    for proc in procs:
        if not proc.stdout.readline().startswith("ready"):  # type: ignore[union-attr]
            stop_all(procs)
            raise RuntimeError("a swarm process did not start")
    return procs


def pause(swarm: list[subprocess.Popen]) -> dict[str, dict[str, int]]:
    sent: dict[str, dict[str, int]] = {}
    for proc in swarm:
        answer = json.loads(_ask(proc, "pause"))
        if "error" in answer:
            raise RuntimeError(f"the agents could not write out what they published: {answer['error']}")
        sent.update(answer["sent"])
    return sent


def settled(consoles: dict[str, subprocess.Popen], timeout: float = 60) -> dict[str, dict]:
    """Each console's stats once its frame counts stop moving (nothing left in flight)."""
    last: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = {mode: json.loads(_ask(c, "stats")) for mode, c in consoles.items()}
        if last and all(now[m]["links"] == last[m]["links"] for m in now):
            return now
        last = now
        time.sleep(1.0)
    return last


def part1(args: argparse.Namespace) -> dict[str, Any]:
    from agents.keys import init_keys

    tmp = Path(tempfile.mkdtemp(prefix="gw-console-scale-"))
    keys = init_keys(tmp / "keys", shared_host_key=True)  # one key for many loopback agents: a bench, not a deployment
    spec = f"127.0.0.1:[{args.base_port}-{args.base_port + args.agents - 1}]"
    swarm = start_swarm(args.agents, args.base_port, keys.dir)
    consoles: dict[str, subprocess.Popen] = {}
    try:
        for mode in ("full", "summary"):
            consoles[mode] = subprocess.Popen(
                [sys.executable, __file__, "--serve-console", mode, "--spec", spec, "--key", str(keys.viewer_key),
                 "--known-hosts", str(keys.known_hosts), "--db", str(tmp / f"{mode}.db"),
                 "--summary-every", str(args.summary_every)],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=(tmp / f"{mode}.log").open("w"), text=True)
        for mode, c in consoles.items():
            if c.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise RuntimeError(f"the {mode} console did not start: see {tmp / (mode + '.log')}")
        deadline = time.monotonic() + 600
        while not all(json.loads(_ask(c, "stats"))["connected"] == args.agents for c in consoles.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every console reached all {args.agents} agents within 600 s")
            time.sleep(2)
        time.sleep(10)  # let the connection storm settle
        sent0 = pause(swarm)
        before = settled(consoles)
        for proc in swarm:
            _ask(proc, "resume")
        started = time.monotonic()
        injected: dict[str, float] = {}
        targets = [args.base_port + i * args.agents // args.xids for i in range(args.xids)]
        step = args.seconds / (args.xids + 1)
        for port in targets:
            time.sleep(step)
            proc = swarm[(port - args.base_port) // PER_PROCESS]
            injected[str(port)] = float(_ask(proc, f"xid {port} 3 {XID_CODE}").split()[1])
        time.sleep(max(args.seconds - step * args.xids, 0))
        cpu_end = {mode: json.loads(_ask(c, "stats"))["cpu"] for mode, c in consoles.items()}
        window = time.monotonic() - started
        sent1 = pause(swarm)
        after = settled(consoles)
    finally:
        stop_all([*consoles.values(), *swarm])
    load = os.getloadavg()
    out: dict[str, Any] = {"window_s": window, "agents": args.agents, "load": load}
    for mode in ("full", "summary"):
        a, b = before[mode], after[mode]
        missing = gaps = bad = sent_total = 0
        for port, counts in sent1.items():
            sent = counts[mode] - sent0[port][mode]
            got = b["links"][port][0] - a["links"][port][0]
            sent_total += sent
            missing += sent - got
            gaps += b["links"][port][1] - a["links"][port][1]
            bad += b["links"][port][2] - a["links"][port][2]
        detect = sorted(t - injected[port.rsplit(":", 1)[-1]] for port, t in b["xids"]
                        if port.rsplit(":", 1)[-1] in injected)
        cpu = cpu_end[mode] - a["cpu"]
        out[mode] = {
            "us_per_node_s": 1e6 * cpu / window / args.agents, "core_pct": 100 * cpu / window,
            "rss_mb": b["rss"], "mb_per_node": (b["rss"] - b["rss0"]) / args.agents,
            "sent": sent_total, "missing": missing, "gaps": gaps, "bad": bad,
            "xid_median_s": statistics.median(detect) if detect else None, "xids_seen": len(detect),
            "redraw_ms": b["redraw_ms"],
        }
    return out


# ------------------------------------------------------------------------------ part 2


def part2(nodes: int, ticks: int = 10) -> dict[str, float]:
    """Median CPU ms of the fleet view's tick and paint with ``nodes`` in the store, per way of looking."""
    from agents import protocol as p
    from console.fleet.state import ManualClock, StateStore
    from console.runtime.core import ConsoleRuntime, MemoryIncidents
    from console.tui.app import GridwatchApp
    from console.tui.widgets import GpuHeatmap

    clock = ManualClock(1_700_000_000.0)
    store = StateStore(clock)
    names = [f"rack{i // 32:03d}-node{i % 32:02d}" for i in range(nodes)]
    hello_gpus = [p.GpuInfo(index=g, uuid=p.Text(f"GPU-{g}"), name=p.Text("NVIDIA H100 80GB HBM3")) for g in range(8)]

    def summary(i: int, seq: int) -> p.Summary:
        # Written by us: readings that differ per GPU and per round, one GPU hot far down the fleet.
        gpus = [p.GpuBrief(index=g, util=(i * 7 + g * 13 + seq) % 100, temp_c=95 if (i, g) == (nodes - 7, 5) else 50 + (i + g) % 20,
                           power_w=300 + 20 * g, mem_used_mb=40_000, mem_total_mb=81_920) for g in range(8)]
        return p.Summary(node=p.Text(names[i]), seq=seq, ts=clock.now(), gpus=gpus, cpu_percent=20, every=1.0)

    for i, name in enumerate(names):
        store.set_link(name, "connected", role="viewer")
        store.apply(p.Hello(node=p.Text(name), role=p.Text("viewer"), interval=1.0, gpus=hello_gpus))
        store.apply(summary(i, 1))
    frames = [[summary(i, seq) for i in range(nodes)] for seq in (2, 3)]
    results: dict[str, float] = {}

    async def main() -> None:
        app = GridwatchApp(ConsoleRuntime(store, incidents=MemoryIncidents(clock)), tick_seconds=3600, start_runtime=False)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            screen: Any = app.screen
            for label, zoom, sort in (("gpu cells, by name", False, "name"), ("node cells, by name", True, "name"),
                                      ("gpu cells, by status", False, "status")):
                screen.query_one(GpuHeatmap).set_zoom(zoom)
                screen.sort_key = sort
                spent = []
                for k in range(ticks):
                    for f in frames[k % 2]:
                        store.apply(f)
                    clock.advance(1.0)
                    t0 = time.process_time()
                    screen.tick()
                    await pilot.pause()  # the paint
                    spent.append(time.process_time() - t0)
                results[label] = 1000 * statistics.median(spent)

    asyncio.run(main())
    return results


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=2500)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--summary-every", type=float, default=1.0)
    ap.add_argument("--xids", type=int, default=5)
    ap.add_argument("--base-port", type=int, default=26000)
    ap.add_argument("--redraw-nodes", type=int, default=PROJECT_TO)
    ap.add_argument("--skip-ssh", action="store_true", help="part 2 only")
    ap.add_argument("--serve-console", choices=("full", "summary"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--key", help=argparse.SUPPRESS)
    ap.add_argument("--known-hosts", help=argparse.SUPPRESS)
    ap.add_argument("--db", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_console:
        asyncio.run(serve_console(args.serve_console, args.spec, args.key, args.known_hosts, args.db, args.summary_every))
        return 0
    print(f"machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the start")
    ok = True
    if not args.skip_ssh:
        r = part1(args)
        print(f"{args.agents} agents x 8 simulated GPUs in {-(-args.agents // PER_PROCESS)} processes on the same cores, "
              f"two consoles at once (engine on, not acting, fleet view drawn once a second, {SIZE[0]}x{SIZE[1]}); "
              f"window {r['window_s']:.0f} s, load average {' '.join(f'{x:.1f}' for x in r['load'])}")
        for mode in ("full", "summary"):
            m = r[mode]
            print(f"  {mode:7s}: {m['us_per_node_s']:.1f} us CPU per node per second ({m['core_pct']:.1f} % of a core), "
                  f"projected {PROJECT_TO} nodes: {m['us_per_node_s'] * PROJECT_TO / 1e4:.1f} % of a core; "
                  f"RSS {m['rss_mb']:.0f} MB, {1024 * m['mb_per_node']:.0f} KB per node; "
                  f"frames sent {m['sent']}, missing {m['missing']}, gaps {m['gaps']}, bad {m['bad']}; "
                  f"XID seen {m['xids_seen']}/{args.xids}, median {m['xid_median_s'] if m['xid_median_s'] is None else round(m['xid_median_s'], 3)} s; "
                  f"redraw median {m['redraw_ms']:.1f} ms CPU")
            ok = ok and m["missing"] == 0 and m["gaps"] == 0 and m["bad"] == 0
        print(f"  summary/full CPU ratio {r['summary']['us_per_node_s'] / r['full']['us_per_node_s']:.2f}")
    for label, ms in part2(args.redraw_nodes).items():
        print(f"fleet view at {args.redraw_nodes} nodes x 8 GPUs ({label}): redraw median {ms:.1f} ms CPU")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
