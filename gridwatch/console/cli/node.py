"""``gridwatch node return|isolate``: an operator's node action, sent to the running console through its control socket."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import sys

from gridwatch.wire.exitcodes import EXIT_ERROR, EXIT_FAILED, EXIT_OK

EPILOG = """\
The console that watches the node does the work, exactly as from its node view:
the action is audited (who, why, argv), refused when that console is read-only,
and a return to service resumes the node in Slurm (or uncordons it) only when
the drain there is gridwatch's; a drain still waiting for the controller is
stopped first. Isolating takes the node out of gridwatch's fleet and asks its
trainer to leave the job; it does not drain it in the scheduler.

Which console: --socket PATH, else the socket beside the incident database
(--db, else cluster.toml's db, else the console's default). The console serves
it as its own user: run this as that user or root, e.g.
  sudo -u gridwatch gridwatch node return node-17 --reason "GPU replaced, RMA 4411" \\
      --socket /var/lib/gridwatch-console/incidents.sock

exit: 0 done; 1 refused, failed, or no console running; 2 bad input (unknown node, no reason).
"""

_VERBS = {
    "return": ("put a node back in service (and resume gridwatch's drain in the scheduler)",
               "Put NODE back in service through the running console: the agent lifts its isolation and the "
               "scheduler resumes the node when the drain there is gridwatch's."),
    "isolate": ("take a node out of service (its trainer leaves the job)",
                "Isolate NODE through the running console: the agent marks it isolated and its trainer leaves the "
                "job. The scheduler is not told (a playbook's drain_node does that)."),
}


def register(sub: argparse._SubParsersAction) -> None:
    node = sub.add_parser("node", help="return a node to service or isolate it, through the running console",
                          description="Act on one node through the headless console (the service) that watches it.",
                          epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = node.add_subparsers(dest="node_verb", metavar="ACTION")
    for verb, (short, long) in _VERBS.items():
        ap = verbs.add_parser(verb, help=short, description=long, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("node", metavar="NODE", help="the node's name, as its agent calls itself")
        ap.add_argument("--reason", required=True, metavar="TEXT", help="why, for the audit log (and the scheduler)")
        ap.add_argument("--operator", metavar="NAME", help="who you are in the audit log (default: $SUDO_USER, "
                        "else your login)")
        where = ap.add_mutually_exclusive_group()
        where.add_argument("--socket", metavar="PATH", help="the console's control socket")
        where.add_argument("--cluster", metavar="FILE", help="cluster.toml: the socket is beside its db")
        where.add_argument("--db", metavar="PATH", help="the console's incident database: the socket is beside it")
        ap.add_argument("--timeout", type=float, default=120.0, metavar="S",
                        help="how long to wait for the console's answer (default 120)")
        if verb == "return":
            ap.add_argument("--force", action="store_true",
                            help="return it even though a history rule keeps it out (too many remediations); audited")
        ap.set_defaults(func=_node, verb=verb)
    node.set_defaults(func=lambda a: (node.print_help(), EXIT_ERROR)[1])


def control_socket(args: argparse.Namespace) -> str:
    """The socket of the console this command means; raises ValueError (a bad cluster.toml) in one line."""
    from gridwatch.console.cli.ui import default_db
    from gridwatch.console.runtime.config import load_cluster
    from gridwatch.console.runtime.control import socket_for

    if args.socket:
        return str(args.socket)
    if args.db:
        return socket_for(args.db)
    if args.cluster:
        config = load_cluster(args.cluster)
        return socket_for(config.db or default_db())
    return socket_for(default_db())


def _node(args: argparse.Namespace) -> int:
    from gridwatch.console.runtime.control import ControlError, NodeRequest, NodeVerb, Outcome, send

    name = f"gridwatch node {args.verb}"
    if not args.reason.strip():
        print(f"{name}: --reason must say why (it goes to the audit log and the scheduler)", file=sys.stderr)
        return EXIT_ERROR
    try:
        path = control_socket(args)
    except ValueError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    operator = args.operator or os.environ.get("SUDO_USER") or getpass.getuser()
    request = NodeRequest(verb=NodeVerb(args.verb), node=args.node, reason=args.reason, operator=operator,
                          force=bool(getattr(args, "force", False)))
    try:
        reply = asyncio.run(send(path, request, timeout=args.timeout))
    except ControlError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if reply.outcome is Outcome.DONE:
        print(f"{args.node}: {reply.message}")
        return EXIT_OK
    failed = "failed: " if reply.outcome is Outcome.FAILED else ""
    print(f"{name}: {failed}{reply.message}", file=sys.stderr)
    return EXIT_ERROR if reply.outcome is Outcome.BAD_REQUEST else EXIT_FAILED
