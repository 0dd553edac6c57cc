"""A relay's cost per frame once its bytes are in: what it does between libssh2's read and the write to a console.

The relay reads a node's frame as far as its owner and order (``decode_passing``), checks them in its fleet
(the same bookkeeping a console's link does), and wraps the line in a ``relayed`` envelope for the console,
unchanged. This times that path over N simulated nodes' summaries, in one process, with real endpoints,
and beside it two of its pieces: the envelope (``relayed_line``) and an endpoint's hash and name, which the
fleet uses several times a frame.
The envelope is cut once per endpoint and an endpoint's hash and name are made once (BENCHMARKS.md, issue 25,
tenth round, against the code before them).

No SSH: bench_ssh_message.py measures the transport, bench_console_scale.py the whole relay. The minimum
of the runs, CPU ns (or µs) per frame.

    .venv/bin/python benchmarks/bench_relay_frame.py [--nodes 2000] [--runs 7]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from frame_fleet import FrameFleet  # noqa: E402


def _best(stmt: str, names: dict[str, object], number: int, runs: int) -> float:
    """CPU ns per call, the best of ``runs``."""
    timer = timeit.Timer(stmt, globals=names, timer=time.process_time)
    return 1e9 * min(timer.repeat(repeat=runs, number=number)) / number


async def _relay_path(fleet_frames: FrameFleet, runs: int) -> float:
    """CPU µs per frame of the relay's own path: bookkeeping, envelope, the batch joined for its write."""
    from gridwatch.sshlink.client import Fleet, FleetOptions, LinkState
    from gridwatch.sshlink.hostlist import Endpoint
    from gridwatch.wire import protocol as p

    n = len(fleet_frames.names)
    endpoints = [Endpoint(f"10.{i // 62500}.{i // 250 % 250}.{i % 250}", 8022) for i in range(n)]
    out: list[bytes] = []

    def passing(link: object, head: p.Passing, line: bytes) -> None:  # as ConsoleSession._on_passing does
        out.append(p.relayed_line(str(link.endpoint), line))  # type: ignore[attr-defined]

    fleet = Fleet(endpoints, FleetOptions(key_path="unused", known_hosts="unused"), on_passing=passing)
    links = [fleet.links[ep] for ep in endpoints]
    for name, link in zip(fleet_frames.names, links):  # as after each node's hello
        link.pinned = link.name = name
        link.state = LinkState.CONNECTED
    best = float("inf")
    for run in range(runs + 1):
        rows = fleet_frames.summary[run % len(fleet_frames.summary)]
        for link in links:
            link.last_seq = 0
        out.clear()
        t0 = time.process_time()
        for link, line in zip(links, rows):
            fleet._on_line(link, line)  # the fleet's handler of a line read, as a link's stream calls it
        b"".join(out)
        if run:  # the first run sets every link's cadence: not measured
            best = min(best, (time.process_time() - t0) / n)
    return best * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    if args.nodes < 1 or args.runs < 1:
        print("--nodes and --runs must be at least 1", file=sys.stderr)
        return 2

    from loguru import logger

    from gridwatch.sshlink.hostlist import Endpoint
    from gridwatch.wire import protocol as p

    logger.remove()
    frames = FrameFleet.make(args.nodes, 4)
    line = frames.summary[0][0]
    print(f"{args.nodes} nodes' summaries of {len(line)} bytes; best of {args.runs} runs, CPU per frame")
    path = asyncio.run(_relay_path(frames, args.runs))
    names: dict[str, object] = {"p": p, "line": line, "ep": "10.0.1.17:8022"}
    passing = _best("p.decode_passing(line)", names, 20_000, args.runs)
    now = _best("p.relayed_line(ep, line)", names, 20_000, args.runs)
    print(f"  the relay's path (decode_passing, the fleet's checks, the envelope): {path:.2f} µs")
    print(f"    of it decode_passing: {passing:.0f} ns")
    print(f"  of it the envelope: {now:.0f} ns")
    for what in ("hash", "str"):
        print(f"  an endpoint's {what}: {_best(f'{what}(e)', {'e': Endpoint('10.0.1.17', 8022)}, 200_000, args.runs):.0f} ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
