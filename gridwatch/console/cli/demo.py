"""``gridwatch demo`` (a cluster in a box) and ``gridwatch fault`` (inject a fault through the operator action)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import TYPE_CHECKING

from gridwatch.console.cli.ui import SUMMARY_EVERY_HELP, summary_every_arg
from gridwatch.playbooks.model import SCHEDULERS
from gridwatch.wire.exitcodes import EXIT_ERROR, EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:  # imported when a demo starts, so that --help stays light
    from gridwatch.console.demo.chaos import ScriptedFault
    from gridwatch.console.demo.session import DemoOptions, DemoSession

# The agent's fault kinds (gridwatch.agent.actions.FAULT_KINDS), listed here so --help needs no agent import.
FAULT_KINDS = ("xid", "ecc-dbe", "thermal", "fell-off-bus", "hang", "trainer-hang", "trainer-crash", "agent-kill",
               "net-cut", "ib-flap", "ib-down", "ib-errors")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


def _fault_arg(text: str) -> ScriptedFault:
    from gridwatch.console.demo.chaos import parse_fault

    try:
        return parse_fault(text, FAULT_KINDS)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo", help="run a cluster in a box: agents, a trainer, the playbooks and the console",
        description="Start a local cluster with no configuration: N agents on loopback ports with simulated GPUs, "
        "the reference trainer across them, the shipped playbooks acting, and the console attached as operator. "
        "Ctrl-C (or q in the console) stops everything it started.",
    )
    demo.add_argument("--nodes", type=_count, default=4, help="nodes, named node-1 ... node-N (default 4)")
    demo.add_argument("--gpus", type=_count, default=8, help="simulated GPUs per node (default 8)")
    demo.add_argument("--headless", action="store_true", help="no screen: print incidents and actions, then a summary")
    demo.add_argument("--duration", type=_positive, metavar="S", help="stop after S seconds (headless default 60)")
    demo.add_argument("--json", action="store_true", help="headless: the last line printed is the summary as JSON")
    demo.add_argument("--chaos", action="store_true", help="inject random faults from the simulated catalogue")
    demo.add_argument("--fault-every", type=_positive, default=60.0, metavar="S",
                      help="with --chaos: about one fault every S seconds (default 60)")
    demo.add_argument("--fault", type=_fault_arg, action="append", default=[], metavar="NODE:KIND[:CODE]@S",
                      help="a drill: inject this fault S seconds in (repeatable), e.g. node-2:xid:79@20 "
                      "node-1:trainer-crash@60; append /GPU for another GPU than 0")
    demo.add_argument("--repair-after", type=_positive, default=40.0, metavar="S",
                      help="with --chaos or --fault: a faulted node is fixed and returned after S seconds (default 40)")
    demo.add_argument("--seed", type=int, help="seed of the chaos choices")
    demo.add_argument("--interval", type=_positive, default=1.0, metavar="S", help="agents' sample interval (default 1)")
    demo.add_argument("--no-trainer", action="store_true", help="run agents and console only")
    demo.add_argument("--dir", metavar="DIR", help="keep keys, logs, checkpoints and incidents here (default: a temporary directory)")
    demo.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                      help="extra argument for `gridwatch train` (repeatable), e.g. --train-arg=--dim=64")
    demo.add_argument("--skip-playbook", action="append", default=[], metavar="NAME",
                      help="leave a shipped playbook out (repeatable); e.g. straggler-persistent on a box whose "
                      "CPUs the workers share, where every rank looks slow now and then")
    demo.add_argument("--scheduler", choices=SCHEDULERS, default="none",
                      help="what a playbook's drain_node step tells (default none: the step is skipped)")
    demo.add_argument("--alertmanager", metavar="URL",
                      help="page through Alertmanager: every notify step also posts there")
    demo.add_argument("--metrics", metavar="HOST:PORT",
                      help="serve the console's own Prometheus /metrics (goodput, incidents, actions) here")
    demo.add_argument("--etcd", metavar="URL", action="append", default=[],
                      help="share the acting with other consoles through etcd (repeatable): the demo's console "
                           "campaigns for the lead; one attached with the demo's cluster.toml observes until "
                           "you take over there (key L)")
    demo.add_argument("--summary-every", metavar="SECONDS|auto", type=summary_every_arg, default="auto",
                      help=SUMMARY_EVERY_HELP)
    demo.add_argument("--watch-only", action="store_true",
                      help="playbooks make incidents but send no step that acts (isolate, restart, ...): a baseline")
    demo.set_defaults(func=_demo)

    fault = sub.add_parser(
        "fault", help="inject a fault into a demo node or a simulated agent (operator action)",
        description="Inject a fault through the operator action inject_fault. TARGET is a node of the running demo "
        "(node-2) or HOST:PORT of any agent with simulated GPUs (then give --key and --known-hosts).",
    )
    fault.add_argument("target", metavar="TARGET", help="demo node name or HOST:PORT")
    fault.add_argument("kind", metavar="KIND", choices=FAULT_KINDS, help=f"one of: {', '.join(FAULT_KINDS)}")
    fault.add_argument("--code", type=int, help="the XID code, for KIND xid (e.g. 79, 13)")
    fault.add_argument("--gpu", type=int, default=0, help="which GPU (for ib-* kinds: which HCA, mlx5_N; default 0)")
    fault.add_argument("--key", metavar="PATH", help="operator key (HOST:PORT targets)")
    fault.add_argument("--known-hosts", metavar="PATH", help="known_hosts pinning the agent (HOST:PORT targets)")
    fault.add_argument("--dir", metavar="DIR", help="the demo's directory (default: the newest running demo)")
    fault.add_argument("--reason", default="injected by gridwatch fault", help="why, for the audit log")
    fault.set_defaults(func=_fault)


# ------------------------------------------------------------------- demo


def _demo(args: argparse.Namespace) -> int:
    from gridwatch.console.demo.cluster import ClusterOptions
    from gridwatch.console.demo.session import DemoOptions

    options = DemoOptions(
        cluster=ClusterOptions(nodes=args.nodes, gpus=args.gpus, interval=args.interval, trainer=not args.no_trainer,
                               trainer_args=list(args.train_arg)),
        directory=args.dir, chaos_every=args.fault_every if args.chaos else None, seed=args.seed,
        faults=tuple(args.fault), repair_after=args.repair_after,
        skip_playbooks=tuple(args.skip_playbook), act=not args.watch_only, scheduler=args.scheduler,
        etcd=tuple(args.etcd), summary_every=args.summary_every,
    )
    unknown = sorted({f.node for f in args.fault} - {f"node-{i}" for i in range(1, args.nodes + 1)})
    if unknown:
        print(f"gridwatch demo: --fault: no node {', '.join(unknown)} in a demo of node-1 ... node-{args.nodes}",
              file=sys.stderr)
        return EXIT_ERROR
    if any(not u.startswith(("http://", "https://")) for u in args.etcd):
        print(f"gridwatch demo: --etcd: expected an http(s) URL, got {' '.join(args.etcd)!r}", file=sys.stderr)
        return EXIT_ERROR
    if args.alertmanager:
        from gridwatch.playbooks.notify import check_alertmanager_url

        try:
            args.alertmanager = check_alertmanager_url(args.alertmanager)
        except ValueError as exc:
            print(f"gridwatch demo: --alertmanager: {exc}", file=sys.stderr)
            return EXIT_ERROR
    if args.metrics:
        from gridwatch.console.runtime.metrics import parse_metrics_addr

        try:
            parse_metrics_addr(args.metrics, "--metrics")
        except ValueError as exc:
            print(f"gridwatch demo: {exc}", file=sys.stderr)
            return EXIT_ERROR
    _quiet_logs(args.dir)
    try:
        if args.headless:
            return asyncio.run(_headless(options, args.duration or 60.0, args.json, args.alertmanager, args.metrics))
        return asyncio.run(_with_console(options, args.duration, args.alertmanager, args.metrics))
    except KeyboardInterrupt:
        return 130


def _quiet_logs(directory: str | None) -> None:
    # The demo's own lines are the output; library logs go to a file when there is a directory to keep.
    from loguru import logger

    logger.remove()
    logger.configure(extra={"node": "-"})
    if directory:
        from pathlib import Path

        Path(directory).mkdir(parents=True, exist_ok=True)
        logger.add(str(Path(directory) / "demo.log"), level="INFO",
                   format="{time:YYYY-MM-DD HH:mm:ss.SSS} {level} [{extra[node]}] {message}")


def _say(line: str) -> None:
    print(line, flush=True)


def _cancel_on_sigterm() -> None:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is not None:
        try:
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
        except (NotImplementedError, RuntimeError):
            pass


def _page(session: DemoSession, alertmanager: str | None, metrics: str | None = None) -> None:
    """With ``--alertmanager``: the demo's notify steps fire alerts there too, as a console's do.

    With ``--metrics``: the demo's runtime serves its /metrics there (RuntimeError when the port is taken).
    """
    if alertmanager and session.runtime is not None:
        from gridwatch.console.runtime.wiring import page_through_alertmanager

        page_through_alertmanager(session.runtime, alertmanager)
    if metrics and session.runtime is not None:
        from gridwatch.console.runtime.metrics import serve_metrics

        try:
            serve_metrics(session.runtime, metrics)
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None


async def _headless(options: DemoOptions, duration: float, as_json: bool, alertmanager: str | None = None,
                    metrics: str | None = None) -> int:
    from gridwatch.console.demo.cluster import ClusterError
    from gridwatch.console.demo.session import DemoSession
    from gridwatch.console.demo.summary import render

    _cancel_on_sigterm()
    session = DemoSession(options, say=_say)
    summary = None
    try:
        await session.start()
        _page(session, alertmanager, metrics)
        await session.attach()
        await session.wait_connected()
        _say(f"demo: running headless for {duration:g} s (Ctrl-C stops it)")
        try:
            await asyncio.sleep(duration)
        except asyncio.CancelledError:
            _say("demo: stopping early")
        summary = session.summary()
        if session.runtime is not None:
            from gridwatch.console.demo.summary import with_goodput

            summary = with_goodput(summary, session.runtime, session.faults)
    except (ClusterError, TimeoutError, RuntimeError, OSError) as exc:
        _say(f"gridwatch demo: {exc}")
        return EXIT_ERROR
    finally:
        await asyncio.shield(session.close())
    for line in render(summary):
        _say(line)
    if as_json:
        import msgspec

        _say(msgspec.json.encode(summary).decode())
    return EXIT_OK


async def _with_console(options: DemoOptions, duration: float | None, alertmanager: str | None = None,
                        metrics: str | None = None) -> int:
    from gridwatch.console.demo.cluster import ClusterError
    from gridwatch.console.demo.session import DemoSession

    try:
        from gridwatch.console.tui.app import GridwatchApp
    except ImportError as exc:
        print(f"gridwatch demo: the console cannot start ({exc}); install gridwatch[console], or use --headless",
              file=sys.stderr)
        return EXIT_ERROR
    _cancel_on_sigterm()
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    session = DemoSession(options, say=say)
    try:
        await session.start()
        _page(session, alertmanager, metrics)
        session.say = lines.append  # the screen owns the terminal from here on
        assert session.runtime is not None
        # The screen starts and stops the session's runtime, as `gridwatch console` does its own.
        app = GridwatchApp(session.runtime, demo=True)  # q asks before the cluster is torn down
        session._begin()
        if duration:
            asyncio.get_running_loop().call_later(duration, app.exit)
        await app.run_async()
    except (ClusterError, RuntimeError) as exc:
        print(f"gridwatch demo: {exc}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        await asyncio.shield(session.close())
    return EXIT_OK


# ------------------------------------------------------------------ fault


def _fault(args: argparse.Namespace) -> int:
    if args.kind == "xid" and args.code is None:
        print("gridwatch fault: an xid fault needs --code (e.g. --code 79)", file=sys.stderr)
        return EXIT_ERROR
    try:
        endpoint, name, key, known = _resolve_fault_target(args)
    except ValueError as exc:
        print(f"gridwatch fault: {exc}", file=sys.stderr)
        return EXIT_ERROR
    fault_args: dict[str, object] = {"kind": args.kind, "gpu": args.gpu}
    if args.code is not None:
        fault_args["code"] = args.code
    try:
        ok, message = asyncio.run(_send_fault(endpoint, key, known, fault_args, args.reason))
    except ConnectionError as exc:
        print(f"gridwatch fault: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"{name}: {message}" if ok else f"gridwatch fault: {name} refused: {message}", file=sys.stdout if ok else sys.stderr)
    return EXIT_OK if ok else EXIT_FAILED


def _resolve_fault_target(args: argparse.Namespace) -> tuple[str, str, str, str]:
    """(host:port, display name, key, known_hosts) for a demo node name or an explicit HOST:PORT."""
    from pathlib import Path

    from gridwatch.console.demo.state import DemoNotFound, read_state

    host, sep, port = args.target.rpartition(":")
    if sep and port.isdigit():
        if not args.key or not args.known_hosts:
            try:
                state = read_state(args.dir)
            except DemoNotFound:
                raise ValueError(f"{args.target}: give --key and --known-hosts for an agent outside a demo") from None
            args.key = args.key or state.operator_key
            args.known_hosts = args.known_hosts or state.known_hosts
        for path, what in ((args.key, "key"), (args.known_hosts, "known_hosts")):
            if not Path(path).is_file():
                raise ValueError(f"{what} file {path} does not exist")
        return args.target, args.target, args.key, args.known_hosts
    try:
        state = read_state(args.dir)
    except DemoNotFound as exc:
        raise ValueError(str(exc)) from None
    node = state.node(args.target)
    if node is None:
        names = ", ".join(n.name for n in state.nodes)
        raise ValueError(f"no node {args.target!r} in the demo in {state.dir} (it has {names}); or give HOST:PORT")
    return node.endpoint, node.name, args.key or state.operator_key, args.known_hosts or state.known_hosts


async def _send_fault(endpoint: str, key: str, known: str, fault_args: dict[str, object], reason: str) -> tuple[bool, str]:
    from loguru import logger

    from gridwatch.sshlink.client import Fleet, FleetOptions, LinkState
    from gridwatch.sshlink.hostlist import parse_endpoints
    from gridwatch.wire.protocol import AgentAction

    logger.remove()
    ep = parse_endpoints(endpoint)[0]
    fleet = Fleet([ep], FleetOptions(key_path=key, known_hosts=known, connect_timeout=5.0))
    link = fleet.links[ep]
    try:
        await fleet.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10.0
        while link.state != LinkState.CONNECTED:
            if link.state == LinkState.REFUSED or loop.time() > deadline:
                raise ConnectionError(link.last_error or f"{endpoint}: no connection within 10 s")
            await asyncio.sleep(0.05)
        result = await fleet.action(link.name, AgentAction.INJECT_FAULT, fault_args, reason=reason, timeout=10.0)
        return bool(result.ok), str(result.message)
    finally:
        await fleet.stop()
