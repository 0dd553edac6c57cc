"""Log detectors: per-kind recall and precision on the real-line corpus, and lines/s, against the detectors before it.

The corpus is ``tests/data/logcorpus/*.jsonl`` (lines from public bug reports,
vendor documentation and other projects' fixtures, each with its source; lines
marked "written by us" are left out), read by the tests' own loader. The
baseline is the detector package as committed in git ``HEAD`` (``--baseline
REV`` for another), loaded from ``git show`` into a scratch directory and run on
the same lines in the same run. Speed is measured on a realistic mix: the
corpus lines among ``--filler`` times as many ordinary trainer progress lines,
as a busy log is mostly those; the two detectors take turns, round by round, so
a loaded machine slows both alike.

Figures come twice: over every real line, and over the lines gathered after the
detectors were first written. The corpus records no date per line, so git does:
a line is "later" when its file at ``--later-than REV`` did not hold it (by
default each file's first commit, ``git log --diff-filter=A``), i.e. every line
added since the corpus began.

    .venv/bin/python benchmarks/bench_detectors.py [--baseline HEAD] [--later-than REV] [--filler 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import shutil
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

from tests.test_log_corpus import CORPUS, Record, load_corpus  # noqa: E402  (the corpus has one reader: the tests')

Detect = Callable[..., Any]


@dataclass
class Figures:
    expected: Counter[str] = field(default_factory=Counter)
    hits: Counter[str] = field(default_factory=Counter)
    reported: Counter[str] = field(default_factory=Counter)
    quiet_hits: Counter[str] = field(default_factory=Counter)  # kind -> quiet lines it was reported on
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


def real_records() -> list[Record]:
    return [r for r in load_corpus() if r.real]


def score(detect: Detect, records: list[Record]) -> Figures:
    fig = Figures()
    for r in records:
        want = r.kind
        event = detect(r.line, "/var/log/trainer.log", 1.0)
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
            fig.quiet_hits[got] += want is None
    return fig


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def later_records(records: list[Record], rev: str | None) -> tuple[list[Record], dict[str, str]]:
    """The records whose line their file did not hold at ``rev`` (None: at the commit that added the file).

    Returns them and, per file, the revision it was compared with. A line is known by its text and kind,
    counted, so a line that appears twice and was added once counts once.
    """
    by_file: dict[str, list[Record]] = {}
    for r in records:
        by_file.setdefault(r.where.rsplit(":", 1)[0], []).append(r)
    later: list[Record] = []
    against: dict[str, str] = {}
    for name, recs in sorted(by_file.items()):
        path = (CORPUS / name).relative_to(ROOT).as_posix()
        base = rev or _git("log", "--diff-filter=A", "--format=%h", "--", path).split()[-1]
        against[name] = base
        try:
            old = _git("show", f"{base}:{path}")
        except subprocess.CalledProcessError:
            old = ""  # the file did not exist then: every line is later
        had: Counter[tuple[str, str | None]] = Counter()
        for raw in old.splitlines():
            if raw.strip():
                rec = json.loads(raw)
                had[(rec["line"], rec["kind"])] += 1
        for r in recs:
            key = (r.line, r.kind)
            if had[key]:
                had[key] -= 1
            else:
                later.append(r)
    return later, against


def print_table(title: str, new: Figures, old: Figures) -> None:
    print(f"\n{title}: {new.fault_lines} fault lines, {new.quiet_lines} quiet lines")
    print("| kind | fault lines | recall | quiet lines hit | precision | baseline recall | baseline precision |")
    print("|---|---|---|---|---|---|---|")
    kinds = sorted(set(new.expected) | set(new.reported) | set(old.expected))
    for kind in kinds:
        print(f"| {kind} | {new.expected[kind]} | {new.recall(kind):.1%} | {new.quiet_hits[kind]} | "
              f"{new.precision_of(kind):.1%} | {old.recall(kind):.1%} | {old.precision_of(kind):.1%} |")
    print(f"| all | {new.fault_lines} | {new.recall_all:.1%} | {new.false_alarms} of {new.quiet_lines} | "
          f"{new.precision:.1%} | {old.recall_all:.1%} | {old.precision:.1%} ({old.false_alarms} quiet hit) |")


def load_baseline(rev: str) -> Detect:
    """``detect`` as the package was at ``rev``, imported under another name from a scratch copy."""
    scratch = Path(tempfile.mkdtemp(prefix="gw-bench-detectors-"))
    atexit.register(shutil.rmtree, scratch, True)  # imported by then: the copy is needed only until the run ends
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


def lines_per_second(detectors: list[Detect], lines: list[str], rounds: int) -> list[float]:
    """Each detector's best lines/s over ``rounds``, taking turns each round (a load that comes and goes hits all)."""
    best = [float("inf")] * len(detectors)
    for _ in range(rounds):
        for i, detect in enumerate(detectors):
            started = time.perf_counter()
            for line in lines:
                detect(line, "/var/log/trainer.log", 1.0)
            best[i] = min(best[i], time.perf_counter() - started)
    return [len(lines) / b for b in best]


def filler() -> list[str]:
    """Ordinary progress lines, from the corpus's own quiet lines that a trainer prints every step."""
    return [r.line for r in real_records() if r.kind is None and ("loss" in r.line or "NCCL INFO" in r.line or "%|" in r.line)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="HEAD", help="git revision whose detectors are the baseline")
    ap.add_argument("--later-than", default=None, metavar="REV",
                    help="lines the corpus did not hold at REV are 'later' (default: each file's first commit)")
    ap.add_argument("--filler", type=int, default=20, help="ordinary lines per corpus line in the speed mix")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from gridwatch.agent.detectors import detect

    baseline = load_baseline(args.baseline)
    every = load_corpus()
    records = [r for r in every if r.real]
    files = len(list(CORPUS.glob("*.jsonl")))
    print(f"corpus: {len(records)} real lines in {files} files ({len(every) - len(records)} lines written by us left out); "
          f"baseline: detectors at {args.baseline}")
    print_table("all real lines", score(detect, records), score(baseline, records))
    later, against = later_records(records, args.later_than)
    print_table("lines gathered later (not in the file at " + ", ".join(f"{k} {v}" for k, v in against.items()) + ")",
                score(detect, later), score(baseline, later))

    base = [r.line for r in records]
    ordinary = filler()
    mix = [line for i, corpus_line in enumerate(base) for line in [corpus_line, *(ordinary[(i * args.filler + k) % len(ordinary)] for k in range(args.filler))]]
    speed_new, speed_old = lines_per_second([detect, baseline], mix, args.rounds)
    corpus_new, corpus_old = lines_per_second([detect, baseline], base, args.rounds)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "?")
    print(f"\nmachine: {os.cpu_count()} cores, {cpu}, Python {sys.version.split()[0]}, load {os.getloadavg()[0]:.2f}")
    print(f"speed, mix of {len(mix)} lines (1 corpus : {args.filler} ordinary): {speed_new:,.0f} lines/s, baseline {speed_old:,.0f} lines/s, ratio {speed_new / speed_old:.2f}x")
    print(f"speed, corpus lines only ({len(base)}): {corpus_new:,.0f} lines/s, baseline {corpus_old:,.0f} lines/s, ratio {corpus_new / corpus_old:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
