"""Progress parsers: nanoseconds per line over the real progress corpus, and over 100,000 lines that are no progress.

The progress lines are ``tests/data/progress/progress.jsonl``; the other lines are every real line of
``tests/data/progress/quiet.jsonl`` and ``tests/data/logcorpus/*.jsonl`` that gives no progress (NCCL,
warnings, tracebacks, other trainers' logs), repeated to ``--lines``. Each figure is the best of ``--rounds``.

    .venv/bin/python benchmarks/bench_progress.py [--lines 100000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from itertools import cycle, islice
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gridwatch.agent.detectors.progress import parse_progress  # noqa: E402

DATA = ROOT / "tests" / "data"


def lines_of(*paths: Path) -> list[str]:
    return [json.loads(raw)["line"] for path in paths for raw in path.read_text(encoding="utf-8").splitlines() if raw.strip()]


def ns_per_line(lines: list[str], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter_ns()
        for line in lines:
            parse_progress(line)
        best = min(best, time.perf_counter_ns() - started)
    return best / len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=100_000, help="how many lines that are no progress")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    progress = lines_of(DATA / "progress" / "progress.jsonl")
    others = [line for line in lines_of(DATA / "progress" / "quiet.jsonl", *sorted((DATA / "logcorpus").glob("*.jsonl")))
              if parse_progress(line) is None]
    filler = list(islice(cycle(others), args.lines))
    megabyte = ["a" * 1_000_000, "iteration 1/2 | " * 62_500, "{'loss': 1.0, " * 71_428]

    print(f"progress lines     {len(progress):>7}  {ns_per_line(progress, args.rounds):>9.0f} ns/line")
    print(f"no-progress lines  {len(filler):>7}  {ns_per_line(filler, args.rounds):>9.0f} ns/line"
          f"  ({len(others)} distinct)")
    print(f"1 MB hostile lines {len(megabyte):>7}  {ns_per_line(megabyte, args.rounds):>9.0f} ns/line")


if __name__ == "__main__":
    main()
