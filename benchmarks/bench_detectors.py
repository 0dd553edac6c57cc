"""Log detectors: per-kind recall and precision on the real-line corpus, and lines/s, against the detectors before it.

The corpus is ``tests/data/logcorpus/*.jsonl`` (lines from public bug reports,
vendor documentation and other projects' fixtures, each with its source; lines
marked "written by us" are left out). The baseline is the detector package as
committed in git ``HEAD`` (``--baseline REV`` for another), loaded from
``git show`` into a scratch directory and run on the same lines in the same run.
Speed is measured on a realistic mix: the corpus lines among ``--filler`` times
as many ordinary trainer progress lines, as a busy log is mostly those.

    .venv/bin/python benchmarks/bench_detectors.py [--baseline HEAD] [--filler 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CORPUS = ROOT / "tests" / "data" / "logcorpus"
OURS = "written by us"
Detect = Callable[..., Any]


@dataclass
class Figures:
    expected: Counter[str] = field(default_factory=Counter)
    hits: Counter[str] = field(default_factory=Counter)
    reported: Counter[str] = field(default_factory=Counter)
    false_alarms: int = 0
    fault_lines: int = 0
    quiet_lines: int = 0

    def recall(self, kind: str) -> float:
        return self.hits[kind] / self.expected[kind] if self.expected[kind] else 0.0

    def precision_of(self, kind: str) -> float:
        return self.hits[kind] / self.reported[kind] if self.reported[kind] else 1.0

    @property
    def recall_all(self) -> float:
        return sum(self.hits.values()) / max(1, sum(self.expected.values()))

    @property
    def precision(self) -> float:
        return sum(self.hits.values()) / max(1, sum(self.reported.values()))


def real_records() -> list[dict[str, Any]]:
    records = []
    for path in sorted(CORPUS.glob("*.jsonl")):
        for raw in path.read_text(encoding="utf-8").splitlines():
            if raw.strip():
                r = json.loads(raw)
                if not r["source"].startswith(OURS):
                    records.append(r)
    return records


def score(detect: Detect, records: list[dict[str, Any]]) -> Figures:
    fig = Figures()
    for r in records:
        want = r["kind"]
        event = detect(r["line"], "/var/log/trainer.log", 1.0)
        got = None if event is None else str(event.kind)
        if want is None:
            fig.quiet_lines += 1
        else:
            fig.fault_lines += 1
            fig.expected[want] += 1
        if got is not None:
            fig.reported[got] += 1
            fig.hits[got] += got == want
            fig.false_alarms += want is None
    return fig


def load_baseline(rev: str) -> Detect:
    """``detect`` as the package was at ``rev``, imported under another name from a scratch copy."""
    scratch = Path(tempfile.mkdtemp(prefix="gw-bench-detectors-"))
    # The detectors moved from agents/ to gridwatch/agent/: a baseline from before the move is read from there.
    listing = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "gridwatch/agent/detectors/",
                              "agents/detectors/"], check=True, capture_output=True, text=True).stdout.split()
    pkg = scratch / "baseline_detectors"
    pkg.mkdir()
    for path in listing:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True, text=True).stdout
        (pkg / Path(path).name).write_text(text.replace("gridwatch.agent.detectors", "baseline_detectors")
                                          .replace("agents.detectors", "baseline_detectors"))
    sys.path.insert(0, str(scratch))
    return importlib.import_module("baseline_detectors").detect


def lines_per_second(detect: Detect, lines: list[str], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for line in lines:
            detect(line, "/var/log/trainer.log", 1.0)
        best = min(best, time.perf_counter() - started)
    return len(lines) / best


def filler() -> list[str]:
    """Ordinary progress lines, from the corpus's own quiet lines that a trainer prints every step."""
    return [r["line"] for r in real_records() if r["kind"] is None and ("loss" in r["line"] or "NCCL INFO" in r["line"] or "%|" in r["line"])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="HEAD", help="git revision whose detectors are the baseline")
    ap.add_argument("--filler", type=int, default=20, help="ordinary lines per corpus line in the speed mix")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from gridwatch.agent.detectors import detect

    baseline = load_baseline(args.baseline)
    records = real_records()
    new, old = score(detect, records), score(baseline, records)
    print(f"corpus: {new.fault_lines} fault lines, {new.quiet_lines} quiet lines (real lines only), {len(list(CORPUS.glob('*.jsonl')))} files")
    print("| kind | lines | recall | precision | baseline recall |")
    print("|---|---|---|---|---|")
    for kind in sorted(new.expected):
        print(f"| {kind} | {new.expected[kind]} | {new.recall(kind):.1%} | {new.precision_of(kind):.1%} | {old.recall(kind):.1%} |")
    print(f"| all | {new.fault_lines} | {new.recall_all:.1%} | {new.precision:.1%} | {old.recall_all:.1%} (precision {old.precision:.1%}) |")
    print(f"false alarms on quiet lines: {new.false_alarms} (baseline {old.false_alarms})")

    base = [r["line"] for r in records]
    ordinary = filler()
    mix = [line for i, corpus_line in enumerate(base) for line in [corpus_line, *(ordinary[(i * args.filler + k) % len(ordinary)] for k in range(args.filler))]]
    speed_new = lines_per_second(detect, mix, args.rounds)
    speed_old = lines_per_second(baseline, mix, args.rounds)
    corpus_new = lines_per_second(detect, base, args.rounds)
    corpus_old = lines_per_second(baseline, base, args.rounds)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "?")
    print(f"machine: {os.cpu_count()} cores, {cpu}, Python {sys.version.split()[0]}, load {os.getloadavg()[0]:.2f}")
    print(f"speed, mix of {len(mix)} lines (1 corpus : {args.filler} ordinary): {speed_new:,.0f} lines/s, baseline {speed_old:,.0f} lines/s, ratio {speed_new / speed_old:.2f}x")
    print(f"speed, corpus lines only ({len(base)}): {corpus_new:,.0f} lines/s, baseline {corpus_old:,.0f} lines/s, ratio {corpus_new / corpus_old:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
