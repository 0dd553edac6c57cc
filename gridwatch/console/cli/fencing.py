"""``gridwatch fencing raise --past N``: after etcd was rebuilt empty, lift its revision past the agents' newest
fencing token, so the next leader's token is newer than any an agent remembers (nothing on the nodes changes)."""

from __future__ import annotations

import argparse
import sys

from gridwatch.wire.exitcodes import EXIT_ERROR, EXIT_FAILED, EXIT_OK

EPILOG = """\
When etcd is rebuilt empty its revisions start again from 1, and every agent refuses the new
leader's requests: "refused: fencing token 2 is older than 28". Run this once, with the largest
number such a refusal names; the consoles then take the lead with a newer token by themselves.

example:
  gridwatch fencing raise --past 28 --cluster /etc/gridwatch/cluster.toml
"""


def register(sub: argparse._SubParsersAction) -> None:
    ap = sub.add_parser("fencing", help="lift etcd's revision past the agents' fencing tokens (after a rebuild)",
                        description="Fencing tokens are etcd revisions: after etcd is rebuilt empty, raise its "
                                    "revision past the newest token the agents hold.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = ap.add_subparsers(dest="verb", metavar="VERB")
    lift = verbs.add_parser("raise", help="write to etcd until its revision passes N",
                            epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    lift.add_argument("--past", type=int, required=True, metavar="N", help="the newest token an agent named")
    lift.add_argument("--cluster", required=True, metavar="FILE", help="cluster.toml: its etcd, cluster and credentials")
    lift.set_defaults(func=_raise)
    ap.set_defaults(func=lambda a: (ap.print_help(), EXIT_ERROR)[1])


def _raise(args: argparse.Namespace) -> int:
    from gridwatch.console.runtime.config import ConfigError, load_cluster
    from gridwatch.console.runtime.leader import EtcdClient, EtcdError, raise_revision
    from gridwatch.console.runtime.wiring import etcd_access

    name = "gridwatch fencing raise"
    if args.past < 1 or args.past > 1 << 40:
        print(f"{name}: --past: expected a fencing token (a positive number), got {args.past}", file=sys.stderr)
        return EXIT_ERROR
    try:
        config = load_cluster(args.cluster)
        access = etcd_access(config)
    except (ConfigError, ValueError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if not config.etcd_urls:
        print(f"{name}: {args.cluster}: no etcd is configured; without etcd no console sends a fencing token",
              file=sys.stderr)
        return EXIT_ERROR
    cluster = config.cluster or ""
    client = EtcdClient(config.etcd_urls, access=access)
    try:
        before, after = raise_revision(client, cluster or "default", args.past,
                                       progress=lambda r: print(f"etcd revision {r:,}", file=sys.stderr))
    except EtcdError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if before > args.past:
        print(f"etcd's revision is {before:,}, past {args.past:,} already: nothing to do (a newer console leads)")
    else:
        print(f"etcd's revision raised from {before:,} to {after:,}: the next leader's token is newer than {args.past:,}")
    return EXIT_OK
