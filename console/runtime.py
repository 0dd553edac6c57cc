"""The console's runtime: the fleet feeding the state store, and the incidents it shows and acts on.

The Textual app and ``gridwatch console --headless`` both run one of these. The
fleet, the incident store and the playbook engine are optional so that the UI
can be driven by synthetic frames in tests.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from loguru import logger

from agents.protocol import ActionResult, Frame, LogLine, Text
from console.state import CheckVerdict, Clock, PreflightResult, StateStore, SystemClock


# ------------------------------------------------------------------------ incidents


@dataclass(slots=True)
class AuditEntry:
    """One line of an incident's audit trail: who did what, why, and how it went."""

    at: float
    who: str
    what: str
    why: str = ""
    outcome: str = ""


@dataclass(slots=True)
class IncidentRow:
    """An incident as the Incidents view shows it."""

    id: str
    severity: str
    node: str
    title: str
    state: str  # open | acknowledged | silenced | resolved
    detected_at: float
    playbook: str | None = None
    plan: list[str] = field(default_factory=list)
    acted_at: float | None = None
    recovered_at: float | None = None
    silenced_until: float | None = None
    audit: list[AuditEntry] = field(default_factory=list)


class IncidentBackend(Protocol):
    """What the Incidents view needs from the incident store (SQLite in production)."""

    def incidents(self, limit: int = 200) -> list[IncidentRow]: ...

    def detail(self, incident_id: str) -> IncidentRow | None:
        """One incident with its plan and audit trail filled in (the list leaves them empty)."""
        ...

    def acknowledge(self, incident_id: str, who: str, why: str) -> None: ...

    def silence(self, incident_id: str, until: float, who: str, why: str) -> None: ...


class IncidentActor(Protocol):
    """Runs an incident's plan (the playbook executor)."""

    async def act(self, incident_id: str, who: str, why: str) -> str: ...


class MemoryIncidents:
    """An in-memory incident store with the same interface, for tests and a console without a database."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or SystemClock()
        self.rows: dict[str, IncidentRow] = {}

    def add(self, row: IncidentRow) -> None:
        self.rows[row.id] = row

    def incidents(self, limit: int = 200) -> list[IncidentRow]:
        now = self.clock.now()
        for row in self.rows.values():
            if row.state == "silenced" and row.silenced_until is not None and row.silenced_until <= now:
                row.state = "open"
        order = sorted(self.rows.values(), key=lambda r: (r.state == "resolved", -r.detected_at))
        return order[:limit]

    def detail(self, incident_id: str) -> IncidentRow | None:
        return self.rows.get(incident_id)

    def acknowledge(self, incident_id: str, who: str, why: str) -> None:
        row = self.rows[incident_id]
        row.state = "acknowledged"
        row.audit.append(AuditEntry(self.clock.now(), who, "acknowledge", why, "ok"))

    def silence(self, incident_id: str, until: float, who: str, why: str) -> None:
        row = self.rows[incident_id]
        row.state = "silenced"
        row.silenced_until = until
        row.audit.append(AuditEntry(self.clock.now(), who, f"silence until {until:.0f}", why, "ok"))


class StoreIncidents:
    """The Incidents view's interface over the playbooks' SQLite store (``playbooks.store.IncidentStore``)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def _row(self, rec: Any) -> IncidentRow:
        return IncidentRow(id=rec.id, severity=rec.severity, node=rec.node, title=rec.summary, state=rec.state,
                           detected_at=rec.detected_at, playbook=rec.playbook, acted_at=rec.acted_at,
                           recovered_at=rec.recovered_at, silenced_until=rec.silenced_until)

    def incidents(self, limit: int = 200) -> list[IncidentRow]:
        rows = [self._row(rec) for rec in self.store.incidents(limit=limit)]
        # Open first, then newest: what needs the operator is on top.
        order = {"open": 0, "acknowledged": 1, "silenced": 2, "resolved": 3}
        return sorted(rows, key=lambda r: (order.get(r.state, 0), -r.detected_at))

    def detail(self, incident_id: str) -> IncidentRow | None:
        rec = self.store.incident(incident_id)
        if rec is None:
            return None
        row = self._row(rec)
        row.plan = [f"{s.step} {s.target}: {s.state}" + (f" ({s.outcome})" if s.outcome else "")
                    for s in self.store.steps(incident_id)]
        row.audit = [AuditEntry(a.ts, a.who, a.what, a.why, a.outcome) for a in self.store.audit_log(incident_id)]
        return row

    def acknowledge(self, incident_id: str, who: str, why: str) -> None:
        self.store.acknowledge(incident_id, who, why)

    def silence(self, incident_id: str, until: float, who: str, why: str) -> None:
        self.store.silence(incident_id, who, until, why)


class ExecutorActor:
    """Acting on an incident = confirming the step of its plan that waits for an operator."""

    def __init__(self, executor: Any, store: Any) -> None:
        self.executor = executor
        self.store = store

    async def act(self, incident_id: str, who: str, why: str) -> str:
        waiting = [s for s in self.store.steps(incident_id) if s.state == "awaiting_confirmation"]
        if not waiting:
            return "nothing in its plan is waiting for confirmation"
        records = await self.executor.confirm(waiting[0].id, who)
        done = sum(1 for r in records if r.state == "done")
        return f"confirmed {waiting[0].step}; {done} of {len(records)} steps done"


class StoreProbe:
    """Answers the executor's ``wait_for`` conditions from the console's state store."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._checkpoint_base: dict[str, int] = {}

    def holds(self, condition: str, node: str) -> bool:
        state = self.store.by_name(node)
        if condition == "heartbeat":
            return state is not None and str(self.store.status(state)) == "ok"
        if condition == "isolated":
            return state is not None and state.isolated
        trainer = state.trainer if state is not None else None
        if trainer is None:
            summary = self.store.training()  # "job" or a node without a trainer: the run as a whole
            trainer = summary.status if summary else None
        if trainer is None:
            return False
        if condition == "training":
            return str(trainer.phase) == "training"
        if condition == "checkpoint":
            # A checkpoint newer than the one there was when the wait began.
            newest = max(trainer.checkpoints.values(), default=-1)
            base = self._checkpoint_base.setdefault(node, newest)
            return newest > base
        return False


# --------------------------------------------------------------------------- runtime


class FleetLike(Protocol):
    """The parts of ``console.fleet.Fleet`` the console uses."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def action(self, node: str, action: str, args: dict | None = None, reason: str = "",
                     timeout: float = 30.0) -> ActionResult: ...

    async def search(self, pattern: str, nodes: list[str] | None = None, since: float | None = None,
                     until: float | None = None, limit: int = 500,
                     on_progress: Callable[[int, int], None] | None = None) -> list[LogLine]: ...

    def subscribe_logs(self, node: str, on: bool) -> None: ...


class Engine(Protocol):
    """The playbook engine (``playbooks.engine.Engine``): frames and time in, plans out.

    An object with ``feed(node, frame)`` instead (``console.supervise.Supervisor``,
    which ticks the engine and runs plans itself) is accepted too.
    """

    def observe(self, source: str, frame: Frame) -> list[Any]: ...

    def tick(self, now: float | None = None) -> list[Any]: ...


class PlanRunner(Protocol):
    """The playbook executor (``playbooks.executor.Executor``)."""

    async def run(self, plan: Any) -> list[Any]: ...


# How often writes the incident database refused are tried again.
STORE_RETRY_S = 5.0


class ConsoleRuntime:
    """Fleet -> store (+ engine); the operator's actions out, each with who and why."""

    def __init__(
        self,
        store: StateStore | None = None,
        *,
        fleet: FleetLike | None = None,
        incidents: IncidentBackend | None = None,
        actor: IncidentActor | None = None,
        engine: Engine | None = None,
        executor: PlanRunner | None = None,
        plan_store: Any = None,
        read_only: bool = False,
        operator: str = "operator",
        resume_wait: float = 30.0,
    ) -> None:
        self.store = store or StateStore()
        self.fleet = fleet
        self.incidents = incidents
        self.actor = actor
        self.engine = engine
        self.executor = executor
        self.plan_store = plan_store  # where plans are recorded when nothing may act on them
        self._tasks: set[asyncio.Task[Any]] = set()
        self._log_refs: Counter[str] = Counter()
        self.read_only_flag = read_only
        self.operator = operator
        # A resumed plan waits (at most this long) until every link has tried once,
        # so its steps go to connected agents, not to links still dialling.
        self.resume_wait = resume_wait
        self._tried: set[str] = set()  # links that have been past "connecting" at least once
        self._links_tried = asyncio.Event()
        # What the operator must know now and no node told us (the incident database
        # cannot be written, say); the status line shows it, a headless console prints it.
        self.alert: str | None = None
        self.store_retry_every = STORE_RETRY_S
        self._store_retried = 0.0

    # Callbacks the fleet calls; they must stay cheap (O(frame)): the UI reads on its own tick.
    def on_frame(self, link: Any, frame: Frame) -> None:
        key = str(link.endpoint)
        self.store.apply(frame, key)
        if self.engine is not None:
            try:
                feed = getattr(self.engine, "feed", None)
                if feed is not None:
                    feed(key, frame)
                    return
                plans = self.engine.observe(key, frame)
            except Exception:  # noqa: BLE001 - one bad frame must not stop the stream
                logger.bind(node=key).exception("playbook engine failed on a frame")
                return
            self._run_plans(plans)

    def set_alert(self, text: str | None) -> None:
        """Raise (or, with None, clear) the console's alert; the incident store calls it when its disk fails."""
        self.alert = text
        self.store.generation += 1

    def retry_store(self, force: bool = False) -> None:
        """Try again to write what the incident database refused (every ``store_retry_every`` seconds)."""
        held = getattr(self.plan_store, "held", 0)
        now = self.store.clock.now()
        if not held or (not force and now - self._store_retried < self.store_retry_every):
            return
        self._store_retried = now
        try:
            self.plan_store.retry()
        except Exception:  # noqa: BLE001 - the console keeps going; the log says why
            logger.exception("writing the held incident records failed")

    def tick_engine(self) -> None:
        """Time-based rules (heartbeat lost, ``for:`` windows); the app and the headless loop call it each tick."""
        self.retry_store()
        if self.engine is None or hasattr(self.engine, "feed"):
            return  # a supervisor ticks its engine itself
        try:
            plans = self.engine.tick(self.store.clock.now())
        except Exception:  # noqa: BLE001 - the console keeps going; the log says why
            logger.exception("playbook engine tick failed")
            return
        self._run_plans(plans)

    def _run_plans(self, plans: list[Any]) -> None:
        for plan in plans:
            if self.executor is not None and not self.read_only:
                task = asyncio.get_running_loop().create_task(self._run_plan(plan))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif self.plan_store is not None:
                # Read-only: the incident is recorded and shown; nothing acts on it.
                self.plan_store.save_plan(plan)

    async def _run_plan(self, plan: Any) -> None:
        assert self.executor is not None
        try:
            await self.executor.run(plan)
        except Exception:  # noqa: BLE001 - recorded by the executor; one plan never stops the console
            logger.bind(node=str(getattr(plan.incident, "node", ""))).exception("plan failed")

    async def act(self, node: str, action: str, args: dict[str, Any], reason: str) -> ActionResult:
        """The executor's action sink: the same path, and the same read-only check, as the operator's."""
        return await self.node_action(node, action, reason, args)

    def on_status(self, link: Any) -> None:
        hello_name = str(link.hello.node) if getattr(link, "hello", None) is not None else None
        self.store.set_link(
            str(link.endpoint), str(link.state), name=hello_name or link.name, error=link.last_error, role=link.role,
            foreign_frames=link.foreign_frames,
        )
        if str(link.state) != "connecting":
            self._tried.add(str(link.endpoint))
            if self._all_tried():
                self._links_tried.set()

    def _all_tried(self) -> bool:
        links = getattr(self.fleet, "links", None)
        return not links or all(str(ep) in self._tried for ep in links)

    @property
    def read_only(self) -> bool:
        """Read-only when configured so, or when every agent heard from gave this console only the viewer role.

        Links not heard from yet decide nothing: right after a start no agent
        has said hello, and a console configured to act must still act then.
        """
        if self.read_only_flag:
            return True
        roles = [node.role for node in self.store.nodes.values() if node.role]
        return bool(roles) and "operator" not in roles

    async def start(self) -> None:
        if self.fleet is not None:
            await self.fleet.start()
        resume = getattr(self.executor, "resume", None)
        if resume is not None and not self.read_only_flag:
            # Plans a previous console left half-done carry on (steps already run are not repeated).
            task = asyncio.get_running_loop().create_task(self._resume(resume))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _resume(self, resume: Callable[[], Any]) -> None:
        if not self._all_tried():
            try:
                await asyncio.wait_for(self._links_tried.wait(), self.resume_wait)
            except TimeoutError:
                links = getattr(self.fleet, "links", {})
                logger.warning("resuming unfinished plans with {} of {} links tried after {:g} s",
                               len(self._tried), len(links), self.resume_wait)
        try:
            resumed = await resume()
            if resumed:
                logger.info("resumed {} unfinished plans", len(resumed))
        except Exception:  # noqa: BLE001 - the console keeps going; the log says why
            logger.exception("resuming unfinished plans failed")

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.fleet is not None:
            await self.fleet.stop()
        self.retry_store(force=True)  # a last try for records the disk refused
        if getattr(self.plan_store, "held", 0):
            logger.error("{} incident records could not be written before stopping: {}",
                         self.plan_store.held, self.alert)

    def subscribe_logs(self, node: str, on: bool) -> None:
        """Counted: the node view and the logs view may both want a node's lines; the last one out stops them."""
        before = self._log_refs[node]
        self._log_refs[node] = max(before + (1 if on else -1), 0)
        after = self._log_refs[node]
        if (before == 0) == (after == 0):
            return
        state = self.store.by_name(node)
        if state is not None:
            state.logs_subscribed = after > 0
        if self.fleet is not None:
            self.fleet.subscribe_logs(node, after > 0)

    async def node_action(self, node: str, action: str, reason: str, args: dict | None = None) -> ActionResult:
        """Send an operator action to one node; refused here when read-only."""
        if self.read_only:
            return _refused(node, action, "this console is read-only")
        if self.fleet is None:
            return _refused(node, action, "no fleet connected")
        logger.bind(node=node).info("action {} by {}: {}", action, self.operator, reason)
        try:
            return await self.fleet.action(node, action, args or {}, reason=reason)
        except Exception as exc:  # noqa: BLE001 - the operator sees why, the screen keeps going
            return _refused(node, action, f"{type(exc).__name__}: {exc}")

    async def search(self, pattern: str, nodes: list[str] | None, since: float | None, until: float | None,
                     on_progress: Callable[[int, int], None] | None = None) -> list[LogLine]:
        if self.fleet is None:
            return []
        return await self.fleet.search(pattern, nodes, since, until, on_progress=on_progress)

    async def preflight(self, nodes: list[str] | None = None,
                        on_progress: Callable[[int, int], None] | None = None) -> Any:
        """Pre-flight the connected nodes (those in ``nodes`` when given) and keep each result in the store.

        Read-only is fine: the checks change nothing on a node. Returns the
        ``console.preflight.PreflightReport``; ValueError when no connected node matches.
        """
        from console.preflight import PreflightOptions, preflight_fleet

        if self.fleet is None or not hasattr(self.fleet, "links"):
            raise ValueError("no fleet connected")
        view = _ConnectedLinks(self.fleet, nodes)
        if not view.links:
            raise ValueError("no connected node matches" + (f" {', '.join(nodes)}" if nodes else ""))
        # The all-reduce test would start torch on every node: the console's check stays light.
        report = await preflight_fleet(view, PreflightOptions(comm=False, on_progress=on_progress))
        now = self.store.clock.now()
        for node in report.nodes:
            checks = [CheckVerdict(name, check.ok, check.detail) for name, check in node.checks.items()]
            self.store.set_preflight(node.endpoint, PreflightResult(now, node.ok, checks, node.error))
        return report

    def acknowledge(self, incident_id: str, why: str) -> None:
        self._check_changes("acknowledge")
        assert self.incidents is not None
        self.incidents.acknowledge(incident_id, self.operator, why)

    def silence(self, incident_id: str, seconds: float, why: str) -> None:
        self._check_changes("silence")
        assert self.incidents is not None
        self.incidents.silence(incident_id, self.store.clock.now() + seconds, self.operator, why)

    async def act_on_incident(self, incident_id: str, why: str) -> str:
        self._check_changes("act")
        if self.actor is None:
            return "no playbook executor is attached to this console"
        return await self.actor.act(incident_id, self.operator, why)

    def _check_changes(self, what: str) -> None:
        if self.read_only:
            raise PermissionError(f"cannot {what}: this console is read-only")
        if self.incidents is None and what != "act":
            raise PermissionError(f"cannot {what}: no incident store is attached")


class _ConnectedLinks:
    """The fleet seen through a node set: only connected links, the rest of the fleet as it is."""

    def __init__(self, fleet: Any, nodes: list[str] | None) -> None:
        self._fleet = fleet
        wanted = set(nodes) if nodes else None
        self.links = {
            ep: link for ep, link in fleet.links.items()
            if str(link.state) in ("connected", "stale")
            and (wanted is None or link.name in wanted or str(ep) in wanted)
        }

    @property
    def on_status(self) -> Callable[[Any], None]:
        return self._fleet.on_status

    @on_status.setter
    def on_status(self, callback: Callable[[Any], None]) -> None:
        self._fleet.on_status = callback

    async def action(self, node: str, action: str, args: dict | None = None, reason: str = "",
                     timeout: float = 30.0) -> ActionResult:
        return await self._fleet.action(node, action, args, reason=reason, timeout=timeout)


def _refused(node: str, action: str, message: str) -> ActionResult:
    return ActionResult(id=Text(uuid.uuid4().hex[:8]), action=Text(action), ok=False, message=Text(message),
                        node=Text(node))



# --------------------------------------------------------------------------- wiring


@dataclass(slots=True)
class RuntimeOptions:
    """Everything ``gridwatch console`` needs to build a runtime."""

    endpoints: list[Any]
    key_path: str
    known_hosts: str
    db_path: str | None = None
    read_only: bool = False
    operator: str = "operator"
    playbook_paths: list[str] = field(default_factory=list)
    connect_timeout: float = 5.0
    resume_wait: float = 30.0  # how long resumed plans wait for the links to come up


def build_runtime(options: RuntimeOptions, clock: Clock | None = None) -> ConsoleRuntime:
    """The real thing: fleet over SSH, SQLite incidents, the playbook engine and executor.

    Raises ValueError with a one-line reason when the database or a playbook cannot be used.
    """
    import sqlite3

    from console.fleet import Fleet, FleetOptions
    from playbooks.engine import Engine as PlaybookEngine
    from playbooks.executor import Executor
    from playbooks.loader import load, load_builtin
    from playbooks.store import IncidentStore, StoreError

    clock = clock or SystemClock()
    store = StateStore(clock)
    playbooks = list(load_builtin())
    if options.playbook_paths:
        result = load(options.playbook_paths)
        if not result.ok:
            raise ValueError(f"playbooks: {'; '.join(map(str, (*result.errors, *result.unreadable)))}")
        playbooks.extend(result.playbooks)
    db_path = options.db_path or ":memory:"
    try:
        incident_store = IncidentStore(db_path, clock)
    except StoreError as exc:
        raise ValueError(str(exc)) from None
    except sqlite3.Error as exc:
        raise ValueError(f"cannot open the incident database {db_path}: {exc}") from None
    engine = PlaybookEngine(playbooks, clock)
    # A restarted console takes back its open incidents and guard memory, so it
    # does not act a second time on a fault it already handled.
    engine.seed_from(incident_store)
    runtime = ConsoleRuntime(store, incidents=StoreIncidents(incident_store), engine=engine,
                             plan_store=incident_store, read_only=options.read_only, operator=options.operator,
                             resume_wait=options.resume_wait)
    incident_store.on_trouble = runtime.set_alert
    if incident_store.bad_rows:
        runtime.set_alert(f"{len(incident_store.bad_rows)} unreadable rows skipped in {db_path} "
                          f"(first: {incident_store.bad_rows[0]})")
    executor = Executor(incident_store, runtime, clock=clock, who=options.operator, probe=StoreProbe(store))
    runtime.executor = executor
    runtime.actor = ExecutorActor(executor, incident_store)
    fleet_options = FleetOptions(key_path=options.key_path, known_hosts=options.known_hosts,
                                 connect_timeout=options.connect_timeout)
    runtime.fleet = Fleet(options.endpoints, fleet_options, runtime.on_frame, runtime.on_status)
    for endpoint in options.endpoints:
        store.set_link(str(endpoint), "connecting")
    return runtime
