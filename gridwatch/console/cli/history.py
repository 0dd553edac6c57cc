"""``gridwatch history NODE [--gpu N]``: a node's (or one GPU's) incidents, remediations and returns from the incident database."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

import msgspec

from gridwatch.wire.exitcodes import EXIT_ERROR, EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:
    from gridwatch.playbooks.history import TrackRecord

EPILOG = """\
Read from the incident database the console keeps (--db, else cluster.toml's db,
else the console's default). Each incident with its kind, GPU, what its
remediations did and its time to recover; the node's mean time between
incidents (MTBI) and its lemon score: its incidents of the last 30 days weighted
by severity (info 0.25, warning 1, error 2, critical 4) and halved for every
7 days of age, over the median of the nodes that had one (at least 1).

--gpu N follows GPU N of NODE by its UUID where its agent named it, so its
incidents on another node (before it was moved) are listed too.

exit: 0 printed; 1 printed, and the node is kept out of service by a history
rule or its lemon score is 3 or more; 2 no such database, or it cannot be read.
"""


def register(sub: argparse._SubParsersAction) -> None:
    ap = sub.add_parser("history", help="a node's (or a GPU's) incidents, remediations and lemon score",
                        description="Print the history of NODE (or of one of its GPUs) from the incident database.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("node", metavar="NODE", help="the node's name, as its agent calls itself")
    ap.add_argument("--gpu", type=int, metavar="N", help="only GPU N of NODE (followed by UUID across nodes)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--db", metavar="PATH", help="the incident database")
    where.add_argument("--cluster", metavar="FILE", help="cluster.toml: its db")
    ap.add_argument("--limit", type=int, default=20, metavar="N", help="incidents listed, newest first (default 20)")
    ap.add_argument("--json", action="store_true", help="one JSON object: the figures and the incidents")
    ap.set_defaults(func=_history)


def _db_path(args: argparse.Namespace) -> str:
    from gridwatch.console.cli.ui import default_db
    from gridwatch.console.runtime.config import load_cluster

    if args.db:
        return str(args.db)
    if args.cluster:
        return load_cluster(args.cluster).db or default_db()
    return default_db()


def _history(args: argparse.Namespace) -> int:
    from gridwatch.console.runtime.config import ConfigError
    from gridwatch.playbooks.history import LEMON_AT
    from gridwatch.playbooks.store import IncidentStore, StoreError

    name = "gridwatch history"
    try:
        path = _db_path(args)
    except (ConfigError, ValueError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if not os.path.isfile(path):
        print(f"{name}: no incident database at {path}; give the console's with --db", file=sys.stderr)
        return EXIT_ERROR
    try:
        store = IncidentStore(path)
    except StoreError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        record = store.node_history(args.node, gpu=args.gpu, limit=max(args.limit, 0))
        known = store.history_nodes()
    finally:
        store.close()
    if args.json:
        sys.stdout.write(msgspec.json.encode(record).decode() + "\n")
    else:
        _print(record, known)
    return EXIT_FAILED if record.kept_out or record.lemon >= LEMON_AT else EXIT_OK


def _print(record: TrackRecord, known: list[str]) -> None:
    from gridwatch.playbooks.durations import format_duration

    who = record.node + (f" gpu {record.gpu}" + (f" ({record.gpu_uuid})" if record.gpu_uuid else "")
                         if record.gpu is not None else "")
    if not record.total_incidents:
        others = f" (nodes with a history: {', '.join(known[:10])}{' …' if len(known) > 10 else ''})" if known else ""
        print(f"{who}: no incident recorded{others}")
        return
    mtbi = "N/A" if record.mtbi_s is None else format_duration(record.mtbi_s)
    print(f"{who}: {record.total_incidents} incidents, {record.remediations} remediated, {record.returns} returned "
          f"to service; MTBI {mtbi}; lemon {record.lemon:.1f} ({record.lemon_raw:.2f} over the fleet median "
          f"{record.fleet_median:.2f}, 30 days)")
    if record.kept_out:
        print(f"kept out: {record.kept_out}")
    print(f"{'WHEN':<16}  {'KIND':<10} {'GPU':>3}  {'NODE':<12} {'TTR':>6}  OUTCOME")
    for line in record.incidents:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(line.at))
        kind = line.kind + (f" {line.code}" if line.code is not None else "")
        gpu = "-" if line.gpu is None else str(line.gpu)
        ttr = "N/A" if line.ttr is None else format_duration(line.ttr)
        print(f"{when:<16}  {kind:<10} {gpu:>3}  {line.node:<12} {ttr:>6}  {line.outcome}  [{line.id}]")
    shadow = [d for d in record.decisions if d.shadow]
    for d in shadow[-5:]:
        print(f"shadow {d.what}: would have judged {d.verdict}: {d.reason}")
