"""Pre-flight before launch: which nodes may train, and why the others may not."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass
class Gate:
    """The outcome of pre-flight for a launch: the names to train on, and the reasons for the rest."""

    names: list[str]
    left_out: dict[str, list[str]] = field(default_factory=dict)
    ran: bool = False


class GateClosed(Exception):
    """Pre-flight failed and the launch may not go on; the message says which nodes and why."""


def add_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pre-flight (checks the nodes' agents before launch)")
    g.add_argument("--agents", metavar="SPEC", help="the nodes' agents in hostlist syntax; pre-flight runs on them first")
    g.add_argument("--cluster", metavar="FILE", help="cluster.toml naming the agents, key and known_hosts (instead of the three flags)")
    g.add_argument("--key", metavar="PATH", help="key for the agents (with --agents)")
    g.add_argument("--known-hosts", metavar="PATH", help="known_hosts for the agents (with --agents)")
    g.add_argument("--exclude-failed", action="store_true", help="launch on the nodes that passed; without it any failure stops the launch")
    g.add_argument("--gpus", type=int, metavar="N", help="GPUs each node must have")
    g.add_argument("--no-comm", action="store_true", help="skip the all-reduce check")


def run_gate(args: argparse.Namespace) -> Gate:
    """Pre-flight the agents named by ``--agents``; the node names that may train."""
    from gridwatch.console.fleet.preflight import PreflightOptions, run_preflight
    from gridwatch.console.runtime.config import load_cluster
    from gridwatch.sshlink.hostlist import HostlistError, parse_endpoints

    if getattr(args, "cluster", None):
        config = load_cluster(args.cluster)  # raises ConfigError (a ValueError): one line, exit 2
        args.agents = args.agents or config.node_spec
        args.key = args.key or config.key
        args.known_hosts = args.known_hosts or config.known_hosts
    if not args.agents:
        return Gate(names=[])
    if not args.key or not args.known_hosts:
        raise ValueError("--agents needs --key and --known-hosts")
    try:
        endpoints = parse_endpoints(args.agents)
    except HostlistError as exc:
        raise ValueError(f"--agents: {exc}") from None
    report = run_preflight(endpoints, args.key, args.known_hosts, PreflightOptions(gpus=args.gpus, comm=not args.no_comm))
    if not report.reachable:
        raise GateClosed("pre-flight could not reach any agent")
    failed = dict(report.failed)
    if failed and not args.exclude_failed:
        reasons = "; ".join(f"{n}: {', '.join(r)}" for n, r in failed.items())
        raise GateClosed(f"pre-flight failed on {len(failed)} node(s), not launching (--exclude-failed launches on the rest): {reasons}")
    if not report.passed_nodes:
        raise GateClosed("no node passed pre-flight")
    return Gate(names=list(report.passed_nodes), left_out=failed, ran=True)
