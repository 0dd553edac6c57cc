"""``gridwatch tail`` (frames from many agents to stdout) and ``gridwatch keys``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gridwatch.wire.cleanlogs import clean_logs
from gridwatch.wire.exitcodes import EXIT_ERROR, EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:

    from gridwatch.console.runtime.config import ClusterConfig


def add_target_options(ap: argparse.ArgumentParser, required: bool = True) -> None:
    """The options every command that talks to agents shares."""
    group = ap.add_mutually_exclusive_group(required=required)
    group.add_argument("--nodes", metavar="SPEC", help="agents in hostlist syntax: node[01-16]:8022,10.0.0.5:8022")
    group.add_argument("--cluster", metavar="FILE", help="cluster.toml with nodes, key and known_hosts")
    ap.add_argument("--key", metavar="PATH", help="private key to log in with (viewer or operator)")
    ap.add_argument("--known-hosts", metavar="PATH", help="known_hosts file pinning the agents' host keys")


def cluster_config(args: argparse.Namespace) -> ClusterConfig | None:
    """The ``--cluster`` file, read and checked once per command (None without one); raises ConfigError."""
    from gridwatch.console.runtime.config import load_cluster

    if not getattr(args, "cluster", None):
        return None
    cached = getattr(args, "_cluster_config", None)
    if cached is None:
        cached = args._cluster_config = load_cluster(args.cluster)
    return cached


def resolve_targets(args: argparse.Namespace, relayed: bool = False) -> tuple[list, str, str]:
    """Endpoints, key and known_hosts from flags or cluster.toml; raises ValueError with a one-line reason.

    ``relayed``: the nodes a relay carries too, to be reached directly (``tail`` and ``preflight`` look
    at a few nodes); the console itself reaches those through their relay.
    """
    from gridwatch.sshlink.hostlist import HostlistError, parse_endpoints

    spec, key, known = args.nodes, args.key, args.known_hosts
    config = cluster_config(args)
    if config is not None:
        spec = ",".join(s for s in (config.node_spec, *(r.node_spec for r in config.relay if relayed)) if s)
        key = key or config.key
        known = known or config.known_hosts
    if not key:
        raise ValueError("no key: give --key PATH (or key = ... in cluster.toml)")
    if not known:
        raise ValueError("no known_hosts: give --known-hosts PATH (or known_hosts = ... in cluster.toml)")
    for path, what in ((key, "key"), (known, "known_hosts")):
        if not Path(path).is_file():
            raise ValueError(f"{what} file {path} does not exist")
    try:
        return parse_endpoints(spec), key, known
    except HostlistError as exc:
        raise ValueError(f"{args.cluster}: nodes: {exc}" if config is not None else str(exc)) from None


def register(sub: argparse._SubParsersAction) -> None:
    tail = sub.add_parser(
        "tail",
        help="stream frames from many agents to stdout (and record a trace)",
        description="Connect to agents and print their frames as they arrive: readable lines, or JSON "
        "(one frame per line, for jq) with --json. --record FILE also writes every frame to a "
        "trace that `gridwatch playbook replay` can read.",
    )
    add_target_options(tail)
    tail.add_argument("--json", action="store_true", help="print frames as JSON lines")
    tail.add_argument("--record", metavar="FILE", help="append every frame to this trace file")
    tail.add_argument("--logs", action="store_true", help="also stream raw log lines")
    tail.add_argument("--duration", type=float, metavar="S", help="stop after S seconds (default: until Ctrl-C)")
    tail.add_argument("--types", metavar="LIST", help="only these frame types, e.g. event,hello")
    tail.set_defaults(func=_tail)

    keys = sub.add_parser("keys", help="make and trust the SSH keys of a deployment", description="Make and trust keys.")
    ksub = keys.add_subparsers(dest="keys_command", metavar="ACTION")
    init = ksub.add_parser(
        "init",
        help="generate viewer and operator keys and the files listing them",
        description="Write viewer_key(.pub), operator_key(.pub), authorized_viewers, authorized_operators and an "
        "empty known_hosts into DIR, in OpenSSH formats. Each agent makes its own host key on first start; "
        "pin each one with `gridwatch keys trust`.",
    )
    init.add_argument("dir", metavar="DIR")
    init.add_argument("--force", action="store_true", help="replace existing keys")
    init.add_argument("--shared-host-key", action="store_true",
                      help="also write one agent_host_key for every node and a '*' known_hosts line trusting it. "
                      "Risky: anyone who reads that key off any one node can pose as every node")
    init.set_defaults(func=_keys_init)
    trust = ksub.add_parser(
        "trust",
        help="fetch agents' host keys, show fingerprints, add them to known_hosts",
        description="Connect to each agent in SPEC, show its host key fingerprint and, after you confirm "
        "(or with --yes), add it to the known_hosts file. A host whose pinned key changed is shown with "
        "both fingerprints, and its old key is replaced only after you confirm (or with --yes).",
    )
    trust.add_argument("spec", metavar="SPEC", help="agents in hostlist syntax, e.g. node[01-16]:8022")
    trust.add_argument("--known-hosts", required=True, metavar="PATH")
    trust.add_argument("--yes", action="store_true", help="trust without asking")
    trust.set_defaults(func=_keys_trust)
    keys.set_defaults(func=lambda a: (keys.print_help(), EXIT_ERROR)[1])

    from gridwatch.console.cli.node import register as register_node

    register_node(sub)  # node return|isolate: through the running console's control socket

    from gridwatch.console.cli.history import register as register_history

    register_history(sub)  # history NODE [--gpu N]: from the incident database

    from gridwatch.console.cli.fencing import register as register_fencing

    register_fencing(sub)  # fencing raise --past N: after etcd was rebuilt empty


def _keys_init(args: argparse.Namespace) -> int:
    from gridwatch.sshlink.keys import init_keys

    try:
        ks = init_keys(args.dir, force=args.force, shared_host_key=args.shared_host_key)
    except FileExistsError as exc:
        print(f"gridwatch keys: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:
        print(f"gridwatch keys: cannot write {args.dir}: {exc.strerror}", file=sys.stderr)
        return EXIT_ERROR
    print(f"keys written to {ks.dir}:")
    names = ["viewer_key", "operator_key", "authorized_viewers", "authorized_operators", "known_hosts"]
    if args.shared_host_key:
        names.insert(0, "agent_host_key")
    for name in names:
        print(f"  {ks.dir / name}")
    if args.shared_host_key:
        print("one host key for every node: whoever reads it off any node can pose as all of them", file=sys.stderr)
    else:
        print("each agent makes its own host key on first start; pin them with: "
              f"gridwatch keys trust NODES --known-hosts {ks.known_hosts}")
    return EXIT_OK


def _confirm(question: str, yes: bool) -> bool | None:
    """True/False from --yes or the terminal; None when there is no terminal to ask."""
    if yes:
        return True
    if not sys.stdin.isatty():
        return None
    return input(f"  {question} [y/N] ").strip().lower() in ("y", "yes")


def _keys_trust(args: argparse.Namespace) -> int:
    from gridwatch.sshlink.hostlist import HostlistError, parse_endpoints
    from gridwatch.sshlink.keys import fetch_host_key, pinned_keys, trust
    from gridwatch.wire.protocol import clean_text

    try:
        endpoints = parse_endpoints(args.spec)
    except HostlistError as exc:
        print(f"gridwatch keys trust: {clean_text(str(exc), 300)}", file=sys.stderr)
        return EXIT_ERROR

    async def fetch_all() -> list:
        return await asyncio.gather(*(fetch_host_key(ep.host, ep.port) for ep in endpoints), return_exceptions=True)

    failed = 0
    for ep, key in zip(endpoints, asyncio.run(fetch_all())):
        if isinstance(key, BaseException):
            # Whatever answered at that address wrote this text; it is not ours to show raw.
            reason = clean_text(str(key), 300) or type(key).__name__
            print(f"{ep}: cannot fetch host key: {reason}", file=sys.stderr)
            failed += 1
            continue
        fingerprint = key.get_fingerprint()
        print(f"{ep}: {key.get_algorithm()} {fingerprint}")
        try:
            pinned = pinned_keys(args.known_hosts, ep.host, ep.port)
        except OSError as exc:
            print(f"gridwatch keys trust: cannot read {args.known_hosts}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_ERROR
        if any(k.public_data == key.public_data for k in pinned):
            print("  already trusted")
            continue
        if pinned:
            old = ", ".join(k.get_fingerprint() for k in pinned)
            print(f"WARNING: {ep} HAS A DIFFERENT HOST KEY than the one pinned in {args.known_hosts}:\n"
                  f"  pinned: {old}\n  now:    {fingerprint}\n"
                  "  If this node was not reinstalled or given a new key, something may be posing as it.",
                  file=sys.stderr)
            answer = _confirm("replace the pinned key with the new one?", args.yes)
        else:
            answer = _confirm("trust this key?", args.yes)
        if answer is None:
            print("  not trusted: confirm interactively or pass --yes", file=sys.stderr)
            failed += 1
            continue
        if not answer:
            print("  not trusted")
            continue
        try:
            trust(args.known_hosts, ep.host, ep.port, key, replace=bool(pinned))
        except OSError as exc:
            print(f"gridwatch keys trust: cannot write {args.known_hosts}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_ERROR
        print(f"  trusted (replaced {len(pinned)} old key{'s' if len(pinned) != 1 else ''})" if pinned else "  trusted")
    return EXIT_FAILED if failed else EXIT_OK


def _tail(args: argparse.Namespace) -> int:
    try:
        endpoints, key, known = resolve_targets(args, relayed=True)
    except ValueError as exc:
        print(f"gridwatch tail: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        return asyncio.run(_tail_async(args, endpoints, key, known))
    except RuntimeError as exc:
        print(f"gridwatch tail: {exc}", file=sys.stderr)
        return EXIT_ERROR


async def _tail_async(args: argparse.Namespace, endpoints: list, key: str, known: str) -> int:
    from gridwatch.console.fleet.render import frame_line
    from gridwatch.sshlink.client import Fleet, FleetOptions, NodeLink
    from gridwatch.wire import protocol as p

    clean_logs()
    types = set(args.types.split(",")) if args.types else None
    record = open(args.record, "ab") if args.record else None  # noqa: SIM115 - closed below
    out = sys.stdout

    def on_frame(link: NodeLink, frame: p.Frame) -> None:
        data = p.encode(frame)
        if record is not None:
            record.write(data)
        if types and frame.__struct_config__.tag not in types:
            return
        out.write(data.decode() if args.json else frame_line(frame) + "\n")

    def on_status(link: NodeLink) -> None:
        # The error may quote what the peer said (a disconnect reason): never raw on a terminal.
        error = p.clean_text(link.last_error, 300) if link.last_error else ""
        print(f"# {link.endpoint} {link.state}{': ' + error if error else ''}", file=sys.stderr)

    fleet = Fleet(endpoints, FleetOptions(key_path=key, known_hosts=known), on_frame, on_status)
    if args.logs:
        for link in fleet.links.values():
            link.want_logs = True
    await fleet.start()
    try:
        if args.duration:
            await asyncio.sleep(args.duration)
        else:
            await asyncio.Event().wait()
    finally:
        await fleet.stop()
        out.flush()
        if record is not None:
            record.close()
    # No agent answered at all: the command could not run (2), as every command says when nothing is reachable.
    return EXIT_OK if fleet.links and any(l.hello for l in fleet.links.values()) else EXIT_ERROR
