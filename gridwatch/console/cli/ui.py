"""``gridwatch console``: the operator's screen (or, with ``--headless``, the same engine without one)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gridwatch.console.cli.commands import add_target_options, cluster_config, resolve_targets
from gridwatch.playbooks.incident_times import Phase
from gridwatch.playbooks.model import SCHEDULERS
from gridwatch.wire.exitcodes import EXIT_ERROR, EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:
    from gridwatch.console.runtime.config import SummaryEvery
    from gridwatch.console.runtime.core import ConsoleRuntime
    from gridwatch.console.runtime.incidents import IncidentRow
    from gridwatch.console.runtime.wiring import RuntimeOptions
    from gridwatch.sshlink.client import RelayStatus

EPILOG = """\
cluster.toml (paths are relative to the file):
  nodes = "node[01-04]:8022"          # hostlist syntax, or a list of such strings
  key = "keys/operator"               # private key; the agents' lists decide viewer or operator
  known_hosts = "keys/known_hosts"    # pins the agents' host keys
  db = "incidents.db"                 # optional: incidents, steps and audit log (SQLite)
  read_only = false                   # optional: never act, even with an operator key
  playbooks = ["playbooks/"]          # optional: more playbook files or folders
  scheduler = "slurm"                 # optional: none (default) | slurm | kubernetes, for drain_node
  operator = "alice"                  # optional: who you are in the audit log (default: your login)
  connect_timeout = 5.0               # optional: seconds to reach an agent before trying again
  etcd = "http://10.0.0.1:2379"       # optional: several consoles, one acts (an etcd lease); or a list
  cluster = "train-a"                 # optional: the name they share the lead under (default: from nodes)
  alertmanager = "http://am:9093"     # optional: notify steps page through Alertmanager too
  metrics = "127.0.0.1:9400"          # optional: the console's own /metrics (goodput, incidents, actions)
  prometheus = "http://prom:9090"     # optional: the fleet from Prometheus too (nodes may then be left out)
  summary_every = "auto"              # optional: seconds between a node's summaries, or auto (by fleet size)
  [[relay]]                           # optional, repeatable: nodes reached through a gridwatch relay
  address = "head1:8023"              #   the relay (pinned in known_hosts like an agent)
  nodes = "node[017-512]:8022"        #   the nodes it carries; nodes above lists only the direct ones
An unknown key or a wrong type is one line naming the file and the key; exit 2.

keys: ? every key   : command line (:nodes :logs :incidents :training :node NAME)
      / filter   enter open   esc back   ctrl+p command palette   q quit
"""


def default_db() -> str:
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "gridwatch"
    return str(state / "incidents.db")


SUMMARY_EVERY_HELP = ("seconds between each node's compact summary in the fleet view, or auto (default): one per "
                     "sample up to 250 nodes, then a second per 250 nodes, at most 5 s; 0: one per sample. Events come at "
                     "once and a node you open sends every sample whatever it is")


RELAY_HELP = ("reach the nodes of HOSTLIST through the gridwatch relay at ADDRESS (HOST:PORT), on one link, e.g. "
              "head1:8023=node[017-512]:8022: worth it past ~1,000 nodes per console. Repeatable; the relays "
              "replace cluster.toml's [[relay]] tables; a node is reached one way only")


def summary_every_arg(text: str) -> SummaryEvery:
    """``--summary-every``'s argparse type: "auto" or seconds (gridwatch.console.runtime.config.parse_summary_every)."""
    from gridwatch.console.runtime.config import parse_summary_every

    try:
        return parse_summary_every(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: argparse._SubParsersAction) -> None:
    ap = sub.add_parser("console", help="the operator console (Textual), or --headless as a service",
                        description="Watch and act on a fleet of gridwatch agents.", epilog=EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_options(ap, required=False)  # --prometheus alone is a fleet too
    ap.add_argument("--read-only", action="store_true", help="no action that changes anything exists")
    ap.add_argument("--headless", action="store_true", help="no screen: run the engine and print what happens")
    ap.add_argument("--db", metavar="PATH", help=f"incident database (default {default_db()})")
    ap.add_argument("--playbooks", metavar="PATH", action="append", default=[], help="more playbooks (repeatable)")
    ap.add_argument("--operator", metavar="NAME", help="who you are in the audit log (default: your login)")
    ap.add_argument("--scheduler", choices=SCHEDULERS,
                    help="what a playbook's drain_node step tells (default: cluster.toml's, else none)")
    ap.add_argument("--duration", type=float, metavar="S", help="headless: stop after S seconds")
    ap.add_argument("--control-socket", metavar="PATH",
                    help="headless: where `gridwatch node return|isolate` reaches this console (default: beside the db)")
    ap.add_argument("--alertmanager", metavar="URL",
                    help="page through Alertmanager: every notify step also posts there (default: cluster.toml's)")
    ap.add_argument("--metrics", metavar="HOST:PORT",
                    help="serve the console's own Prometheus /metrics (goodput, incidents, actions) here "
                         "(default: cluster.toml's)")
    ap.add_argument("--prometheus", metavar="URL",
                    help="read the fleet from a Prometheus query API too (Thanos, VictoriaMetrics, Mimir alike; "
                         "default: cluster.toml's); agents, where listed, still carry events and actions")
    ap.add_argument("--etcd", metavar="URL", action="append",
                    help="share the acting with the cluster's other consoles: one leads through an etcd lease, the "
                         "others observe (repeatable; default: cluster.toml's). An interactive console observes "
                         "until you take over (key L)")
    ap.add_argument("--summary-every", metavar="SECONDS|auto", type=summary_every_arg,
                    help=SUMMARY_EVERY_HELP + " (default: cluster.toml's, else auto)")
    # Checked in runtime_options, not by argparse: a bad value is one line, not a usage screen.
    ap.add_argument("--relay", metavar="ADDRESS=HOSTLIST", action="append", default=[], help=RELAY_HELP)
    ap.set_defaults(func=_console)


def runtime_options(args: argparse.Namespace) -> RuntimeOptions:
    """What ``console``'s flags and cluster.toml make of a runtime; ValueError (or ConfigError) in one line."""
    from gridwatch.console.runtime.config import ClusterConfig, RelayConfig, parse_relay, relay_endpoints
    from gridwatch.console.runtime.wiring import RuntimeOptions

    config = cluster_config(args) or ClusterConfig(nodes=args.nodes or "")
    prometheus = args.prometheus or config.prometheus
    relays: list[RelayConfig] = []
    for text in args.relay:
        try:
            relays.append(parse_relay(text))
        except ValueError as exc:
            raise ValueError(f"--relay: {exc}") from None
    if not config.node_spec.strip():
        if not prometheus and not (relays or config.relay):
            raise ValueError("no fleet: give --nodes SPEC, --cluster FILE, --relay ADDRESS=HOSTLIST or --prometheus URL")
        endpoints: list = []  # no agent to log in to
        key, known = args.key or "", args.known_hosts or ""
    else:
        endpoints, key, known = resolve_targets(args)
    db = args.db or config.db or default_db()
    # The database says which nodes failed how and who did what: a folder of its own, private.
    Path(db).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    overrides: dict = {"endpoints": endpoints, "key_path": key, "known_hosts": known, "db_path": db,
                       "read_only": args.read_only or config.read_only,
                       "playbook_paths": [*config.playbook_paths, *args.playbooks]}
    if args.operator:
        overrides["operator"] = args.operator
    if args.etcd:
        if any(not u.startswith(("http://", "https://")) for u in args.etcd):
            raise ValueError(f"--etcd: expected an http(s) URL, got {' '.join(args.etcd)!r}")
        overrides["etcd"] = list(args.etcd)
    # A service campaigns for the lead; an operator's screen observes until told to take over.
    overrides["campaign"] = bool(args.headless)
    if prometheus:
        from gridwatch.console.fleet.prometheus import check_prometheus_url

        try:
            overrides["prometheus"] = check_prometheus_url(prometheus)
        except ValueError as exc:
            raise ValueError(f"--prometheus: {exc}") from None
    if args.scheduler:
        overrides["scheduler"] = args.scheduler
    if args.summary_every is not None:
        overrides["summary_every"] = args.summary_every
    if args.metrics:
        from gridwatch.console.runtime.metrics import parse_metrics_addr

        parse_metrics_addr(args.metrics, "--metrics")
        overrides["metrics"] = args.metrics
    if args.alertmanager:
        from gridwatch.playbooks.notify import check_alertmanager_url

        try:
            overrides["alertmanager"] = check_alertmanager_url(args.alertmanager)
        except ValueError as exc:
            raise ValueError(f"--alertmanager: {exc}") from None
    if relays:
        # The flag's relays replace the file's, and are checked against the nodes linked directly.
        overrides["relays"] = relay_endpoints(relays, endpoints, lambda index, _key: f"--relay {args.relay[index]}")
    return RuntimeOptions.from_cluster(config, **overrides)


def _console(args: argparse.Namespace) -> int:
    from gridwatch.console.runtime.wiring import build_runtime
    from gridwatch.sshlink.coalesce import console_period, read_every, run_coalesced
    from gridwatch.sshlink.lean import ssh_client

    try:
        ssh_client()  # who reads them (gridwatch.sshlink.lean): a wrong GRIDWATCH_SSH_CLIENT is said here
        options = runtime_options(args)
        # How often the links are read together (gridwatch.sshlink.coalesce): by the links held directly.
        every = read_every(console_period(len(options.endpoints)))
        runtime = build_runtime(options)
    except (ValueError, OSError) as exc:
        print(f"gridwatch console: {exc}", file=sys.stderr)
        return EXIT_ERROR
    db = options.db_path or default_db()
    if args.headless:
        try:
            from gridwatch.console.runtime.control import socket_for

            # Every link read together at most every 0.1 s (0.25 s from 1,000 links): nearly half less per message.
            return run_coalesced(_headless(runtime, args.duration, args.control_socket or socket_for(db)), every)
        except RuntimeError as exc:
            print(f"gridwatch console: {exc}", file=sys.stderr)
            return EXIT_ERROR
    from loguru import logger

    try:
        from gridwatch.console.tui.app import GridwatchApp
    except ImportError as exc:
        # A node's install has no textual: say what to install rather than show a traceback.
        print(f"gridwatch console: the screen cannot start ({exc}); install gridwatch[console], or use --headless",
              file=sys.stderr)
        return EXIT_ERROR

    # The screen is the terminal: logs would scribble over it.
    logger.remove()
    app = GridwatchApp(runtime)
    run_coalesced(app.run_async(), every)  # as headless: the links read together; a key ends the wait
    # Textual shows a crash's traceback and returns; the exit status must say it too.
    return EXIT_OK if not app.return_code else EXIT_FAILED


async def _headless(runtime: ConsoleRuntime, duration: float | None, control: str | None = None) -> int:
    """Print link changes, new incidents and recoveries as they happen; a summary line when the count
    changes, or each minute. The runtime ticks its engine itself, as under the screen."""
    from gridwatch.console.tui.widgets.status_bar import format_age
    from gridwatch.wire.cleanlogs import clean_logs
    from gridwatch.wire.protocol import clean_text

    clean_logs()
    for note in getattr(runtime.plan_store, "bad_rows", []):
        print(f"gridwatch console: skipped a bad row: {note}", file=sys.stderr, flush=True)

    def recovered(row: IncidentRow) -> None:
        detect = "-" if row.detect_s is None else f"{row.detect_s:.1f} s"
        print(clean_text(f"incident {row.id} recovered: the job trains past step {row.fault_step}; "
                         f"detected in {detect}, recovered in {row.recover_s:.1f} s"), flush=True)

    runtime.hooks.recovered.append(recovered)
    node_count = len(getattr(runtime.fleet, "links", {}) or {})
    print(clean_text(f"console: {node_count} nodes, scheduler {runtime.scheduler}, acting as {runtime.operator}"
                     + (", read-only" if runtime.read_only_flag else "")), flush=True)
    fleet_options = getattr(runtime.fleet, "options", None)
    if fleet_options is not None:
        # Once: how often each node's summary comes (the setting, or what "auto" made of the fleet's size).
        from gridwatch.console.runtime.config import cadence_line

        print(cadence_line(fleet_options.summary_every, len(getattr(runtime.fleet, "links", ()))), flush=True)
    def relay_line(relay: RelayStatus) -> None:
        # Down: the runtime's own line for it (the status line's); up: its return.
        said = runtime.relays_down.get(str(relay.endpoint)) or f"relay {relay.endpoint} up ({len(relay.carried):,} nodes)"
        print(clean_text(said), flush=True)

    runtime.hooks.relay.append(relay_line)
    if runtime.election is not None:
        # One line each time this console's role changes: "leader (token 42)", "observer; host-2 leads".
        runtime.election.on_change.append(lambda standing: print(clean_text(standing.line), flush=True))
    await runtime.start()
    from gridwatch.console.runtime.control import ControlError, ControlServer

    server = ControlServer(runtime, control) if control else None
    if server is not None:
        try:
            await server.start()
        except ControlError as exc:
            print(f"gridwatch console: {exc}", file=sys.stderr, flush=True)
            await runtime.stop()
            return EXIT_ERROR
        # An operator returns a node to service (audited, the scheduler told) with `gridwatch node return`.
        print(clean_text(f"control socket at {control}"), flush=True)
    store = runtime.store
    alert: str | None = None
    stop = asyncio.Event()
    # As a service it is stopped with SIGTERM: close the connections and the database cleanly.
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    links: dict[str, str] = {}
    behind_relay: set[str] = set()  # nodes down with their relay: said by the relay's line
    seen_incidents: set[str] = set()
    blames: dict[str, str] = {}  # incident -> the blame last printed
    phases: dict[str, Phase] = {}  # incident -> the phase last printed
    trainers = (0, False)  # nodes reporting a trainer, and whether it had a step, as last said
    loop = asyncio.get_running_loop()
    started = loop.time()
    last_summary = 0.0
    last_counts: tuple[int, int] | None = None
    try:
        while not stop.is_set() and (duration is None or loop.time() - started < duration):
            if runtime.alert != alert:
                alert = runtime.alert
                print(f"ALERT: {alert}" if alert else "alert cleared", file=sys.stderr, flush=True)
            for node in store.nodes.values():
                state = str(store.health(node))  # a live node with a lost GPU is "degraded", not "ok"
                if links.get(node.key) != state:
                    links[node.key] = state
                    # What a peer said (a disconnect reason, an error) reaches the terminal cleaned.
                    error = clean_text(node.link_error or node.last_error or "", 300)
                    # A relay's death is one line (the relay's), not one per node behind it; nor their return.
                    if state != "ok" and any(f"relay {r}" in error for r in runtime.relays_down):
                        behind_relay.add(node.key)
                        continue
                    if state == "ok" and node.key in behind_relay:
                        behind_relay.discard(node.key)
                        continue
                    print(f"node {clean_text(node.name, 200)} {state}" + (f": {error}" if error and state != "ok" else ""),
                          flush=True)
            if runtime.incidents is not None:
                for row in runtime.incidents.incidents():
                    if row.id not in seen_incidents:
                        seen_incidents.add(row.id)
                        print(clean_text(f"incident {row.id} {row.severity} {row.node}: {row.title} [{row.state}]"),
                              flush=True)
                    if phases.get(row.id, Phase.OPEN) != row.phase:  # each move of its life, once
                        phases[row.id] = row.phase
                        print(clean_text(f"incident {row.id} {row.phase}"), flush=True)
                    # Who is to blame often comes after the incident (the records are read when a hang is suspected).
                    if row.blamed and blames.get(row.id) != row.blame_why:
                        blames[row.id] = row.blame_why
                        print(clean_text(f"incident {row.id} blames {', '.join(row.blamed)}: {row.blame_why}"),
                              flush=True)
            # The job as the console sees it, when the count of nodes reporting a trainer changes (a node
            # out, a node back): not each step, which the trainer's own metrics keep.
            job = store.training()
            step = job.status.step if job is not None else None
            reporting = (job.nodes_reporting if job is not None else 0, step is not None)
            if reporting != trainers:
                trainers = reporting
                print(f"training: {reporting[0]} of {len(store.nodes)} nodes report a trainer"
                      + (f", at step {step}" if step is not None else ""), flush=True)
            s = store.summary()
            if (s.connected, s.total) != last_counts or loop.time() - last_summary >= 60:
                last_summary, last_counts = loop.time(), (s.connected, s.total)
                traffic = ""
                if runtime.fleet is not None and hasattr(runtime.fleet, "links"):
                    links_now = runtime.fleet.links.values()
                    traffic = (f", frames {sum(l.frames for l in links_now)}, lost {sum(l.gaps for l in links_now)}, "
                               f"bad {sum(l.bad_frames for l in links_now)}")
                read = f" ({s.hearsay:,} read from Prometheus, no agent)" if s.hearsay else ""
                print(f"summary {s.connected}/{s.total} nodes connected{read}, {s.gpus} GPUs, "
                      f"oldest data {format_age(s.oldest_age_s)}{traffic}", flush=True)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
    finally:
        if server is not None:
            await server.stop()
        await runtime.stop()
    return EXIT_OK
