"""The one engine host: the fleet feeding the state store and the playbook engine, plans run, the loop closed.

``build_runtime`` makes it from one typed config (:class:`RuntimeOptions`);
the Textual console, ``gridwatch console --headless`` and ``gridwatch demo``
all run it. Closing the loop is part of it: a restart that meets a job in the
middle of re-forming is sent again (``actions.py``), an incident is marked recovered once the
job trains past the step it was at when the fault came, and each incident
keeps its time to detect and to recover (``recoveries.py``). The fleet, the incident store and the
engine are optional so that the UI can be driven by synthetic frames in tests.

:class:`ConsoleRuntime` puts its parts together, one job each: ``base.py`` (the state they share),
``frames.py`` (frames in), ``plans.py`` (plans launched), ``recoveries.py`` and ``actions.py``
(actions out). Here: its constructor, starting and stopping, and the fleet's reads (logs, search, pre-flight).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from loguru import logger

from gridwatch.console.fleet.goodput_tracker import GoodputTracker
from gridwatch.console.fleet.node import CheckVerdict, PreflightResult
from gridwatch.console.fleet.state import StateStore
from gridwatch.console.runtime.actions import Acting
from gridwatch.console.runtime.base import FleetLike, PlanRunner, RuntimeHooks
from gridwatch.console.runtime.collector import CollectorBaseline
from gridwatch.console.runtime.frames import Observing
from gridwatch.console.runtime.hangs import HangWatch
from gridwatch.console.runtime.incidents import IncidentActor, IncidentBackend
from gridwatch.console.runtime.recoveries import _Recovery
from gridwatch.wire.protocol import ActionResult, LogLine

if TYPE_CHECKING:
    from gridwatch.console.fleet.prometheus import PrometheusFleet
    from gridwatch.console.runtime.leader import Election
    from gridwatch.console.runtime.scene_copy import SceneKeeper
    from gridwatch.playbooks.engine import Engine
    from gridwatch.playbooks.notify import Alertmanager

# How often writes the incident database refused are tried again.
STORE_RETRY_S = 5.0
# Event and log frames remembered for naming the time of the fault behind a new incident.
_SYMPTOM_MEMORY = 1024


class ConsoleRuntime(Observing, Acting):
    """Fleet -> store + engine -> plans run -> actions out, each with who and why; and the loop closed."""

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
        scheduler: str = "none",
        acting: bool = True,
        tick_interval: float = 0.5,
        action_timeout: float = 30.0,
        trainer_wait: float = 30.0,
        retry_every: float = 0.5,
        stop_wait: float = 0.0,
    ) -> None:
        self.store = store or StateStore()
        self.fleet = fleet
        self.incidents = incidents
        self.actor = actor
        self.engine = engine
        self.executor = executor
        self.plan_store = plan_store  # the incident store: plans, faults, recoveries and the audit log
        self.read_only_flag = read_only
        self.operator = operator
        self.scheduler = scheduler  # what the executor's drain_node tells; the node view says so
        self.acting = acting  # False: plans run, but no step that changes the job or a node is sent
        self.tick_interval = tick_interval  # the engine's clock rules, once started
        self.action_timeout = action_timeout
        # A restart sent while the job re-forms finds no trainer on the node for a
        # second or more; it is sent again every ``retry_every`` for ``trainer_wait``.
        self.trainer_wait = trainer_wait
        self.retry_every = retry_every
        self.stop_wait = stop_wait  # how long running plans may finish when the runtime stops
        self.hooks = RuntimeHooks()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._plans: set[asyncio.Task[Any]] = set()
        self._ticker: asyncio.Task[None] | None = None
        self._started = self._stopped = False
        self._log_refs: Counter[str] = Counter()
        # A resumed plan waits (at most this long) until every link has tried once,
        # so its steps go to connected agents, not to links still dialling.
        self.resume_wait = resume_wait
        self._tried: set[str] = set()  # links that have been past "connecting" at least once
        self._links_tried = asyncio.Event()
        self._up: set[str] = set()  # links connected now
        self.relays_down: dict[str, str] = {}  # relay "host:port" -> why, for as long as it is down
        self.collector = CollectorBaseline(clock=time.monotonic)
        # What the operator must know now and no node told us (the incident database
        # cannot be written, say); the status line shows it, a headless console prints it.
        self.alert: str | None = None
        self.store_retry_every = STORE_RETRY_S
        self._store_retried = 0.0
        # (engine time before, after, the frame's own time) of recent event and log frames.
        self._symptoms: deque[tuple[float, float, float]] = deque(maxlen=_SYMPTOM_MEMORY)
        self._recoveries: dict[str, _Recovery] = {}
        # Where the job's time went (goodput and its losses), from the trainer statuses and the incidents.
        self.goodput = GoodputTracker(self.store.clock, incidents=self.incident_spans)
        self.hooks.recovered.append(self._record_cost)
        self.alertmanager: Alertmanager | None = None  # set when paging through Alertmanager is configured
        # Which of several consoles acts (console/runtime/leader.py); None: this console alone, its own leader.
        self.election: Election | None = None
        self.prometheus: PrometheusFleet | None = None  # set when the fleet is also read from Prometheus
        self.hangs = HangWatch(self)  # which rank is stuck: records read when a job hangs, verdicts to the engine
        self.scenes: SceneKeeper | None = None  # set when captured scenes are copied off the nodes (wiring.keep_scenes)

    def set_alert(self, text: str | None) -> None:
        """Raise (or, with None, clear) the console's alert; the incident store calls it when its disk fails."""
        self.alert = text
        self.store.generation += 1
        self.store.news += 1
        for hook in self.hooks.alert:
            hook(text)

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Connect, tick the engine, and carry on what a previous console left half-done (once; later calls do nothing)."""
        if self._started:
            return
        self._started = True
        for starting in self.hooks.starting:
            await starting()
        if self.fleet is not None:
            await self.fleet.start()
        if self.prometheus is not None:
            await self.prometheus.start()
        if self.engine is not None and self.tick_interval > 0:
            self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())
        self._rewatch()
        if self.election is not None:
            # Plans are carried on when (and each time) this console wins the lead: see take_lead.
            from gridwatch.console.runtime.leader import follow

            self.spawn(follow(self, self.election))
        elif self.executor is not None and not self.read_only_flag:
            # Plans a previous console left half-done carry on (steps already run are not repeated).
            self.resume_plans()

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` beside the runtime; it is awaited (or cancelled) when the runtime stops."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def resume_plans(self) -> None:
        """Carry on every stored plan with steps left, once the links were tried (a restart, a new lead)."""
        if self.executor is not None:
            self.spawn(self._resume(self.executor.resume))

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
            for incident_id in resumed or ():
                self.settle(incident_id)
        except Exception:  # noqa: BLE001 - the console keeps going; the log says why
            logger.exception("resuming unfinished plans failed")

    async def stop(self, wait: float | None = None) -> None:
        """Stop ticking, give running plans ``wait`` seconds (default ``stop_wait``), then cancel them and disconnect."""
        if self._stopped:
            return
        self._stopped = True
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        wait = self.stop_wait if wait is None else wait
        if self._plans and wait > 0:
            await asyncio.wait(set(self._plans), timeout=wait)
        pending = [*self._plans, *self._tasks]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self.hangs.stop()
        if self.executor is not None:
            await self.executor.close()  # pending drain retries stop; they stay pending in the store for the next console
        if self.fleet is not None:
            await self.fleet.stop()
        for stopping in self.hooks.stopping:
            await stopping()
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

    async def search(self, pattern: str, nodes: list[str] | None, since: float | None, until: float | None,
                     on_progress: Callable[[int, int], None] | None = None) -> list[LogLine]:
        if self.fleet is None:
            return []
        return await self.fleet.search(pattern, nodes, since, until, on_progress=on_progress)

    async def preflight(self, nodes: list[str] | None = None,
                        on_progress: Callable[[int, int], None] | None = None) -> Any:
        """Pre-flight the connected nodes (those in ``nodes`` when given) and keep each result in the store.

        Read-only is fine: the checks change nothing on a node. Returns the
        ``gridwatch.console.fleet.preflight.PreflightReport``; ValueError when no connected node matches.
        """
        from gridwatch.console.fleet.preflight import PreflightOptions, preflight_fleet

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
