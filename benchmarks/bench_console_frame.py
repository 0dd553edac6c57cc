"""The console's cost per frame received, in one process: decode + state store + playbook engine + goodput.

A real runtime from ``build_runtime`` (engine on, not acting) over N simulated nodes of 8 GPUs
(``SimulatedGpus``, each with a trainer status), fed frames as a link hands them over, round after
round: today's full samples (the baseline) against summaries of the same samples, measured in one run.
No SSH: what the console spends on a frame once its bytes are in (the SSH side is measured by
bench_console_scale.py). The minimum of five runs of two rounds each, in CPU µs per frame.

    .venv/bin/python benchmarks/bench_console_frame.py [--nodes 2000] [--profile]

``--profile`` adds, for summaries, where a frame's time goes by stage (decode, store, goodput,
engine, the rest of ``on_frame``, GC), timed with perf_counter_ns around each stage in one more
measured pass; the timers' own cost is in the "rest" line and makes the total a little higher.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from frame_fleet import FrameFleet  # noqa: E402
from frame_stages import print_stages, stage_profile  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4, help="distinct rounds of frames prepared per node")
    ap.add_argument("--profile", action="store_true", help="print a per-stage table for summaries")
    args = ap.parse_args()

    from loguru import logger

    from gridwatch.wire.protocol import decode_agent_frame as decode

    logger.remove()
    fleet = FrameFleet.make(args.nodes, args.rounds)
    clock, names, full, summary, fresh = fleet.clock, fleet.names, fleet.full, fleet.summary, fleet.fresh

    def per_frame(rows: list[list[bytes]]) -> float:
        runtime, links = fresh()
        best = float("inf")
        for run in range(6):
            t0 = time.process_time()
            for r in (run % len(rows), (run + 1) % len(rows)):
                clock.advance(1.0)
                for i, line in enumerate(rows[r]):
                    runtime.on_frame(links[i], decode(line))
            if run:  # the first run fills the histories: not measured
                best = min(best, (time.process_time() - t0) / (2 * len(names)))
        return best * 1e6

    print(f"{args.nodes} nodes x 8 simulated GPUs, a trainer on each; bytes per frame: "
          f"full {len(full[0][0])}, summary {len(summary[0][0])}")
    f, s = per_frame(full), per_frame(summary)
    print(f"  baseline, full samples: {f:.1f} µs CPU per frame (decode + store + engine + goodput)")
    print(f"  summaries:              {s:.1f} µs CPU per frame; ratio summary/full {s / f:.2f}")
    if args.profile:
        runtime, links = fresh()
        print_stages(stage_profile(runtime, links, summary, clock.advance, decode), s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
