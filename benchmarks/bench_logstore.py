"""The console's log store at a million lines: lines/s written, the event loop's cost per line, query latency, a prune.

A real LogStore (SQLite, a trigram FTS5 index, one partition per UTC day) in a temporary
folder, fed 1,000 nodes' lines (kernel, NCCL, trainer; written by us in those tools'
formats) spread over two days, through ``add()`` from a coroutine as the runtime's frame hook
does, a hundred lines per loop turn. Written: lines over the wall time until the writer
has them all on disk. On the loop: µs of one ``add()``, and the longest the event loop was
held while the writer ran (a probe that sleeps 1 ms and measures how late it wakes), beside the
same probe first with nothing else running and beside a thread busy in C (the machine's own
share of that figure, on a shared machine). Then the
median (and worst) of five runs of each query (a node's 10-minute window; a pattern over the
whole store, its first page of 1,000), and a size prune.

    .venv/bin/python benchmarks/bench_logstore.py [--lines 1000000] [--nodes 1000]   # --lines 10000000: the 10M figures
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Written by us, in the shapes of the kernel's NVRM lines, NCCL's warnings and a trainer's progress line.
TEMPLATES = (
    ("kern", "error", "event", "NVRM: Xid (PCI:0000:{bus:02x}:00): {code}, pid={pid}, name=python, Ch 0000000{ch}"),
    ("kern", "warning", "event", "mlx5_core 0000:{bus:02x}:00.0: mlx5_port_module_event: Port module event: cable unplugged"),
    ("train", "", "line", "[rank{rank}]: step {step} loss {loss:.3f} grad_norm 0.81 tokens/s 41230"),
    ("train", "", "line", "NCCL WARN [Service thread] Accept failed Resource temporarily unavailable rank {rank}"),
    ("train", "error", "event", "[rank{rank}]:[E1201 03:12:00.159 ProcessGroupNCCL.cpp:616] Watchdog caught collective "
                                "operation timeout: WorkNCCL(SeqNum={step}, OpType=ALLREDUCE) ran for 600030 ms"),
)


def _lines(count: int, nodes: int, start: float, span: float, seed: int = 1) -> Iterator[tuple[str, float, str, str, str, str]]:
    """Made as they are fed: ten million lines held at once would need gigabytes."""
    rnd = random.Random(seed)
    for i in range(count):
        source, severity, kind, text = TEMPLATES[rnd.randrange(len(TEMPLATES))]
        line = text.format(bus=rnd.randrange(256), code=rnd.choice((13, 31, 43, 48, 79, 94)), pid=rnd.randrange(99999),
                           ch=rnd.randrange(9), rank=rnd.randrange(8 * nodes), step=i // 10, loss=rnd.random() * 3)
        yield (f"node{rnd.randrange(nodes):04d}", start + span * i / count, f"log:/var/log/{source}.log", line,
               severity, kind)


async def _probe_for(seconds: float) -> list[float]:
    lags: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - t - 0.001)
    return sorted(lags)


async def _control(seconds: float = 3.0) -> tuple[list[float], list[float]]:
    """The probe with nothing else in the process, then beside a thread busy in C with the GIL let go (as SQLite is):
    what the machine and its other users cost the loop, apart from the store."""
    idle = await _probe_for(seconds)
    stop = threading.Event()

    def burn() -> None:
        block = bytes(8 << 20)
        while not stop.is_set():
            hashlib.sha256(block).digest()  # hashlib lets the GIL go for large buffers

    thread = threading.Thread(target=burn, daemon=True)
    thread.start()
    busy = await _probe_for(seconds)
    stop.set()
    thread.join()
    return idle, busy


async def _feed(store, lines, chunk: int = 100) -> tuple[float, float, list[float]]:  # noqa: ANN001
    """Feed every line through add() from the loop, then wait off the loop for the writer; a probe measures lag."""
    lags: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    task = asyncio.create_task(probe())
    on_loop, n = 0.0, 0
    for node, ts, source, line, severity, kind in lines:
        t = time.perf_counter()
        store.add(node, ts, source, line, severity, kind)
        on_loop += time.perf_counter() - t
        n += 1
        if n % chunk == 0:
            await asyncio.sleep(0)  # frames arrive a few lines a turn (made here, on the loop too); the probe runs between
            while store.queued > 200:  # ten million lines waiting at once would need gigabytes: wait for the writer
                await asyncio.sleep(0.005)
    fed = time.perf_counter()
    await asyncio.to_thread(store.flush, 36_000)
    done.set()
    await task
    return on_loop, fed, lags


def _timed(what: str, run, repeat: int = 5) -> None:  # noqa: ANN001 - a closure over the store
    times, found = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        found = len(run())
        times.append(time.perf_counter() - t0)
    print(f"  {what:<58} {statistics.median(times) * 1e3:8.1f} ms median, {max(times) * 1e3:7.1f} ms worst, {found:>5} rows")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--nodes", type=int, default=1000)
    args = ap.parse_args()

    from loguru import logger

    from gridwatch.console.runtime.logstore import Evidence, LogStore

    logger.remove()
    start = float(int(time.time()) // 86400 * 86400 - 86400)  # yesterday's UTC midnight: two days of lines
    span = 2 * 86400.0 - 1
    print(f"preparing {args.lines:,} lines from {args.nodes:,} nodes over two days ...")
    lines = _lines(args.lines, args.nodes, start, span)
    tmp = Path(tempfile.mkdtemp(prefix="gw-logstore-"))
    store = LogStore(tmp / "logs" / "logs.db", queue_batches=1_000_000)  # the benchmark measures the disk, drops none

    idle, busy = asyncio.run(_control())
    print(f"loop lag, control: longest {idle[-1] * 1e3:.1f} ms (p99 {idle[int(len(idle) * 0.99)] * 1e3:.2f}) with nothing "
          f"else in the process, {busy[-1] * 1e3:.1f} ms (p99 {busy[int(len(busy) * 0.99)] * 1e3:.2f}) beside one thread "
          "busy in C")
    cpu0, wall0 = time.process_time(), time.perf_counter()
    on_loop, fed, lags = asyncio.run(_feed(store, lines))
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    size = store.bytes
    print(f"written: {store.counters.written:,} lines in {wall:.1f} s: {store.counters.written / wall:,.0f} lines/s "
          f"(process CPU {cpu:.1f} s; dropped {store.counters.dropped})")
    lags.sort()
    print(f"  on the event loop: {on_loop / args.lines * 1e6:.2f} µs per add() (all {args.lines:,} handed over in "
          f"{fed - wall0:.1f} s, generating them included); loop lag while writing: longest {lags[-1] * 1e3:.1f} ms, "
          f"p99 {lags[int(len(lags) * 0.99)] * 1e3:.2f} ms over {len(lags):,} probes")
    print(f"  store: {size / 1e6:,.0f} MB ({size / args.lines:.0f} bytes a line, index included)")

    mid = start + 86400.0
    print(f"queries over the {args.lines:,} lines (newest 1,000 kept, as the CLI's default):")
    _timed("everything, newest 1,000", lambda: store.query(limit=1000))
    _timed("one node, whole range", lambda: store.query(nodes=["node0042"], limit=1000))
    _timed("one node, a 10-minute window", lambda: store.query(nodes=["node0042"], since=mid, until=mid + 600))
    _timed("node[0100-0199], one hour", lambda: store.query(nodes="node[0100-0199]", since=mid, until=mid + 3600))
    _timed("one hour, severity error", lambda: store.query(since=mid, until=mid + 3600, severity="error"))
    _timed("plain text 'PCI:0000:3b:00' (trigram index)", lambda: store.query(pattern="PCI:0000:3b:00"))
    _timed("plain text 'cable unplugged', one node", lambda: store.query(nodes=["node0007"], pattern="cable unplugged"))
    _timed("plain text, rare: 'SeqNum=4242,'", lambda: store.query(pattern="SeqNum=4242,"))
    _timed("regex 'Xid .*: 79,' over one hour", lambda: store.query(pattern=r"Xid .*: 79,", since=mid, until=mid + 3600))
    _timed("regex 'Xid .*: 79,' over everything", lambda: store.query(pattern=r"Xid .*: 79,"), repeat=3)
    _timed("first page, whole store: 'cable unplugged'", lambda: store.query(pattern="cable unplugged"))
    _timed("first page, whole store: 'Accept failed' on node[0001-0010]",
           lambda: store.query(nodes="node[0001-0010]", pattern="Accept failed"))
    _timed("first page, whole store: regex 'rank\\d+\\]: step 1'", lambda: store.query(pattern=r"rank\d+\]: step 1"),
           repeat=3)
    _timed("query language 'node:node0[001-050] sev:warning unplugged'",
           lambda: store.query_text("node:node0[001-050] sev:warning unplugged", now=start + span))

    # An open incident's window: ten minutes of the node of a line in it.
    witness = next(node for node, ts, *_ in _lines(args.lines, args.nodes, start, span) if ts >= start + 900)
    keep = [Evidence(witness, start + 600, start + 1200)]
    before = len(store.query(nodes=[witness], since=start + 600, until=start + 1200))
    store.max_bytes = size // 2
    t0 = time.perf_counter()
    store.prune(keep, now=start + span)
    store.flush(3600)
    print(f"prune to half the size (the older day dropped, one node's window kept): {time.perf_counter() - t0:.1f} s, "
          f"{store.counters.pruned_size:,} lines removed, {store.bytes / 1e6:,.0f} MB left, "
          f"{len(store.query(nodes=[witness], since=start + 600, until=start + 1200))} of {before} window lines kept")
    store.close()
    shutil.rmtree(tmp)  # ten million lines are gigabytes of disk
    return 0


if __name__ == "__main__":
    sys.exit(main())
