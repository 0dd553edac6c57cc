"""The one typed config of a runtime (RuntimeOptions) and the function that builds the runtime from it."""

from __future__ import annotations

import dataclasses
import getpass
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gridwatch.console.fleet.state import Clock, StateStore, SystemClock
from gridwatch.wire.protocol import StreamMode

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from gridwatch.console.fleet.prometheus import PrometheusFleet
    from gridwatch.console.runtime.config import ClusterConfig, SummaryEvery
    from gridwatch.console.runtime.logfeed import LogFeed
    from gridwatch.console.runtime.scene_copy import SceneKeeper
    from gridwatch.playbooks.notify import Alertmanager
    from gridwatch.sshlink.hostlist import Endpoint



from gridwatch.console.runtime.config import read_secret
from gridwatch.console.runtime.core import ConsoleRuntime
from gridwatch.console.runtime.incidents import ExecutorActor, StoreIncidents, StoreProbe
from gridwatch.console.runtime.leader import EtcdAccess

# --------------------------------------------------------------------------- wiring


def etcd_access(config: ClusterConfig) -> EtcdAccess | None:
    """How this console logs in to etcd, from cluster.toml; ValueError in one line when the password cannot be read."""
    if config.etcd_user is None and config.etcd_ca is None and config.etcd_cert is None:
        return None
    password = ""
    if config.etcd_password_file is not None:
        try:
            password = read_secret(config.etcd_password_file)
        except ValueError as exc:
            raise ValueError(f"etcd_password_file: {exc}") from None
    return EtcdAccess(user=config.etcd_user or "", password=password, ca=config.etcd_ca, cert=config.etcd_cert,
                      key=config.etcd_key)


@dataclass(slots=True)
class RuntimeOptions:
    """The one typed config of a runtime: what ``gridwatch console`` and ``gridwatch demo`` build it from."""

    endpoints: list[Any]
    key_path: str
    known_hosts: str
    db_path: str | None = None
    read_only: bool = False
    operator: str = "operator"
    playbook_paths: list[str] = field(default_factory=list)
    scheduler: str = "none"  # none | slurm | kubernetes: what drain_node tells
    connect_timeout: float = 5.0
    backoff_max: float = 30.0  # longest wait between two tries to reach an agent
    resume_wait: float = 30.0  # how long resumed plans wait for the links to come up
    tick_interval: float = 0.5  # the engine's clock rules and the recovery check
    acting: bool = True  # False: incidents are made, no step that changes the job or a node is sent
    skip_playbooks: tuple[str, ...] = ()  # shipped playbooks left out, by name
    stop_wait: float = 0.0  # how long running plans may finish when the runtime stops
    etcd: list[str] = field(default_factory=list)  # etcd endpoints: consoles elect which one acts (leader.py)
    cluster: str = ""  # the name consoles share the lead under in etcd (default: derived from the node list)
    campaign: bool = True  # False: with etcd, watch until the operator takes over (an interactive console)
    lease_ttl: float = 5.0  # seconds the lead lasts unless renewed (every third of it)
    etcd_access: EtcdAccess | None = None  # etcd's user and password, client TLS (leader.EtcdAccess)
    alertmanager: str | None = None  # Alertmanager's base URL: every notify also pages there
    metrics: str | None = None  # HOST:PORT: the console serves its own /metrics there (gridwatch.console.runtime.metrics)
    # Seconds between a node's summaries (0: one per sample), or "auto": by the number of endpoints when the
    # fleet is built (gridwatch.console.runtime.config.summary_cadence). Open nodes send every sample; events come at once.
    summary_every: SummaryEvery = "auto"
    prometheus: str | None = None  # a Prometheus query API to read the fleet from too (agents' frames win)
    # Each relay -> the nodes it carries for this console on one link ([[relay]] in cluster.toml, --relay);
    # ``endpoints`` are then only the nodes linked directly. Checked: each node is reached one way.
    relays: dict[Endpoint, list[Endpoint]] = field(default_factory=dict)
    # The log store beside db_path (gridwatch.console.runtime.logfeed): events' lines, streamed lines, incidents'
    # windows. None: the defaults of cluster.toml's retention and store_max. No db_path (in memory): no store.
    keep_logs: bool = True
    log_retention_s: float | None = None
    log_store_max: int | None = None
    # Each captured scene is copied off its node into ``<db>.scenes`` before the plan's next step, at most this
    # many bytes of a node's bundle (None: cluster.toml's scene_max default). No db_path (in memory): not copied.
    scene_max: int | None = None

    @classmethod
    def from_cluster(cls, config: ClusterConfig, **overrides: Any) -> RuntimeOptions:
        """The runtime a cluster.toml describes; ``overrides`` are what a command line or the demo says instead.

        Raises ValueError with a one-line reason when the nodes, key or known_hosts cannot be used.
        """
        from gridwatch.sshlink.hostlist import HostlistError, parse_endpoints

        if "endpoints" not in overrides:
            try:
                # No direct nodes is a fleet when relays carry them all.
                direct = config.node_spec.strip() or not config.relay
                overrides["endpoints"] = parse_endpoints(config.node_spec) if direct else []
            except HostlistError as exc:
                raise ValueError(f"nodes: {exc}") from None
        if "relays" not in overrides:
            from gridwatch.console.runtime.config import relay_endpoints

            overrides["relays"] = relay_endpoints(config.relay, overrides["endpoints"])  # ValueError: relay[2].nodes: ...
        key = overrides.pop("key_path", None) or config.key
        known = overrides.pop("known_hosts", None) or config.known_hosts
        prometheus = overrides.get("prometheus") or getattr(config, "prometheus", None)
        # A fleet read from Prometheus alone talks to no agent: it needs no key.
        agents = bool(overrides["endpoints"]) or bool(overrides["relays"]) or not prometheus
        if not key and agents:
            raise ValueError("no key: give --key PATH (or key = ... in cluster.toml)")
        if not known and agents:
            raise ValueError("no known_hosts: give --known-hosts PATH (or known_hosts = ... in cluster.toml)")
        key, known = key or "", known or ""
        overrides.setdefault("prometheus", prometheus)
        base = cls(endpoints=overrides.pop("endpoints"), key_path=key, known_hosts=known, db_path=config.db,
                   read_only=config.read_only, operator=config.operator or getpass.getuser(),
                   playbook_paths=config.playbook_paths, scheduler=config.scheduler,
                   connect_timeout=config.connect_timeout, etcd=config.etcd_urls, alertmanager=config.alertmanager,
                   cluster=config.cluster or "", metrics=config.metrics, summary_every=config.summary_every,
                   etcd_access=etcd_access(config), log_retention_s=config.retention_s,
                   log_store_max=config.store_max_bytes, scene_max=config.scene_max_bytes)
        return dataclasses.replace(base, **overrides)


def build_runtime(options: RuntimeOptions, clock: Clock | None = None) -> ConsoleRuntime:
    """The real thing: fleet over SSH, SQLite incidents, the playbook engine and executor, in one runtime.

    Raises ValueError with a one-line reason when the database or a playbook cannot be used.
    """
    import sqlite3

    from gridwatch.console.runtime.config import summary_cadence
    from gridwatch.playbooks.engine import Engine as PlaybookEngine
    from gridwatch.playbooks.engine import agent_watches
    from gridwatch.playbooks.executor import Executor
    from gridwatch.playbooks.loader import load_with_builtin
    from gridwatch.playbooks.model import SCHEDULERS
    from gridwatch.playbooks.notify import DefaultNotifier
    from gridwatch.playbooks.store import IncidentStore, StoreError
    from gridwatch.sshlink.client import Fleet, FleetOptions

    if options.scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {options.scheduler!r}: use one of {', '.join(SCHEDULERS)}")
    clock = clock or SystemClock()
    store = StateStore(clock)
    result = load_with_builtin(options.playbook_paths, options.skip_playbooks)
    if not result.ok:
        raise ValueError(f"playbooks: {'; '.join(map(str, (*result.errors, *result.unreadable)))}")
    db_path = options.db_path or ":memory:"
    try:
        incident_store = IncidentStore(db_path, clock)
    except StoreError as exc:
        raise ValueError(str(exc)) from None
    except sqlite3.Error as exc:
        raise ValueError(f"cannot open the incident database {db_path}: {exc}") from None
    engine = PlaybookEngine(result.playbooks, clock)
    # A restarted console takes back its open incidents and guard memory, so it
    # does not act a second time on a fault it already handled.
    engine.seed_from(incident_store)
    runtime = ConsoleRuntime(store, incidents=StoreIncidents(incident_store), engine=engine,
                             plan_store=incident_store, read_only=options.read_only, operator=options.operator,
                             resume_wait=options.resume_wait, scheduler=options.scheduler, acting=options.acting,
                             tick_interval=options.tick_interval, stop_wait=options.stop_wait)
    incident_store.on_trouble = runtime.set_alert
    if incident_store.bad_rows:
        runtime.set_alert(f"{len(incident_store.bad_rows)} unreadable rows skipped in {db_path} "
                          f"(first: {incident_store.bad_rows[0]})")
    executor = Executor(incident_store, runtime, clock=clock, who=options.operator, probe=StoreProbe(store),
                        scheduler=options.scheduler, notifier=DefaultNotifier())
    runtime.executor = executor
    # A node is out of the job when its removal is done, not when it is planned (see Engine.step_finished).
    executor.on_step.append(engine.step_finished)
    executor.recheck = engine.no_longer_holds
    if options.alertmanager:
        page_through_alertmanager(runtime, options.alertmanager, clock)
    metrics = None
    if options.metrics:
        from gridwatch.console.runtime.metrics import serve_metrics

        metrics = serve_metrics(runtime, options.metrics)  # binds now: a taken port is a ValueError here
    if options.keep_logs and db_path != ":memory:":
        keep_log_store(runtime, options, db_path, metrics.registry if metrics is not None else None)
    if db_path != ":memory:":
        keep_scenes(runtime, options, db_path, metrics.registry if metrics is not None else None)
    runtime.actor = ExecutorActor(executor, incident_store)
    relayed = [node for nodes in options.relays.values() for node in nodes]
    fleet_options = FleetOptions(key_path=options.key_path, known_hosts=options.known_hosts,
                                 connect_timeout=options.connect_timeout, backoff_max=options.backoff_max,
                                 # Summaries, full samples for open nodes; the agents evaluate the
                                 # playbooks' per-GPU metric conditions themselves.
                                 mode=StreamMode.SUMMARY,
                                 # "auto" goes by every node the console watches, direct and relayed.
                                 summary_every=summary_cadence(options.summary_every,
                                                               len(options.endpoints) + len(relayed)),
                                 watches=agent_watches(result.playbooks))
    if options.endpoints or options.relays or not options.prometheus:
        runtime.fleet = Fleet(options.endpoints, fleet_options, runtime.on_frame, runtime.on_status,
                              relays=options.relays, on_relay=runtime.on_relay)
    if options.etcd:
        from gridwatch.console.runtime.leader import attach_election

        attach_election(runtime, options)
    if options.prometheus:
        read_fleet_from_prometheus(runtime, options.prometheus)
    for endpoint in (*options.endpoints, *relayed):
        store.set_link(str(endpoint), "connecting")
    return runtime


def keep_log_store(runtime: ConsoleRuntime, options: RuntimeOptions, db_path: str,
                   registry: CollectorRegistry | None = None) -> LogFeed:
    """``runtime`` keeps its lines in the log store beside ``db_path``; ValueError in one line when it cannot be opened."""
    from gridwatch.console.runtime.config import DEFAULT_RETENTION, DEFAULT_STORE_MAX, parse_retention, parse_size
    from gridwatch.console.runtime.logfeed import keep_logs
    from gridwatch.console.runtime.logstore import LogStore, LogStoreError, store_path_for

    retention = options.log_retention_s if options.log_retention_s is not None else parse_retention(DEFAULT_RETENTION)
    most = options.log_store_max if options.log_store_max is not None else parse_size(DEFAULT_STORE_MAX)
    try:
        store = LogStore(store_path_for(db_path), retention_s=retention, max_bytes=most)
    except LogStoreError as exc:
        raise ValueError(str(exc)) from None
    return keep_logs(runtime, store, registry)


def keep_scenes(runtime: ConsoleRuntime, options: RuntimeOptions, db_path: str,
                registry: CollectorRegistry | None = None) -> SceneKeeper:
    """``runtime`` copies each scene its plans capture into ``<db>.scenes`` before the plan's next step, and
    prunes that store by cluster.toml's ``retention`` and ``store_max`` (an open incident's scenes stay)."""
    from gridwatch.console.runtime.config import (
        DEFAULT_RETENTION,
        DEFAULT_SCENE_MAX,
        DEFAULT_STORE_MAX,
        parse_retention,
        parse_size,
    )
    from gridwatch.console.runtime.scene_copy import SceneKeeper
    from gridwatch.console.runtime.scene_retention import keep_scene_retention
    from gridwatch.console.runtime.scene_store import scenes_path_for

    most = options.scene_max if options.scene_max is not None else parse_size(DEFAULT_SCENE_MAX)
    root = scenes_path_for(db_path)
    runtime.scenes = SceneKeeper(root, runtime.read_scene, most)
    retention = options.log_retention_s if options.log_retention_s is not None else parse_retention(DEFAULT_RETENTION)
    store_max = options.log_store_max if options.log_store_max is not None else parse_size(DEFAULT_STORE_MAX)
    keep_scene_retention(runtime, root, retention, store_max, registry)
    return runtime.scenes


def read_fleet_from_prometheus(runtime: ConsoleRuntime, url: str, **options: Any) -> PrometheusFleet:
    """Fill ``runtime``'s store (and feed its engine) from the Prometheus query API at ``url`` too.

    ``options`` are :class:`gridwatch.console.fleet.prometheus.PrometheusOptions` fields (interval, timeout...).
    Raises ValueError in one sentence when ``url`` is not an http(s) address.
    """
    from gridwatch.console.fleet.prometheus import PrometheusFleet, PrometheusOptions

    engine = runtime.engine
    try:
        fleet = PrometheusFleet(PrometheusOptions(url, **options), runtime.store, runtime.on_frame,
                                engine.observe if engine is not None else None)
    except ValueError as exc:
        raise ValueError(f"prometheus: {exc}") from None
    runtime.prometheus = fleet
    runtime.hooks.stopping.append(fleet.stop)
    return fleet


def page_through_alertmanager(runtime: ConsoleRuntime, url: str, clock: Clock | None = None) -> Alertmanager:
    """Every notify of ``runtime``'s playbooks also fires the incident's alert at ``url``; it resolves with the incident.

    Raises ValueError in one sentence when ``url`` is not an http(s) address.
    """
    from gridwatch.playbooks.notify import Alertmanager, DefaultNotifier

    said: list[str] = []

    def trouble(line: str | None) -> None:
        # Clear only the alert this raised: the incident store's own alert stays.
        if line is not None or (said and runtime.alert == said[-1]):
            runtime.set_alert(line)
        said[:] = [line] if line else []

    try:
        alerts = Alertmanager(url, clock or runtime.store.clock, on_trouble=trouble)
    except ValueError as exc:
        raise ValueError(f"alertmanager: {exc}") from None
    notifier = getattr(runtime.executor, "notifier", None)
    if isinstance(notifier, DefaultNotifier):
        notifier.alertmanager = alerts
    runtime.hooks.recovered.append(lambda row: alerts.resolve(row.id))
    runtime.hooks.resolved.append(alerts.resolve)
    runtime.hooks.stopping.append(alerts.close)
    runtime.alertmanager = alerts
    return alerts
