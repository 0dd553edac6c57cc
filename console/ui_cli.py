"""``gridwatch console``: the operator's screen (or, with ``--headless``, the same engine without one)."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import signal
import sys
import tomllib
from pathlib import Path

from console.cli import EXIT_ERROR, EXIT_OK
from console.commands import add_target_options, resolve_targets

EPILOG = """\
cluster.toml (paths are relative to the file):
  nodes = "node[01-04]:8022"          # hostlist syntax, or a list of such strings
  key = "keys/operator"               # private key; the agents' lists decide viewer or operator
  known_hosts = "keys/known_hosts"    # pins the agents' host keys
  db = "incidents.db"                 # optional: incidents, steps and audit log (SQLite)
  read_only = false                   # optional: never act, even with an operator key
  playbooks = ["playbooks/"]          # optional: more playbook files or folders

keys: ? every key   : command line (:nodes :logs :incidents :training :node NAME)
      / filter   enter open   esc back   ctrl+p command palette   q quit
"""


def default_db() -> str:
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "gridwatch"
    return str(state / "incidents.db")


def register(sub: argparse._SubParsersAction) -> None:
    ap = sub.add_parser("console", help="the operator console (Textual), or --headless as a service",
                        description="Watch and act on a fleet of gridwatch agents.", epilog=EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_options(ap)
    ap.add_argument("--read-only", action="store_true", help="no action that changes anything exists")
    ap.add_argument("--headless", action="store_true", help="no screen: run the engine and print what happens")
    ap.add_argument("--db", metavar="PATH", help=f"incident database (default {default_db()})")
    ap.add_argument("--playbooks", metavar="PATH", action="append", default=[], help="more playbooks (repeatable)")
    ap.add_argument("--operator", metavar="NAME", help="who you are in the audit log (default: your login)")
    ap.add_argument("--duration", type=float, metavar="S", help="headless: stop after S seconds")
    ap.set_defaults(func=_console)


def _cluster_extras(args: argparse.Namespace) -> dict:
    if not args.cluster:
        return {}
    data = tomllib.loads(Path(args.cluster).read_text())  # already read once by resolve_targets
    base = Path(args.cluster).parent
    extras = {"read_only": bool(data.get("read_only", False))}
    if "db" in data:
        extras["db"] = str(base / data["db"])
    books = data.get("playbooks", [])
    extras["playbooks"] = [str(base / b) for b in ([books] if isinstance(books, str) else books)]
    return extras


def _console(args: argparse.Namespace) -> int:
    from console.runtime import RuntimeOptions, build_runtime

    try:
        endpoints, key, known = resolve_targets(args)
        extras = _cluster_extras(args)
        db = args.db or extras.get("db") or default_db()
        # The database says which nodes failed how and who did what: a folder of its own, private.
        Path(db).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        options = RuntimeOptions(
            endpoints=endpoints, key_path=key, known_hosts=known, db_path=db,
            read_only=args.read_only or extras.get("read_only", False),
            operator=args.operator or getpass.getuser(),
            playbook_paths=[*extras.get("playbooks", []), *args.playbooks],
        )
        runtime = build_runtime(options)
    except (ValueError, OSError) as exc:
        print(f"gridwatch console: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.headless:
        try:
            return asyncio.run(_headless(runtime, args.duration))
        except RuntimeError as exc:
            print(f"gridwatch console: {exc}", file=sys.stderr)
            return EXIT_ERROR
    from loguru import logger

    from console.app import GridwatchApp

    # The screen is the terminal: logs would scribble over it.
    logger.remove()
    GridwatchApp(runtime).run()
    return EXIT_OK


async def _headless(runtime, duration: float | None) -> int:  # noqa: ANN001 - a ConsoleRuntime
    """Print link changes and new incidents as they happen; a summary line when the count changes, or each minute."""
    from agents.protocol import clean_text
    from console.commands import clean_logs
    from console.widgets.status_bar import format_age

    clean_logs()
    for note in getattr(runtime.plan_store, "bad_rows", []):
        print(f"gridwatch console: skipped a bad row: {note}", file=sys.stderr, flush=True)
    await runtime.start()
    store = runtime.store
    alert: str | None = None
    stop = asyncio.Event()
    # As a service it is stopped with SIGTERM: close the connections and the database cleanly.
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    links: dict[str, str] = {}
    seen_incidents: set[str] = set()
    loop = asyncio.get_running_loop()
    started = loop.time()
    last_summary = 0.0
    last_counts: tuple[int, int] | None = None
    try:
        while not stop.is_set() and (duration is None or loop.time() - started < duration):
            runtime.tick_engine()
            if runtime.alert != alert:
                alert = runtime.alert
                print(f"ALERT: {alert}" if alert else "alert cleared", file=sys.stderr, flush=True)
            for node in store.nodes.values():
                state = str(store.status(node))
                if links.get(node.key) != state:
                    links[node.key] = state
                    # What a peer said (a disconnect reason, an error) reaches the terminal cleaned.
                    error = clean_text(node.link_error or node.last_error or "", 300)
                    print(f"node {clean_text(node.name, 200)} {state}" + (f": {error}" if error and state != "ok" else ""),
                          flush=True)
            if runtime.incidents is not None:
                for row in runtime.incidents.incidents():
                    if row.id not in seen_incidents:
                        seen_incidents.add(row.id)
                        print(clean_text(f"incident {row.id} {row.severity} {row.node}: {row.title} [{row.state}]"),
                              flush=True)
            s = store.summary()
            if (s.connected, s.total) != last_counts or loop.time() - last_summary >= 60:
                last_summary, last_counts = loop.time(), (s.connected, s.total)
                traffic = ""
                if runtime.fleet is not None and hasattr(runtime.fleet, "links"):
                    links_now = runtime.fleet.links.values()
                    traffic = (f", frames {sum(l.frames for l in links_now)}, lost {sum(l.gaps for l in links_now)}, "
                               f"bad {sum(l.bad_frames for l in links_now)}")
                print(f"summary {s.connected}/{s.total} nodes connected, {s.gpus} GPUs, "
                      f"oldest data {format_age(s.oldest_age_s)}{traffic}", flush=True)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
    finally:
        await runtime.stop()
    return EXIT_OK
