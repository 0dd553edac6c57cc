"""Blame accuracy: injected hangs in a real job, the node the collective records blame against the truth.

Usage: python benchmarks/bench_blame.py [--nodes 3] [--hangs 12] [--deadline 4]

One job of ``--nodes`` nodes (torch on CPU/gloo, the coordinator) trains; each
round freezes one node's worker (SIGSTOP), makes it spin in Python before its
collective, or hangs it inside one (a simulated GPU hang), rotating the kind
and the node. Every 0.5 s the bench reads every trainer's collective record
from its control socket and runs :func:`gridwatch.playbooks.blame_collectives.blame`; a
round ends at the first verdict that names someone, or after 30 s. The
baseline, measured in the same rounds, blames the first node that reported:
the node whose trainer reported the failure first (the first "generation
failed", watchdog or deadline line in the nodes' logs after the fault). Then the fault is cleared and the job must train on every node again.
Prints one JSON line per round and a summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gridwatch.playbooks.blame_collectives import blame  # noqa: E402
from gridwatch.trainer.config import TrainConfig  # noqa: E402
from gridwatch.trainer.flight import gather  # noqa: E402
from gridwatch.trainer.launch import LocalRun, start_local_run  # noqa: E402
from gridwatch.wire.control import CollectiveRecord  # noqa: E402
from gridwatch.wire.controlsock import read_status  # noqa: E402
from gridwatch.wire.simdevices import SIM_DEVICES_ENV, DeviceFault, DeviceState, FaultRecord, state_path, write_state  # noqa: E402

KINDS = ("sigstop", "spin", "stuck")
VERDICT_LIMIT_S = 30.0


def _last(run: LocalRun) -> dict:
    try:
        lines = run.metrics_path.read_text().splitlines()
        return json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}


def _wait(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.2)
    raise TimeoutError(f"gave up waiting for {what} after {timeout:.0f} s")


# What a trainer's log says when its collective failed, timed out or stalled (gridwatch.trainer.worker, gridwatch.trainer.group).
_REPORTS = ("failed (", "Watchdog caught", "no progress for", "training stopped", "is stuck in generation")


def first_reporter(run: LocalRun, nodes: list[str], after: float) -> str | None:
    """The baseline: the node whose trainer reported the failure first (its log's first such line after ``after``)."""
    day = time.strftime("%Y-%m-%d ", time.localtime(after))
    first: tuple[float, str] | None = None
    for node in nodes:
        try:
            lines = (run.run_dir / "logs" / f"{node}.log").read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if not any(r in line for r in _REPORTS):
                continue
            try:
                when = time.mktime(time.strptime(day + line[:8], "%Y-%m-%d %H:%M:%S")) + float(line[8:12])
            except ValueError:
                continue
            if when >= after and (first is None or when < first[0]):
                first = (when, node)
                break
    return first[1] if first else None


def one_round(run: LocalRun, nodes: list[str], sim: Path, kind: str, culprit: str, since: float) -> dict:
    sockets = {n: run.socket_path(n) for n in nodes}
    pid = int(asyncio.run(read_status(sockets[culprit])).pid or 0)
    # Failures before this round (earlier rounds' timeouts) are not this round's reports.
    at = time.monotonic()
    wall = time.time()
    if kind == "sigstop":
        os.kill(pid, signal.SIGSTOP)
    else:
        fault = DeviceFault.SPIN if kind == "spin" else DeviceFault.HANG
        write_state(state_path(sim, culprit), DeviceState(node=culprit, faults=[FaultRecord(fault=fault, at=wall, seq=1)]))
    verdict, took, baseline, baseline_s = None, None, None, None
    try:
        while time.monotonic() - at < VERDICT_LIMIT_S + 10:
            records = asyncio.run(gather(sockets))
            # This round's collectives: those still open at the fault or begun after it. Not those
            # scheduled after it: the collective the others wait in when one node freezes may have
            # begun just before, and dropping it hides the hang.
            fresh = {n: (CollectiveRecord(node=r.node, pid=r.pid, now=r.now, groups=r.groups,
                                          entries=[e for e in r.entries if e.ended_at is None or e.ended_at >= since])
                         if r is not None else None) for n, r in records.items()}
            if baseline is None:
                baseline = first_reporter(run, nodes, wall)
                if baseline is not None:
                    baseline_s = time.monotonic() - at
            if verdict is None:
                v = blame(fresh, min_wait_s=1.0)
                if v is not None and v.culprits:
                    verdict, took = v, time.monotonic() - at
            if verdict is not None and baseline is not None:
                break
            time.sleep(0.5)
    finally:
        if kind == "sigstop":
            os.kill(pid, signal.SIGCONT)
        else:
            write_state(state_path(sim, culprit), DeviceState(node=culprit))
    blamed = verdict.nodes if verdict is not None else []
    return {"kind": kind, "truth": culprit, "blamed": blamed,
            "right": blamed == [culprit] and took is not None and took <= VERDICT_LIMIT_S,
            "seconds": round(took, 2) if took is not None else None, "summary": verdict.summary if verdict else "",
            "baseline": baseline, "baseline_right": baseline == culprit,
            "baseline_seconds": round(baseline_s, 2) if baseline_s is not None else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--hangs", type=int, default=12)
    ap.add_argument("--deadline", type=float, default=4.0, help="the job's progress deadline = its collective timeout")
    args = ap.parse_args(argv)
    nodes = [f"node-{i + 1}" for i in range(args.nodes)]
    with tempfile.TemporaryDirectory(prefix="gw-bench-blame-") as tmp:
        sim = Path(tmp) / "sim"
        sim.mkdir(mode=0o700)
        os.environ[SIM_DEVICES_ENV] = str(sim)
        run_dir = Path(tmp) / "run"
        cfg = TrainConfig(run_dir=str(run_dir), steps=10_000_000, dim=32, layers=1, heads=2, seq_len=32, micro_batch=4,
                          micro_batches=4, corpus_bytes=1 << 18, lr=1e-2, warmup=2, tier0_every=1000,
                          tier1_every=100_000, tier2_every=100_000, tier0_dir=str(Path(tmp) / "tier0"),
                          progress_deadline_s=args.deadline)
        run = start_local_run(cfg, nodes)
        rows = []
        try:
            _wait(lambda: run.last_step() >= 3 and _last(run).get("world_size") == len(nodes), 120, "every node training")
            for i in range(args.hangs):
                kind, culprit = KINDS[i % len(KINDS)], nodes[(i // len(KINDS) + i) % len(nodes)]
                since = time.time()
                row = one_round(run, nodes, sim, kind, culprit, since)
                rows.append(row)
                print(json.dumps(row), flush=True)
                start = run.last_step()
                _wait(lambda: run.last_step() >= start + 3 and _last(run).get("world_size") == len(nodes), 180,
                      "the job training on every node again")
        finally:
            run.stop()
    right = sum(r["right"] for r in rows)
    base = sum(r["baseline_right"] for r in rows)
    times = sorted(r["seconds"] for r in rows if r["seconds"] is not None)
    summary = {"hangs": len(rows), "right": right, "baseline_right": base,
               "verdict_s_median": times[len(times) // 2] if times else None, "verdict_s_max": times[-1] if times else None,
               "kinds": {k: sum(1 for r in rows if r["kind"] == k) for k in KINDS}}
    print(json.dumps({"summary": summary}), flush=True)
    return 0 if right == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
