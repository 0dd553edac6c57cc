"""``gridwatch agent``: the headless daemon that runs on every node."""

from __future__ import annotations

import argparse
import asyncio
import sys

from gridwatch.wire.exitcodes import EXIT_ERROR, EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    ap = sub.add_parser(
        "agent",
        help="run the node agent (GPUs, host, logs, trainer) and serve it over SSH",
        description="Run the node agent: sample GPUs (NVML or simulated), the host and logs every "
        "interval and serve the stream to consoles over SSH (subsystem 'gridwatch'). "
        "Settings come from --config (TOML, an [agent] table) and are overridden by flags.",
    )
    ap.add_argument("--config", metavar="FILE", help="TOML file with the settings below (keys as the flag names, '_' or '-')")
    ap.add_argument("--node-name", help="the name consoles show (default: the hostname)")
    ap.add_argument("--listen", metavar="HOST:PORT", help="SSH listen address (default 0.0.0.0:8022; port 0 picks one)")
    ap.add_argument("--host-key", metavar="PATH", help="the agent's SSH host key (default /etc/gridwatch/agent_host_key); made on first start (ed25519, 0600) if missing: pin it with gridwatch keys trust")
    ap.add_argument("--authorized-viewers", metavar="PATH", help="public keys allowed to stream and search")
    ap.add_argument("--authorized-operators", metavar="PATH", help="public keys also allowed to act")
    ap.add_argument("--metrics-listen", metavar="HOST:PORT", help="serve Prometheus /metrics here (dcgm-exporter names)")
    ap.add_argument("--interval", type=float, help="seconds between samples (default 1)")
    ap.add_argument("--log", action="append", metavar="PATH",
                    help="an application log to tail (repeatable): reports NCCL, CUDA and trainer faults only")
    ap.add_argument("--kernel-logs", action="append", metavar="PATH",
                    help="a file of the kernel's own lines, such as /var/log/kern.log (repeatable): may report driver "
                         "and hardware faults while only root can write it")
    ap.add_argument("--no-kernel-log", dest="kernel_log", action="store_const", const=False, help="do not read the kernel log")
    ap.add_argument("--simulate-gpus", type=int, metavar="N", help="simulate N GPUs instead of reading NVML")
    ap.add_argument("--sim-seed", type=int, help="seed of the simulated GPUs (default 0)")
    ap.add_argument("--trainer-socket", metavar="PATH", help="the local trainer's control socket")
    ap.add_argument("--scene-dir", metavar="DIR", help="where capture_scene keeps incident bundles")
    ap.add_argument("--state-file", metavar="PATH", help="keep the node's isolation here, across agent restarts")
    ap.add_argument("--patrol-interval", type=float, metavar="S", help="repeat the cheap pre-flight checks every S seconds (0: off)")
    ap.add_argument("--source-timeout", type=float, metavar="S",
                    help="seconds one source (NVML, host, logs) may take to answer a tick before it counts as hung (default 2)")
    ap.add_argument("--log-level", default="INFO", help="agent log level (default INFO)")
    ap.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from loguru import logger

    from gridwatch.agent.config import ConfigError, load
    from gridwatch.agent.runner import run_agent

    logger.remove()
    logger.add(sys.stderr, level=args.log_level.upper(), format="{time:YYYY-MM-DD HH:mm:ss} {level} [{extra[node]}] {message}")
    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "func", "command", "log_level")}
    try:
        config = load(args.config, overrides)
    except ConfigError as exc:
        print(f"gridwatch agent: {exc}", file=sys.stderr)
        return EXIT_ERROR
    logger.configure(extra={"node": config.node_name})
    try:
        asyncio.run(run_agent(config))
    except RuntimeError as exc:
        print(f"gridwatch agent: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:
        print(f"gridwatch agent: cannot listen on {config.listen}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK
