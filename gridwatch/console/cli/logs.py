"""``gridwatch logs``: lines from the console's log store, by node set, time range, severity and pattern, read-only."""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from typing import TYPE_CHECKING

import msgspec

from gridwatch.wire.exitcodes import EXIT_ERROR, EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:
    from datetime import tzinfo

    from gridwatch.console.runtime.logstore import LogRow

NAME = "gridwatch logs"
DEFAULT_LIMIT = 1000

EPILOG = """\
Read from the log store the console keeps beside its incident database (--db,
else cluster.toml's db, else the console's default): the lines behind events,
the lines streamed from nodes, and the raw lines of each incident's nodes from
5 minutes before it to 5 after. It reads the file only: no console need run,
and a node that is gone is still there.

QUERY is the Logs view's one-line query (node:node[01-04] sev:error since:2h
until:30m <regex>); the flags say the same and win over it. Times are a duration
back from now (10m, 2h, 3d) or an absolute time in the console's zone (TZ):
03:10, 2026-12-01T03:10, "2026-12-01 03:10:00", with an offset too (Z, +01:00).
--grep is a case-insensitive regular expression searched in the line and its
source. Raw lines carry no severity: --severity keeps events only.

exit: 0 lines printed; 1 no line matches; 2 bad input, or no store to read.
"""


def register(sub: argparse._SubParsersAction) -> None:
    ap = sub.add_parser("logs", help="lines from the console's log store (also of nodes that are gone)",
                        description="Print the lines the console's log store holds that match, oldest first.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("query", nargs="*", metavar="QUERY", help="the Logs view's query language (see below)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--db", metavar="PATH", help="the console's incident database: the log store is beside it")
    where.add_argument("--cluster", metavar="FILE", help="cluster.toml: its db")
    # Checked here, not by argparse: a bad value is one line, not a usage screen.
    ap.add_argument("--nodes", metavar="HOSTLIST", help="only these nodes, e.g. node[01-16]")
    ap.add_argument("--since", metavar="TIME", help="from TIME: 2h (ago) or 2026-12-01T03:10")
    ap.add_argument("--until", metavar="TIME", help="up to TIME: 30m (ago) or 2026-12-01T04:00")
    ap.add_argument("--severity", metavar="SEV", help="events at least this bad: info, warning, error, critical")
    ap.add_argument("--grep", metavar="PATTERN", help="a case-insensitive regular expression")
    ap.add_argument("--limit", metavar="N", default=str(DEFAULT_LIMIT),
                    help=f"the newest N lines that match (default {DEFAULT_LIMIT})")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.set_defaults(func=_logs)


def _store_path(args: argparse.Namespace) -> str:
    from gridwatch.console.cli.ui import default_db
    from gridwatch.console.runtime.config import load_cluster
    from gridwatch.console.runtime.logstore import store_path_for

    if args.db:
        db = str(args.db)
    elif args.cluster:
        db = load_cluster(args.cluster).db or default_db()
    else:
        db = default_db()
    return str(store_path_for(db))


def _logs(args: argparse.Namespace) -> int:
    from gridwatch.console.fleet import logtime
    from gridwatch.console.fleet.logquery import QueryError, parse_log_query
    from gridwatch.console.runtime.config import ConfigError
    from gridwatch.console.runtime.logstore import LogStore, LogStoreError
    from gridwatch.sshlink.hostlist import HostlistError, expand
    from gridwatch.wire.protocol import SEVERITIES

    def fail(text: str) -> int:
        print(f"{NAME}: {text}", file=sys.stderr)
        return EXIT_ERROR

    now = time.time()
    zone = logtime.console_zone()
    try:
        query = parse_log_query(" ".join(args.query), now, zone)
    except QueryError as exc:
        return fail(f"query: {exc}")
    since, until = query.window(now)
    nodes = query.nodes
    if args.nodes is not None:
        try:
            nodes = expand(args.nodes)
        except HostlistError as exc:
            return fail(f"--nodes: {exc}")
    for flag, text in (("--since", args.since), ("--until", args.until)):
        if text is None:
            continue
        try:
            at = logtime.parse_time(text, now, zone).resolve(now)
        except logtime.TimeError as exc:
            return fail(f"{flag}: {exc}")
        since, until = (at, until) if flag == "--since" else (since, at)
    if since is not None and until is not None and until < since:
        return fail("--until is before --since: the range holds no time")
    severity = query.min_severity
    if args.severity is not None:
        if args.severity not in SEVERITIES:
            return fail(f"--severity: {args.severity!r} is not one of {', '.join(SEVERITIES)}")
        severity = args.severity
    pattern = args.grep if args.grep is not None else (query.regex or None)
    try:
        limit = int(args.limit)
    except ValueError:
        return fail(f"--limit: expected a whole number of lines above 0, got {args.limit!r}")
    if limit <= 0:
        return fail(f"--limit: expected a whole number of lines above 0, got {args.limit!r}")
    try:
        path = _store_path(args)
    except (ConfigError, ValueError) as exc:
        return fail(str(exc))
    try:
        store = LogStore(path, read_only=True)
    except LogStoreError as exc:
        return fail(f"{exc}; give the console's incident database with --db")
    try:
        rows = store.query(nodes, since, until, severity, pattern, limit)
    except LogStoreError as exc:
        return fail(f"--grep: {exc}" if args.grep is not None and "regular expression" in str(exc) else str(exc))
    if args.json:
        _print_json(rows)
    else:
        _print_text(rows, zone)
    if not rows:
        if not args.json:
            print(f"{NAME}: no line matches in {path}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


class _JsonRow(msgspec.Struct, kw_only=True):
    node: str
    ts: float
    time: str  # ISO 8601 in UTC, for people and tools that read no epoch seconds
    severity: str
    source: str
    kind: str
    line: str
    where: str


def _print_json(rows: list[LogRow]) -> None:
    from datetime import UTC

    out = sys.stdout
    for r in rows:
        stamp = datetime.fromtimestamp(r.ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        out.write(msgspec.json.encode(_JsonRow(node=r.node, ts=r.ts, time=stamp, severity=r.severity, source=r.source,
                                               kind=r.kind, line=r.line, where=r.where)).decode() + "\n")


def _print_text(rows: list[LogRow], zone: tzinfo) -> None:
    from gridwatch.wire.protocol import clean_text

    for r in rows:
        stamp = datetime.fromtimestamp(r.ts, zone).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        # Stored as received (cleaned on the wire); cleaned again here: a terminal reads it.
        print(clean_text(f"{stamp}  {r.node}  {r.severity or '-'}  {r.source}  {r.line}"))
