"""Goodput in a chaos soak: a headless demo with a random fault about every minute, against a baseline soak.

Runs ``gridwatch demo --headless --chaos --json`` for ``--minutes`` (default 10),
then, unless ``--no-baseline``, the same soak (same seed, so the same fault
choices; after it, or beside it with ``--parallel``) as the baseline:
``--baseline watch-only`` (default): incidents are made but no step that acts
is sent, so the job lives with each fault as a cluster without gridwatch does
(the simulated faults hurt the trainer: a lost GPU hangs its collective until
the collective timeout, the trainer's ``--progress-deadline``);
``--baseline torchrun`` acts alike but the trainer re-forms through
torchrun's rendezvous, restarting every worker, as gridwatch's trainer did
before its membership coordinator. Prints each run's incidents and a table of
goodput (productive training time over wall time, from the demo's summary)
with the ratio, the trust counts (nodes isolated without evidence about them,
isolated nodes back in the job before their return: both must be 0), then where each run's time went as the console saw it
(``goodput_breakdown`` of the summary: productive time and each named loss,
which add up to the breakdown's wall time; the check is printed, and a run
whose uses miss its wall time by more than 1 % fails); ``--out`` keeps both
summaries as JSON.

    .venv/bin/python benchmarks/bench_soak.py --minutes 10 --out /tmp/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY_TRAINER = ["--dim=32", "--heads=2", "--layers=1", "--micro-batches=1", "--tiers=5,10,30"]


def soak(minutes: float, every: float, seed: int, nodes: int, mode: str, keep: Path | None,
         trainer: list[str]) -> dict:
    directory = keep or Path(tempfile.mkdtemp(prefix="gridwatch-soak-"))
    argv = [sys.executable, "-m", "gridwatch", "demo", "--headless", "--json", "--chaos",
            "--duration", f"{minutes * 60:g}", "--fault-every", f"{every:g}", "--seed", str(seed),
            "--nodes", str(nodes), "--gpus", "2", "--interval", "0.5", "--dir", str(directory),
            *(f"--train-arg={a}" for a in trainer)]
    if mode == "watch-only":
        argv.append("--watch-only")
    elif mode == "torchrun":
        argv.append("--train-arg=--membership=torchrun")
    started = time.time()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=minutes * 60 + 300)
    (directory / "soak-output.txt").write_text(proc.stdout + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the soak failed (exit {proc.returncode}); output in {directory / 'soak-output.txt'}")
    summary = json.loads(lines[-1])
    summary["mode"] = mode
    summary["dir"] = str(directory)
    summary["measured_wall_s"] = round(time.time() - started, 1)
    return summary


def show(summary: dict) -> None:
    print(f"## {summary['mode']}: {summary['faults']} faults, {len(summary['incidents'])} incidents, "
          f"goodput {fmt_pct(summary['goodput'])} (at the typical pace {fmt_pct(summary.get('paced_goodput'))}), "
          f"last step {summary['steps']}, steps lost {summary['steps_lost']}")
    for row in summary["incidents"]:
        print(f"  {row['node']} {row['playbook']:<20} fault={row['fault'] or '-':<14} "
              f"detected={fmt_s(row['detected_s'])} recovered={fmt_s(row['recovered_s'])} "
              f"steps lost={row.get('steps_lost', '-')} GPU-h lost={row.get('gpu_hours_lost') or 0:.4f} "
              f"actions={','.join(row['actions']) or '-'}")
    for note in summary.get("notes", []):
        print(f"  note: {note}")


# The uses of time in the order of gridwatch.console.fleet.goodput.TimeUse (read from the JSON, so no import).
USES = ("productive", "detection", "reform", "recompute", "checkpoint", "restore", "waiting", "startup",
        "slow_steps", "other")


def breakdown_rows(runs: list[dict]) -> list[str]:
    """Markdown rows: each run's seconds per use (and share), and how far their sum is from the wall time."""
    rows = ["| run | wall | " + " | ".join(USES) + " | sum / wall |", "|---|---|" + "---|" * (len(USES) + 1)]
    for run in runs:
        gb = run.get("goodput_breakdown")
        if not gb:
            rows.append(f"| {run['mode']} | - |" + " - |" * (len(USES) + 1))
            continue
        wall = gb["wall_s"] or 1.0
        cells = [f"{gb['seconds'].get(u, 0.0):.0f} s ({gb['seconds'].get(u, 0.0) / wall * 100:.1f} %)" for u in USES]
        total = sum(gb["seconds"].values())
        rows.append(f"| {run['mode']} | {gb['wall_s']:.0f} s | " + " | ".join(cells) + f" | {total / wall * 100:.2f} % |")
    return rows


def breakdown_adds_up(run: dict) -> bool:
    gb = run.get("goodput_breakdown")
    return not gb or abs(sum(gb["seconds"].values()) - gb["wall_s"]) <= 0.01 * gb["wall_s"]


def fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f} %"


def fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--fault-every", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--baseline", choices=("torchrun", "watch-only"), default="watch-only",
                        help="the soak to compare with (default: watch-only, incidents made but no step that acts "
                             "sent; torchrun: acting, with torchrun re-forming the job)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the baseline soak")
    parser.add_argument("--parallel", action="store_true", help="run the two soaks at the same time")
    parser.add_argument("--tiny", action="store_true",
                        help=f"the tiny trainer of the loop tests ({' '.join(TINY_TRAINER)}) instead of the demo's own")
    parser.add_argument("--keep", metavar="DIR", help="keep each soak's demo directory under DIR")
    parser.add_argument("--out", metavar="PATH", help="write both summaries as JSON here")
    args = parser.parse_args()
    keep = Path(args.keep) if args.keep else None
    trainer = TINY_TRAINER if args.tiny else []
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"{args.nodes} nodes x 2 simulated GPUs, trainer {' '.join(trainer) or 'as gridwatch demo runs it'}")
    modes = ("acting", args.baseline) if not args.no_baseline else ("acting",)

    def one(mode: str) -> dict:
        return soak(args.minutes, args.fault_every, args.seed, args.nodes, mode, keep / mode if keep else None, trainer)

    if args.parallel:
        # Both soaks share the machine at once: each sees the same load, and it takes half the time.
        with ThreadPoolExecutor(len(modes)) as pool:
            runs = list(pool.map(one, modes))
    else:
        runs = [one(m) for m in modes]
    for run in runs:
        show(run)
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))
    print("\n| run | wall | faults | incidents | goodput | trainer's metrics, slow steps productive | "
          "at the typical pace | steps | steps lost |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        print(f"| {run['mode']} | {run['wall_s']:.0f} s | {run['faults']} | {len(run['incidents'])} | "
              f"{fmt_pct(run['goodput'])} | {fmt_pct(run.get('metrics_goodput'))} | {fmt_pct(run.get('paced_goodput'))} | "
              f"{run['steps']} | {run['steps_lost']} |")
    if len(runs) == 2 and runs[0]["goodput"] and runs[1]["goodput"]:
        print(f"\nratio acting / {runs[1]['mode']} goodput: {runs[0]['goodput'] / runs[1]['goodput']:.2f}")
    print("\nwhere the time went, as the console saw the trainers (seconds and share of the breakdown's wall time):\n")
    print("\n".join(breakdown_rows(runs)))
    for run in runs:
        print(f"{run['mode']}: MTTD {fmt_s(run.get('mttd_s'))}, MTTR {fmt_s(run.get('mttr_s'))}, "
              f"MTBF {fmt_s(run.get('mtbf_s'))}")
    print("\ntrust (target 0 and 0): nodes isolated without evidence about them, isolated nodes in the job again "
          "before their return")
    for run in runs:
        trust = run.get("trust") or {}
        for i in trust.get("isolations", []):
            print(f"  {run['mode']}: isolated {i['node']} at {i['at']:.0f} s by {i['who']} on "
                  f"{i['evidence'] or 'NO EVIDENCE'}; returned {fmt_s(i['returned_at'])}; "
                  f"rejoined {fmt_s(i['rejoined_at'])}; {i.get('checks', 0)} reads of the members while out")
        print(f"| {run['mode']} | {len(trust.get('isolations', []))} isolations | "
              f"{trust.get('isolated_without_evidence', '-')} without evidence | "
              f"{trust.get('rejoined_before_return', '-')} rejoined before return |")
    bad = [run["mode"] for run in runs if not breakdown_adds_up(run)]
    if bad:
        print(f"the goodput breakdown of {', '.join(bad)} does not add up to its wall time within 1 %")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
