"""``gridwatch relay``: carry a rack's agents to consoles, many nodes' frames to a write (console/fleet/relay.py)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import TYPE_CHECKING

from gridwatch.wire.exitcodes import EXIT_ERROR, EXIT_OK

if TYPE_CHECKING:
    from gridwatch.sshlink.hostlist import Endpoint


def register(sub: argparse._SubParsersAction) -> None:
    ap = sub.add_parser(
        "relay",
        help="hold the links to a few hundred agents and serve their frames to consoles, one link each",
        description="Run a relay (one per few hundred nodes, e.g. on a rack's head node): consoles connect "
        "to it by SSH as to an agent and ask it to carry nodes from its --nodes list; it links to those "
        "agents with its own key and sends their frames to each console in batches, so a console pays "
        "one message per batch instead of one per node. Keys come from --keys DIR: operator_key (the "
        "relay's key, which the agents authorize), known_hosts (the agents' host keys), authorized_viewers "
        "and authorized_operators (the consoles), and its host key: relay_host_key, else the fleet's "
        "agent_host_key, else a relay_host_key made on first start (pin it with gridwatch keys trust). "
        "Settings come from --config (TOML, keys as the flag names) and are overridden by flags.",
    )
    ap.add_argument("--config", metavar="FILE", help="relay.toml with the settings below (listen, nodes, name, keys)")
    ap.add_argument("--listen", metavar="HOST:PORT", help="SSH listen address (default 0.0.0.0:8023; port 0 picks one)")
    ap.add_argument("--nodes", metavar="HOSTLIST", help="the agents it may carry, e.g. node[017-512]:8022; others are refused")
    ap.add_argument("--name", help="the name consoles show for it (default: the short hostname)")
    ap.add_argument("--keys", metavar="DIR", help="the key directory (default /etc/gridwatch), laid out as gridwatch keys init makes it")
    ap.add_argument("--log-level", default="INFO", help="log level (default INFO)")
    ap.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from loguru import logger

    from gridwatch.relay.service import ConfigError, RelayError, load_settings
    from gridwatch.sshlink.coalesce import RELAY_READ_EVERY_S, read_every, run_coalesced
    from gridwatch.sshlink.lean import ssh_client
    from gridwatch.wire.cleanlogs import clean_logs

    try:
        settings, nodes = load_settings(args.config, {"listen": args.listen, "nodes": args.nodes,
                                                      "name": args.name, "keys": args.keys})
        every = read_every(RELAY_READ_EVERY_S)  # how often the rack's links are read together (sshlink.coalesce)
        ssh_client()  # who reads them (sshlink.lean): a wrong GRIDWATCH_SSH_CLIENT is said here
    except (ConfigError, ValueError) as exc:
        print(f"gridwatch relay: {exc}", file=sys.stderr)
        return EXIT_ERROR
    logger.remove()
    logger.add(sys.stderr, level=args.log_level.upper(), format="{time:YYYY-MM-DD HH:mm:ss} {level} [{extra[node]}] {message}")
    logger.configure(extra={"node": settings.name})
    clean_logs()
    try:
        # The rack's links read together every 0.1 s (gridwatch.sshlink.coalesce): nearly half less per message.
        run_coalesced(_serve(settings.name, nodes, settings.keys, settings.listen), every)
    except RelayError as exc:
        print(f"gridwatch relay: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:
        print(f"gridwatch relay: cannot listen on {settings.listen}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


async def _serve(name: str, nodes: list[Endpoint], keys_dir: str, listen: str) -> None:
    from loguru import logger

    from gridwatch.relay.service import Relay, RelayKeys

    relay = Relay(name=name, nodes=nodes, keys=RelayKeys.from_dir(keys_dir))
    host, _sep, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    bound = await relay.start(host, int(port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"gridwatch relay {name}: listening on {host}:{bound}, carrying up to {len(nodes):,} "
          f"node{'' if len(nodes) == 1 else 's'} (host key {relay.keys.host_key})", flush=True)
    await stop.wait()
    c = relay.counts
    logger.info("stopping: {} console session(s), {} frames forwarded in {} writes, {} requests forwarded, "
                "{} viewer actions refused", c.sessions, c.frames, c.writes, c.requests, c.refused_actions)
    await relay.close()
