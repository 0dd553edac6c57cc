"""The console at scale: CPU per node per second, full stream vs summaries side by side, and the fleet view's redraw.

Part 1, over SSH: simulated agents (benchmarks/swarm.py ``--lean``, many real
SSH servers per process) on this machine's loopback, and a console attached to
all of them, a real runtime from ``build_runtime`` (engine running, not acting)
with the Textual app headless drawing the fleet view as a console does (a tick a second, the fleet view redrawn as often as summaries come), in the
``--modes`` asked, one after the other on the same agents: ``summary`` (a link
per agent, summaries at ``--summary-every``, default ``auto``: by the number of
agents, as a console does), ``relayed`` (the same console with no direct link:
``--relays`` real ``gridwatch relay`` processes on loopback, each carrying a
contiguous share of the agents to it on one link; their CPU is measured over the
same window, per node they carry) and ``full`` (every sample whole);
``--together`` runs them at once instead. Measured over a
window that the agents are paused at both ends of (everything published
written out): the agents' ticks due against those ticked (an overloaded swarm
shows here first), each console's CPU per node per second, memory per node,
frames each node sent to it against the frames it received, gaps, summaries
per node per second, the time from an XID injected on a node to the
console's engine holding it (and from the agent's sending it), and the
incidents each window opened: any but the injected XIDs is a false alarm, and
the bench exits 1 on it, as on a frame lost.

Part 2, in one process: the fleet view's redraw (tick and paint) with
``--redraw-nodes`` nodes of 8 GPUs in the state store, fed a fresh summary per
node between ticks, in the heatmap's two zooms and two sorts.

    .venv/bin/python benchmarks/bench_console_scale.py [--agents 2500] [--seconds 30] [--summary-every auto] [--redraw-nodes 12500]
        [--modes summary,relayed] [--relays 5] [--profile]

``--cadences 4,2`` measures each mode once per cadence on the same swarm and fits the console's CPU a second
against the summaries it received a second: the slope is what a summary costs the running console (to hold
against bench_console_frame.py's in-process figure), the intercept what it spends a second whatever the frames
(the fleet view's redraws, the runtime's and Textual's timers), which a cost per summary at one cadence spreads
over the summaries.

``GRIDWATCH_BENCH_MISMATCH=1`` prints each node whose frames sent and received differ, with the counts at
both ends of the window (a node given an XID differs by one, its event).

``--profile`` samples each console and each relay over the window with py-spy (.venv/bin/py-spy; the
console samples itself, the bench samples the relays) and prints beside the figures where the time went by
stage (benchmarks/profile_stages.py): SSH read and decrypt, framing, decode, the relay envelope, store,
engine, goodput, Textual, logging, GC, with each stage's share of the µs per summary received (per frame
carried, for a relay). Sampling costs the sampled process nothing; py-spy's own CPU is on the same cores.
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

from frame_fleet import Gauge  # noqa: E402
from measure import ROOT, stop_all  # noqa: E402
from profile_stages import read_raw, table  # noqa: E402
from scale_tier import (  # noqa: E402
    OTHERS_NICE,
    PER_PROCESS,
    RELAY_ENV,
    Relay,
    ask,
    pause,
    start_relays,
    start_swarm,
    xid_targets,
)

# The consoles, in the order they are measured: direct links on summaries, the same through relays, every sample whole.
MODES = ("summary", "relayed", "full")
PROJECT_TO = 12_500
XID_CODE = 79
SIZE = (200, 60)
# The gauge: this many summaries of a fleet of its own each second, about 1 ms of the console's CPU.
GAUGE_EVERY_S = 1.0
GAUGE_FRAMES = 50


# ------------------------------------------------------------------------------ one console


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


async def serve_console(mode: str, spec: str, key: str, known_hosts: str, db: str, summary_every: str,
                        relays_json: str = "") -> None:
    """A runtime and its app headless; answers ``stats`` on stdin with one JSON line.

    ``relayed``: no direct node; ``relays_json`` maps each relay's ``host:port`` to the hostlist it carries.
    """
    from loguru import logger

    from gridwatch.console.runtime.config import cadence_line, parse_summary_every
    from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
    from gridwatch.console.tui.app import GridwatchApp
    from gridwatch.sshlink.hostlist import parse_endpoints
    from gridwatch.wire.protocol import Event, StreamMode, Summary

    logger.remove()
    logger.add(sys.stderr, level="ERROR")
    rss0 = _rss_mb()
    import gc

    gc_seconds = [0.0, 0.0, 0.0]
    gc_counts = [0, 0, 0]
    gc_started = [0.0]

    def gc_timer(phase: str, info: dict[str, int]) -> None:
        # The collector's own time, per generation: where a console's CPU per message goes.
        if phase == "start":
            gc_started[0] = time.process_time()
        else:
            gc_seconds[info["generation"]] += time.process_time() - gc_started[0]
            gc_counts[info["generation"]] += 1

    gc.callbacks.append(gc_timer)
    relays: dict[Any, list[Any]] = {}
    if mode == "relayed":
        relays = {parse_endpoints(ep)[0]: parse_endpoints(nodes) for ep, nodes in json.loads(relays_json).items()}
        endpoints = []
    else:
        endpoints = parse_endpoints(spec)
    runtime = build_runtime(RuntimeOptions(endpoints=endpoints, relays=relays, key_path=key, known_hosts=known_hosts,
                                           db_path=db, acting=False, summary_every=parse_summary_every(summary_every)))
    fleet: Any = runtime.fleet
    if mode == "full":
        fleet.options.mode = StreamMode.FULL  # today's stream: every sample whole
    cadence = (cadence_line(fleet.options.summary_every, len(fleet.links)) if mode != "full" else "every sample whole")
    xids: list[tuple[str, float, float]] = []
    summaries = [0]

    def on_frame(link: Any, frame: Any) -> None:
        # Called after the engine took the frame: the XID is an incident (or part of one) now.
        if isinstance(frame, Event) and frame.kind == "xid":
            xids.append((str(link.endpoint), time.time(), frame.ts))  # ts: when the agent sent it
        elif isinstance(frame, Summary):
            summaries[0] += 1

    runtime.hooks.frame.append(on_frame)
    # The in-process figure measured here and now (frame_fleet.Gauge): its CPU is left out of the console's.
    gauge = Gauge.make()

    async def gauging() -> None:
        while True:
            await asyncio.sleep(GAUGE_EVERY_S)
            gauge.feed(GAUGE_FRAMES)

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
        gauge_task = asyncio.ensure_future(gauging())
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        # GRIDWATCH_BENCH_PROFILE=FILE: the console's own profile over the window ("profile" at each end),
        # to see where its time per node goes; written to FILE.<mode>.
        profiler: Any = None
        while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
            if line == "profile" and os.environ.get("GRIDWATCH_BENCH_PYSPY"):
                # GRIDWATCH_BENCH_PYSPY=PY_SPY:FILE: a sampling profile instead (C frames too, nothing slowed).
                spy, _, out = os.environ["GRIDWATCH_BENCH_PYSPY"].partition(":")
                if profiler is None:
                    profiler = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "-r", "200", "--native",
                                                 "-f", "raw", "-o", f"{out}.{mode}"],
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                else:
                    profiler.send_signal(signal.SIGINT)
                    profiler.wait()
                print("ok", flush=True)
                continue
            if line == "profile":
                import cProfile

                if profiler is None:
                    profiler = cProfile.Profile()
                    profiler.enable()
                else:
                    profiler.disable()
                    profiler.dump_stats(f"{os.environ['GRIDWATCH_BENCH_PROFILE']}.{mode}")
                print("ok", flush=True)
                continue
            if line != "stats":
                continue
            links = {str(lk.endpoint).rsplit(":", 1)[-1]: [lk.frames, lk.gaps, lk.bad_frames, lk.repeated]
                     for lk in fleet.links.values()}
            # Links up, stale ones included: the bench's pause before the window silences every agent, and a
            # node whose last summary came early enough is stale by then while its link holds.
            connected = fleet.connected
            # Incidents opened since the console started, by playbook: the XIDs injected, and nothing else
            # (a node the bench's own pauses made look lost is a false alarm, and its plan is CPU in the window).
            opened: dict[str, int] = {}
            for incident in runtime.engine.incidents(include_closed=True) if runtime.engine is not None else ():
                opened[incident.playbook] = opened.get(incident.playbook, 0) + 1
            print(json.dumps({"cpu": time.process_time(), "rss": _rss_mb(), "rss0": rss0, "links": links,
                              "incidents": opened,
                              "connected": connected, "xids": xids, "gc_s": gc_seconds, "gc_n": gc_counts, "summaries": summaries[0], "cadence": cadence,
                              "every": fleet.options.summary_every,
                              # Each relay's link: its state and the lines (batches) the console read from it.
                              "relays": {str(ep): [str(r.state), r.messages, r.bad_frames, r.reads]
                                         for ep, r in getattr(fleet, "relays", {}).items()},
                              "redraw_ms": 1000 * statistics.median(ticks[-30:]) if ticks else None,
                              "redraws": len(ticks), "tick_cpu": sum(ticks),
                              "gauge_cpu": gauge.cpu_s, "gauge_frames": gauge.frames}), flush=True)
        gauge_task.cancel()
        await runtime.stop()


# ------------------------------------------------------------------------------ the driver


# How long the consoles' counts must stay still to be final, and how long the agents are silent meanwhile. At 200
# nodes auto's cadence is 1 s, and silence past three cadences is a heartbeat-lost incident; a node whose tick
# slot is late in the interval is silent for the pause plus up to a cadence, plus the relay's delay after the
# resume. 1 s reads had made the pause 2-3 s (46 false alarms in one relayed window); a span of 1.0 or 1.2 s
# still opened 1-8 there, 0.8 s none in three runs. A relayed frame can wait up to 0.85 s on its way (the relay
# reads every 0.25 s and flushes every 0.5 s, the console reads every 0.1 s): one that came later than the span
# would be counted in the window as received but not sent, so the bench would say so and exit 1, not hide it.
QUIET_S = 0.8


def settled(consoles: dict[str, subprocess.Popen], timeout: float = 120) -> dict[str, dict]:
    """Each console's stats once its frame counts have not moved for ``QUIET_S`` (nothing left in flight)."""
    last: dict[str, dict] = {}
    still_since = time.monotonic()
    deadline = still_since + timeout
    while time.monotonic() < deadline:
        now = {mode: json.loads(ask(c, "stats")) for mode, c in consoles.items()}
        if not last or any(now[m]["links"] != last[m]["links"] for m in now):
            still_since = time.monotonic()
        elif time.monotonic() - still_since >= QUIET_S:
            return now
        last = now
        time.sleep(0.2)
    return last


def measure(args: argparse.Namespace, swarm: list[subprocess.Popen], modes: tuple[str, ...], tmp: Path,
            keys: Any, spec: str, round_no: int, every: str) -> dict[str, Any]:
    """Consoles in ``modes`` at once on the running swarm, summaries ``every``: one window, the agents paused at both ends."""
    consoles: dict[str, subprocess.Popen] = {}
    relays: list[Relay] = []
    try:
        if round_no:
            # The window before left the agents paused: each console connects to agents that stream, as a
            # console does. Started on paused agents, it heard a hello and one summary of each, then nothing until
            # the window: every node silent past three cadences, a heartbeat-lost incident each, planned and
            # stored inside the window (1,000 at 1,000 nodes), and the dearer console was the one measured second.
            for proc in swarm:
                ask(proc, "resume")
        if "relayed" in modes:
            relays = start_relays(args.relays, args.agents, args.base_port, keys.dir, tmp)
        for mode in modes:
            consoles[mode] = subprocess.Popen(
                [sys.executable, __file__, "--serve-console", mode, "--spec", spec, "--key", str(keys.viewer_key),
                 "--known-hosts", str(keys.known_hosts), "--db", str(tmp / f"{mode}.db"),
                 "--summary-every", every,
                 *(["--relays-spec", json.dumps({r.address: r.nodes for r in relays})] if mode == "relayed" else [])],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=(tmp / f"{mode}.log").open("w"), text=True)
        for mode, c in consoles.items():
            if c.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise RuntimeError(f"the {mode} console did not start: see {tmp / (mode + '.log')}")
        t_connect = time.monotonic()
        # A console that cannot hold every link (it falls behind, links drop and reconnect) is measured with
        # the links it holds after --connect-wait, and says so.
        while not all(json.loads(ask(c, "stats"))["connected"] == args.agents for c in consoles.values()):
            if time.monotonic() - t_connect > args.connect_wait:
                break
            time.sleep(2)
        connect_s = time.monotonic() - t_connect
        time.sleep(10)  # let the connection storm settle
        sent0, _ = pause(swarm)
        before = settled(consoles)
        profiling = bool(os.environ.get("GRIDWATCH_BENCH_PROFILE") or os.environ.get("GRIDWATCH_BENCH_PYSPY"))
        for c in consoles.values() if profiling else ():
            ask(c, "profile")
        relay_cpu0 = [r.cpu() for r in relays]
        spies = _spy_on(relays, tmp)
        for proc in swarm:
            ask(proc, "resume")
        started = time.monotonic()
        injected: dict[str, float] = {}
        targets = xid_targets(args.agents, args.xids, round_no, args.base_port)
        step = args.seconds / (args.xids + 1)
        for port in targets:
            time.sleep(step)
            proc = swarm[(port - args.base_port) // PER_PROCESS]
            injected[str(port)] = float(ask(proc, f"xid {port} 3 {XID_CODE}").split()[1])
        time.sleep(max(args.seconds - step * args.xids, 0))
        ends = {mode: json.loads(ask(c, "stats")) for mode, c in consoles.items()}
        relay_cpu = [r.cpu() - c0 for r, c0 in zip(relays, relay_cpu0)]
        for c in consoles.values() if profiling else ():
            ask(c, "profile")
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.wait()
        window = time.monotonic() - started
        sent1, ticks = pause(swarm)
        after = settled(consoles)
        relay_rss = [r.rss_mb() for r in relays]
    finally:
        stop_all(list(consoles.values()))
        stop_all([r.proc for r in relays])
    out: dict[str, Any] = {}
    forwarded = [r.forwarded(tmp) for r in relays]
    for mode in modes:
        a, b = before[mode], after[mode]
        missing = gaps = bad = sent_total = got_total = repeated = 0
        for port, counts in sent1.items():
            stream = "summary" if mode == "relayed" else mode  # what the agents send (to the relays, relayed)
            sent = counts[stream] - sent0[port][stream]
            # A frame the console already had (a resume's overlap) is counted apart: received twice, kept once.
            again = b["links"][port][3] - a["links"][port][3]
            # An XID injected here is an event frame the agents count apart from the stream they say they sent.
            xid = sum(1 for p, *_ in b["xids"][len(a["xids"]):] if p.rsplit(":", 1)[-1] == port)
            got = b["links"][port][0] - a["links"][port][0] - again - xid
            repeated += again
            sent_total += sent
            got_total += got
            missing += sent - got
            if os.environ.get("GRIDWATCH_BENCH_MISMATCH") and sent != got:
                # Each node whose counts differ, with what they were made of (the agents' per-mode counts at
                # both ends, the console's frames, gaps and bad frames at both ends).
                print(f"mismatch {mode} {port}: sent {sent}, received {got}; agents {sent0[port]} -> {counts}; "
                      f"console {a['links'][port]} -> {b['links'][port]}", file=sys.stderr)
            gaps += b["links"][port][1] - a["links"][port][1]
            bad += b["links"][port][2] - a["links"][port][2]
        seen = [(t, ts, injected[port.rsplit(":", 1)[-1]]) for port, t, ts in b["xids"]
                if port.rsplit(":", 1)[-1] in injected]
        detect = sorted(t - at for t, _, at in seen)
        # The console's part: from the agent's sending to the engine holding it (the rest is the agent's own
        # wait for its next tick, which reads the simulated GPU's events: up to a tick, 1 s).
        transit = sorted(t - ts for t, ts, _ in seen)
        # The gauge's own CPU is not the console's.
        gauge_cpu = ends[mode]["gauge_cpu"] - a["gauge_cpu"]
        gauge_frames = ends[mode]["gauge_frames"] - a["gauge_frames"]
        cpu = ends[mode]["cpu"] - a["cpu"] - gauge_cpu
        nodes = max(min(a["connected"], b["connected"]), 1)  # the links that streamed through the window
        out[mode] = {
            "nodes": nodes, "connected": (a["connected"], b["connected"]),
            "window_s": window, "load": os.getloadavg(), "connect_s": connect_s, "cadence": b["cadence"],
            "every": b["every"], "ticks": ticks, "together": len(modes) > 1,
            "us_per_node_s": 1e6 * cpu / window / nodes, "core_pct": 100 * cpu / window,
            "rss_mb": b["rss"], "mb_per_node": (b["rss"] - b["rss0"]) / nodes,
            "sent": sent_total, "received": got_total, "repeated": repeated, "missing": missing, "gaps": gaps, "bad": bad,
            "summaries_per_node_s": (b["summaries"] - a["summaries"]) / window / nodes,
            "xid_median_s": statistics.median(detect) if detect else None, "xids_seen": len(detect),
            "xid_s": detect, "xid_transit_s": transit,
            "redraw_ms": b["redraw_ms"], "redraws": ends[mode]["redraws"] - a["redraws"],
            "tick_us_per_node_s": 1e6 * (ends[mode]["tick_cpu"] - a["tick_cpu"]) / window / nodes,
            "in_process_us": 1e6 * gauge_cpu / gauge_frames if gauge_frames else None,
            "gc_us_per_node_s": [1e6 * (b["gc_s"][g] - a["gc_s"][g]) / window / nodes for g in range(3)],
            "gc_per_s": [(b["gc_n"][g] - a["gc_n"][g]) / window for g in range(3)],
            "incidents": {pb: n - a["incidents"].get(pb, 0) for pb, n in b["incidents"].items()
                          if n > a["incidents"].get(pb, 0)},
            # With --cadences a mode's console of the round before left its store: this one took back its XIDs.
            "incidents_before": a["incidents"],
        }
        if mode == "relayed":
            # Each relay's own CPU over the same window, per node it carries: the tier's cost, beside the console's.
            out[mode]["relays"] = [
                {"address": r.address, "nodes": r.count, "us_per_node_s": 1e6 * cpu / window / r.count,
                 "core_pct": 100 * cpu / window, "rss_mb": rss, "state": b["relays"].get(r.address, ["?"])[0],
                 "lines": (b["relays"][r.address][1] - a["relays"][r.address][1]) if r.address in b["relays"] else 0,
                 "reads": (b["relays"][r.address][3] - a["relays"][r.address][3]) if r.address in b["relays"] else 0,
                 "forwarded": fw}
                for r, cpu, rss, fw in zip(relays, relay_cpu, relay_rss, forwarded)]
            out[mode]["relays_cpu_s"] = sum(relay_cpu)
            for i, rl in enumerate(out[mode]["relays"]):
                rl["stages"] = _stages(tmp / f"relay{i + 1}.pyspy")
        out[mode]["stages"] = _stages(Path(f"{os.environ.get('GRIDWATCH_BENCH_PYSPY', ':').partition(':')[2]}.{mode}"))
    return out


def _spy_on(relays: list[Relay], tmp: Path) -> list[subprocess.Popen]:
    """py-spy recording each relay over the window, with --profile."""
    spy = os.environ.get("GRIDWATCH_BENCH_PYSPY", "").partition(":")[0]
    if not spy:
        return []
    return [subprocess.Popen([spy, "record", "--pid", str(r.proc.pid), "-r", "200", "--native", "-f", "raw",
                              "-o", str(tmp / f"relay{i + 1}.pyspy")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for i, r in enumerate(relays)]


def _stages(path: Path) -> Any:
    """Samples per stage from a py-spy raw file; None without one (no --profile, or py-spy wrote nothing)."""
    return read_raw(path.read_text().splitlines()) if path.is_file() else None


def part1(args: argparse.Namespace) -> dict[str, Any]:
    """The full stream and summaries side by side in one run: in turn on the same swarm, or (``--together``) at once."""
    from gridwatch.sshlink.keys import init_keys

    tmp = Path(tempfile.mkdtemp(prefix="gw-console-scale-"))
    keys = init_keys(tmp / "keys", shared_host_key=True)  # one key for many loopback agents: a bench, not a deployment
    spec = f"127.0.0.1:[{args.base_port}-{args.base_port + args.agents - 1}]"
    # Summaries first: the mode a large fleet runs, then the same through relays, then a full stream that may not fit.
    modes = tuple(m for m in MODES if m in args.modes.split(","))
    swarm = start_swarm(args.agents, args.base_port, keys.dir, lean=not args.full_cost_swarm, logs=tmp)
    out: dict[str, Any] = {}
    try:
        cadences = args.cadences.split(",") if args.cadences else [args.summary_every]
        round_no = 0
        for every in cadences:
            # With --cadences each window's key names its cadence: "summary@2", "relayed@4".
            at = f"@{every}" if args.cadences else ""
            for group in [modes] if args.together else [(mode,) for mode in modes]:
                got = measure(args, swarm, group, tmp, keys, spec, round_no, every)
                out.update({mode + at: m for mode, m in got.items()})
                round_no += 1
    finally:
        stop_all(swarm)
    return out


# ------------------------------------------------------------------------------ part 2


def part2(nodes: int, ticks: int = 10, changed: float = 1.0) -> dict[str, float]:
    """Median CPU ms of the fleet view's tick and paint with ``nodes`` in the store, per way of looking."""
    from gridwatch.console.fleet.state import ManualClock, StateStore
    from gridwatch.console.runtime.core import ConsoleRuntime
    from gridwatch.console.runtime.incidents import StoreIncidents
    from gridwatch.console.tui.app import GridwatchApp
    from gridwatch.console.tui.widgets import GpuHeatmap
    from gridwatch.playbooks.store import IncidentStore
    from gridwatch.wire import protocol as p

    clock = ManualClock(1_700_000_000.0)
    store = StateStore(clock)
    names = [f"rack{i // 32:03d}-node{i % 32:02d}" for i in range(nodes)]
    hello_gpus = [p.GpuInfo(index=g, uuid=p.Text(f"GPU-{g}"), name=p.Text("NVIDIA H100 80GB HBM3")) for g in range(8)]

    def summary(i: int, seq: int) -> p.Summary:
        # Written by us: readings that differ per GPU and per round, one GPU hot far down the fleet.
        gpus = [p.GpuBrief(index=g, util=(i * 7 + g * 13 + seq) % 100, temp_c=95 if (i, g) == (nodes - 7, 5) else 50 + (i + g) % 20,
                           power_w=300 + 20 * g, mem_used_mb=40_000, mem_total_mb=81_920) for g in range(8)]
        # A node's summaries come ``1 / changed`` ticks apart (a fifth of the nodes a tick: every 5 s), so a
        # node not in this tick's share is on its cadence, not silent.
        return p.Summary(node=p.Text(names[i]), seq=seq, ts=clock.now(), gpus=gpus, cpu_percent=20,
                         every=max(1.0, 1.0 / changed))

    for i, name in enumerate(names):
        store.set_link(name, "connected", role="viewer")
        store.apply(p.Hello(node=p.Text(name), role=p.Text("viewer"), interval=1.0, gpus=hello_gpus))
        store.apply(summary(i, 1))
    results: dict[str, float] = {}
    seqs = iter(range(2, 1 << 30))

    async def main() -> None:
        incidents = StoreIncidents(IncidentStore(":memory:", clock))
        app = GridwatchApp(ConsoleRuntime(store, incidents=incidents), tick_seconds=3600, start_runtime=False)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            screen: Any = app.screen
            for label, zoom, sort in (("gpu cells, by name", False, "name"), ("node cells, by name", True, "name"),
                                      ("gpu cells, by status", False, "status")):
                screen.query_one(GpuHeatmap).set_zoom(zoom)
                screen.sort_key = sort
                spent = []
                for k in range(ticks):
                    # ``changed``: the share of nodes whose summary arrives between two ticks (1: all of
                    # them, the worst case; 0.2: a tick at the 5 s cadence), a different slice each tick.
                    # New readings each time (a node sent the same values twice would show nothing new), made
                    # before the clock starts.
                    step = max(int(round(nodes * changed)), 1)
                    first, seq = (k * step) % nodes, next(seqs)
                    for i in [*range(first, min(first + step, nodes)), *range(max(first + step - nodes, 0))]:
                        store.apply(summary(i, seq))
                    clock.advance(1.0)
                    t0 = time.process_time()
                    screen.tick()
                    await pilot.pause()  # the paint
                    spent.append(time.process_time() - t0)
                results[label] = 1000 * statistics.median(spent)

    asyncio.run(main())
    return results


def relays_us_per_node_s(m: dict[str, Any]) -> float:
    """A relayed window's relays together: their CPU µs per node carried per second."""
    return 1e6 * m["relays_cpu_s"] / m["window_s"] / max(sum(rl["nodes"] for rl in m["relays"]), 1)


def cost_fit(windows: list[dict[str, Any]]) -> tuple[float, float, float | None]:
    """A console's CPU a second against the summaries it received a second, over windows at different cadences.

    A least-squares line: its slope is what one more summary costs (µs), its intercept what the console spends
    a second whatever the frames (ms: the fleet view's redraws, the runtime's and Textual's timers). The first
    is the figure to hold against bench_console_frame.py's in-process cost per frame; per summary at one
    cadence the second is spread over the summaries and hides it. The relays' is the slope of their CPU against
    the frames they carried (µs per frame), or None for a window without relays.
    """
    def line(xs: list[float], ys: list[float]) -> tuple[float, float]:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")
        return slope, my - slope * mx

    rates = [w["summaries_per_node_s"] * w["nodes"] for w in windows]  # summaries a second
    slope, intercept = line(rates, [w["us_per_node_s"] * w["nodes"] for w in windows])  # µs a second
    relays = None
    if all("relays" in w for w in windows):
        carried = [sum(rl["lines"] for rl in w["relays"]) / w["window_s"] for w in windows]
        relays = line(carried, [1e6 * w["relays_cpu_s"] / w["window_s"] for w in windows])[0]
    return slope, intercept / 1e3, relays


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=2500)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--summary-every", default="auto", metavar="SECONDS|auto",
                    help="the summary console's cadence (default auto: by the number of agents)")
    ap.add_argument("--cadences", default="", metavar="S,S",
                    help="measure each mode once per cadence (seconds or auto, comma-separated) on the same swarm, and "
                         "fit CPU against summaries received: the console's cost per summary apart from its cost per "
                         "second (redraws, ticks, timers) whatever the frames")
    ap.add_argument("--connect-wait", type=float, default=300.0, metavar="S",
                    help="how long a console may take to reach every agent before it is measured with those it has")
    ap.add_argument("--modes", default="full,summary",
                    help="which consoles, comma-separated: full, summary, relayed (default full,summary)")
    ap.add_argument("--relays", type=int, default=5,
                    help="relayed: how many `gridwatch relay` processes share the agents (default 5)")
    ap.add_argument("--together", action="store_true",
                    help="both consoles at once on the same agents (default: one after the other, same swarm)")
    ap.add_argument("--full-cost-swarm", action="store_true",
                    help="agents as they are, without the swarm's --lean savings (fewer agents fit)")
    ap.add_argument("--xids", type=int, default=5)
    ap.add_argument("--base-port", type=int, default=26000)
    ap.add_argument("--others-nice", type=int, default=0, metavar="N",
                    help="the swarm's and the relays' nice value (they stand for other machines; default 0: as the console)")
    ap.add_argument("--redraw-nodes", type=int, default=PROJECT_TO)
    ap.add_argument("--redraw-changed", type=float, default=1.0, metavar="SHARE",
                    help="share of the nodes sent a fresh summary between two redraws (default 1: every node)")
    ap.add_argument("--read-every", type=float, default=None, metavar="S",
                    help="how often the consoles (and the relays) read their links together (GRIDWATCH_READ_EVERY_S; "
                         "default theirs: 0.1 s, a relay 0.25 s; 0: each socket as it becomes readable, as before)")
    ap.add_argument("--relay-read-every", type=float, default=None, metavar="S",
                    help="the same for the relays alone (default theirs, 0.25 s)")
    ap.add_argument("--profile", action="store_true",
                    help="sample the consoles and relays with py-spy over the window and print a table by stage")
    ap.add_argument("--skip-ssh", action="store_true", help="part 2 only")
    ap.add_argument("--skip-redraw", action="store_true", help="part 1 only")
    ap.add_argument("--serve-console", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--relays-spec", default="", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--key", help=argparse.SUPPRESS)
    ap.add_argument("--known-hosts", help=argparse.SUPPRESS)
    ap.add_argument("--db", help=argparse.SUPPRESS)
    args = ap.parse_args()
    OTHERS_NICE[0] = args.others_nice
    if args.serve_console:
        from gridwatch.sshlink.coalesce import console_period, read_every, run_coalesced
        from gridwatch.sshlink.hostlist import parse_endpoints

        # As `gridwatch console` runs: its links read together every 0.1 s, 0.25 s from 1,000 links held directly
        # (GRIDWATCH_READ_EVERY_S, --read-every, says otherwise).
        direct = 0 if args.relays_spec else len(parse_endpoints(args.spec))
        run_coalesced(serve_console(args.serve_console, args.spec, args.key, args.known_hosts, args.db, args.summary_every,
                                    args.relays_spec), read_every(console_period(direct)))
        return 0
    if args.read_every is not None:
        os.environ["GRIDWATCH_READ_EVERY_S"] = str(args.read_every)  # the consoles (and the relays unless told)
    if args.relay_read_every is not None:
        RELAY_ENV["GRIDWATCH_READ_EVERY_S"] = str(args.relay_read_every)
    unknown = sorted(set(args.modes.split(",")) - set(MODES))
    problem = (f"--modes takes {', '.join(MODES)} (not {', '.join(unknown)})" if unknown else
               f"--relays must be between 1 and the number of agents ({args.agents})" if not 1 <= args.relays <= args.agents
               else "--together cannot count the relayed console's frames apart from the summary console's (both are "
               "summary subscribers at the agents): run them one after the other"
               if args.together and {"summary", "relayed"} <= set(args.modes.split(",")) else "")
    if problem:
        print(problem, file=sys.stderr)
        return 2
    print(f"machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the start")
    ok = True
    if not args.skip_ssh:
        from gridwatch.console.runtime.config import parse_summary_every

        for every in [args.summary_every, *filter(None, args.cadences.split(","))]:
            parse_summary_every(every)  # a bad value fails here, not in a console started later
        if args.cadences and len(set(args.cadences.split(","))) < 2:
            print("--cadences needs two different cadences at least (seconds or auto, comma-separated)", file=sys.stderr)
            return 2
        if args.profile:
            spy = Path(sys.executable).parent / "py-spy"
            if not spy.is_file():
                print(f"--profile needs py-spy beside the interpreter ({spy})", file=sys.stderr)
                return 2
            os.environ["GRIDWATCH_BENCH_PYSPY"] = f"{spy}:{tempfile.mkdtemp(prefix='gw-profile-')}/console"
        r = part1(args)
        how = "at once" if args.together else "one after the other"
        print(f"{args.agents} agents x 8 simulated GPUs in {-(-args.agents // PER_PROCESS)} swarm processes"
              f"{'' if args.full_cost_swarm else ' (--lean)'} on the same cores"
              f"{f' (swarm and relays at nice {args.others_nice})' if args.others_nice else ''}, "
              f"consoles {how} (engine on, not "
              f"acting, fleet view redrawn as often as summaries come and for news, {SIZE[0]}x{SIZE[1]})")
        for mode, m in r.items():
            t = m["ticks"]
            print(f"  {mode:7s}: {m['cadence']}; window {m['window_s']:.0f} s, load average "
                  f"{' '.join(f'{x:.1f}' for x in m['load'])}; "
                  + (f"all {args.agents} connected in {m['connect_s']:.0f} s" if m["connected"][0] == args.agents else
                     f"ONLY {m['connected'][0]} of {args.agents} connected after {m['connect_s']:.0f} s "
                     f"({m['connected'][1]} at the end): figures per node are per node connected"))
            if t.get("due"):
                print(f"           agents' ticks due {t['due']}, ticked {t['ticked']} ({100 * t['ticked'] / t['due']:.1f} %), "
                      f"agents short of a tick {t['agents_short']}")
            print(f"           {m['us_per_node_s']:.1f} us CPU per node per second ({m['core_pct']:.1f} % of a core), "
                  f"projected {PROJECT_TO:,} nodes: {m['us_per_node_s'] * PROJECT_TO / 1e4:.1f} % of a core; "
                  f"RSS {m['rss_mb']:.0f} MB, {1024 * m['mb_per_node']:.0f} KB per node")
            again = f" (and {m['repeated']} had already, dropped)" if m.get("repeated") else ""
            print(f"           frames sent {m['sent']}, received {m['received']}{again}, missing {m['missing']}, gaps {m['gaps']}, "
                  f"bad {m['bad']}; summaries per node per second {m['summaries_per_node_s']:.3f}; "
                  f"XID seen {m['xids_seen']}/{args.xids}, median "
                  f"{'-' if m['xid_median_s'] is None else round(m['xid_median_s'], 3)} s "
                  f"({', '.join(f'{t:.2f}' for t in m.get('xid_s', ()))}; from the agent's send "
                  f"{'-' if not m.get('xid_transit_s') else round(statistics.median(m['xid_transit_s']), 3)} s); "
                  f"redraw median {m['redraw_ms'] or 0:.1f} ms CPU, {m['redraws']} redraws in the window (the "
                  f"fleet view's tick; news redraws at once)")
            others = {pb: n for pb, n in m["incidents"].items() if pb != "xid-hardware"}
            print("           incidents opened in the window: "
                  + (", ".join(f"{pb} {n}" for pb, n in sorted(m["incidents"].items())) or "none")
                  + (f" (false alarms: {', '.join(f'{pb} {n}' for pb, n in sorted(others.items()))})" if others else
                     ", nothing but the XIDs")
                  + (f"; before it: {', '.join(f'{pb} {n}' for pb, n in sorted(m['incidents_before'].items()))}"
                     if m["incidents_before"] else ""))
            print("           of it the garbage collector: " + ", ".join(
                f"gen {g} {m['gc_per_s'][g]:.1f}/s {m['gc_us_per_node_s'][g]:.1f} us" for g in range(3)))
            if m["summaries_per_node_s"]:
                # The fleet view's ticks (building its lines; Textual's paint of them is not in it) are the view's
                # cost whatever the frames: apart, what the console spends on the frames themselves shows.
                per = m["us_per_node_s"] / m["summaries_per_node_s"]
                aside = (m["us_per_node_s"] - m["tick_us_per_node_s"]) / m["summaries_per_node_s"]
                print(f"           {per:.1f} us CPU per summary received; {aside:.1f} with the fleet view's ticks "
                      f"aside ({m['tick_us_per_node_s']:.1f} us per node per second)")
                if m["in_process_us"]:
                    gauge = m["in_process_us"]
                    print(f"           in-process figure in the same window (a summary's decode, store, engine and "
                          f"goodput, in this process): {gauge:.1f} us; per summary {per / gauge:.2f}x it, "
                          f"{aside / gauge:.2f}x with the ticks aside")
            if m.get("stages") is not None and m["summaries_per_node_s"]:
                print("           by stage (py-spy samples):")
                print("\n".join("       " + row for row in table(m["stages"], per, "us/summary")))
            for rl in m.get("relays", ()):
                print(f"           relay {rl['address']} ({rl['state']}): {rl['nodes']} nodes, {rl['us_per_node_s']:.1f} us "
                      f"CPU per node carried per second ({rl['core_pct']:.1f} % of a core), RSS {rl['rss_mb']:.0f} MB; "
                      f"{rl['lines']} lines to the console in {rl['reads']} reads"
                      + ("" if rl["forwarded"] is None else f"; over its life {rl['forwarded'][0]} frames forwarded "
                         f"in {rl['forwarded'][1]} writes ({rl['forwarded'][0] / max(rl['forwarded'][1], 1):.1f} a write; "
                         "a link's change of state is a write of its own, the bench's pauses make two per node)"))
                if rl.get("stages") is not None and rl["lines"]:
                    per = 1e6 * rl["core_pct"] / 100 * m["window_s"] / rl["lines"]
                    print(f"             {per:.1f} us CPU per frame carried; by stage (py-spy samples):")
                    print("\n".join("         " + row for row in table(rl["stages"], per, "us/frame")))
            if "relays" in m:
                print(f"           relays together: {relays_us_per_node_s(m):.1f} us CPU per node "
                      f"per second ({100 * m['relays_cpu_s'] / m['window_s']:.1f} % of a core); console + relays "
                      f"{m['us_per_node_s'] + relays_us_per_node_s(m):.1f} us")
            ok = (ok and m["missing"] == 0 and m["gaps"] == 0 and m["bad"] == 0 and m["connected"][0] == args.agents
                  and not others and not set(m["incidents_before"]) - {"xid-hardware"})
        cadences = args.cadences.split(",") if args.cadences else [""]
        for at in (f"@{c}" if c else "" for c in cadences):
            if "full" + at in r and "summary" + at in r:
                print(f"  summary/full CPU ratio{at} {r['summary' + at]['us_per_node_s'] / r['full' + at]['us_per_node_s']:.2f}")
            if "relayed" + at in r and "summary" + at in r:
                rel, direct = r["relayed" + at], r["summary" + at]
                with_relays = rel["us_per_node_s"] + relays_us_per_node_s(rel)
                print(f"  relayed/direct console CPU ratio{at} {rel['us_per_node_s'] / direct['us_per_node_s']:.2f} "
                      f"({rel['us_per_node_s']:.1f} / {direct['us_per_node_s']:.1f} us per node per second); "
                      f"console + relays against direct {with_relays / direct['us_per_node_s']:.2f}")
        if args.cadences:
            for mode in (m for m in MODES if m in args.modes.split(",")):
                windows = [r[f"{mode}@{c}"] for c in cadences]
                per, fixed, relayed = cost_fit(windows)
                gauges = [w["in_process_us"] for w in windows if w["in_process_us"]]
                against = f" ({per / statistics.fmean(gauges):.2f}x the in-process figure of those windows)" if gauges else ""
                # Below zero, the cost a summary grows with the rate (more summaries, dearer each): no line holds.
                rest = (f"{fixed:.1f} ms CPU a second whatever the frames (redraws, ticks, timers)" if fixed >= 0 else
                        f"and no cost a second apart from them ({fixed:.1f} ms: each summary dearer at the faster cadence)")
                print(f"  {mode}, fitted over the cadences {args.cadences}: {per:.1f} us CPU per summary received{against}, {rest}"
                      + (f"; the relays {relayed:.1f} us per frame carried" if relayed is not None else ""))
    for label, ms in ({} if args.skip_redraw else part2(args.redraw_nodes, changed=args.redraw_changed)).items():
        print(f"fleet view at {args.redraw_nodes} nodes x 8 GPUs, {args.redraw_changed:.0%} of them changed a tick "
              f"({label}): redraw median {ms:.1f} ms CPU")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
