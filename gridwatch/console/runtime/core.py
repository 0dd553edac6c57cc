"""The one engine host: the fleet feeding the state store and the playbook engine, plans run, the loop closed.

``build_runtime`` makes it from one typed config (:class:`RuntimeOptions`);
the Textual console, ``gridwatch console --headless`` and ``gridwatch demo``
all run it. Closing the loop lives here: a restart that meets a job in the
middle of re-forming is sent again, an incident is marked recovered once the
job trains past the step it was at when the fault came, and each incident
keeps its time to detect and to recover. The fleet, the incident store and the
engine are optional so that the UI can be driven by synthetic frames in tests.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from loguru import logger

from gridwatch.console.fleet.goodput import IncidentSpan
from gridwatch.console.fleet.goodput_tracker import GoodputTracker
from gridwatch.console.fleet.node import CheckVerdict, PreflightResult
from gridwatch.console.fleet.state import StateStore
from gridwatch.console.runtime.collector import CollectorBaseline
from gridwatch.console.runtime.hangs import HangWatch
from gridwatch.console.runtime.incidents import IncidentActor, IncidentBackend, IncidentRow, StoreIncidents
from gridwatch.playbooks.model import MetricTrigger
from gridwatch.wire.protocol import (
    ActionResult,
    AgentAction,
    Event,
    Frame,
    LogLine,
    ResultCode,
    Sample,
    Summary,
    Text,
    fault_time,
)

if TYPE_CHECKING:
    from gridwatch.console.fleet.prometheus import PrometheusFleet
    from gridwatch.console.runtime.leader import Election
    from gridwatch.playbooks.blame_collectives import CollectiveVerdict
    from gridwatch.playbooks.engine import Engine
    from gridwatch.playbooks.notify import Alertmanager
    from gridwatch.playbooks.plans import Incident, Plan


# --------------------------------------------------------------------------- runtime


class FleetLike(Protocol):
    """The parts of ``gridwatch.sshlink.client.Fleet`` the console uses."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def action(self, node: str, action: str, args: dict | None = None, reason: str = "",
                     timeout: float = 30.0, fence: int | None = None, key: str | None = None) -> ActionResult: ...

    async def search(self, pattern: str, nodes: list[str] | None = None, since: float | None = None,
                     until: float | None = None, limit: int = 500,
                     on_progress: Callable[[int, int], None] | None = None) -> list[LogLine]: ...

    def subscribe_logs(self, node: str, on: bool) -> None: ...


class PlanRunner(Protocol):
    """The playbook executor (``gridwatch.playbooks.executor.Executor``)."""

    async def run(self, plan: Any) -> list[Any]: ...

    async def resume(self) -> list[str]: ...

    async def return_to_service(self, node: str, who: str, reason: str) -> str: ...

    async def close(self) -> None: ...


# Agent actions that change the job or the node; a watch-only runtime (a baseline run) does not send these.
ACTING_ACTIONS: frozenset[str] = frozenset(
    {AgentAction.ISOLATE, AgentAction.CHECKPOINT_NOW, AgentAction.PAUSE, AgentAction.RESTART_FROM, AgentAction.LEAVE}
)
# A tick later than this behind its time: the console's own loop was stalled (see _tick_forever).
LOOP_STALL_S = 0.2
# How often writes the incident database refused are tried again.
STORE_RETRY_S = 5.0
# Event and log frames remembered for naming the time of the fault behind a new incident.
_SYMPTOM_MEMORY = 1024
# A node's own time for a fault is believed only this close before the console saw it (clocks drift).
_FAULT_SKEW_S = 300.0
# Plan steps still to come: an incident in this state has not settled yet.
_UNSETTLED = frozenset({"planned", "running", "awaiting_confirmation"})


@dataclass(slots=True)
class RuntimeHooks:
    """Who else hears what the runtime does (the demo's lines, a headless console's output); each call stays cheap."""

    plan: list[Callable[[Plan], None]] = field(default_factory=list)
    action: list[Callable[[str, str, ActionResult], None]] = field(default_factory=list)  # node, action, result
    frame: list[Callable[[Any, Frame], None]] = field(default_factory=list)  # link, frame
    link: list[Callable[[Any], None]] = field(default_factory=list)
    alert: list[Callable[[str | None], None]] = field(default_factory=list)
    relay: list[Callable[[Any], None]] = field(default_factory=list)  # a relay's link went up or down
    recovered: list[Callable[[IncidentRow], None]] = field(default_factory=list)
    resolved: list[Callable[[str], None]] = field(default_factory=list)  # incident id
    stopping: list[Callable[[], Awaitable[None]]] = field(default_factory=list)  # awaited as the runtime stops
    starting: list[Callable[[], Awaitable[None]]] = field(default_factory=list)  # awaited as the runtime starts


@dataclass(slots=True)
class _Recovery:
    """An incident waiting for its job to train past the step it was at when the fault came."""

    incident: str
    job: str
    fault_step: int | None  # None: the console had seen no training step when the fault came
    settled: bool = False  # its plan has nothing left to run
    settled_step: int | None = None  # the job's step then (or the first one seen after it)


class ConsoleRuntime:
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

    # ------------------------------------------------------------ frames in

    # Callbacks the fleet calls; they must stay cheap (O(frame)): the UI reads on its own tick.
    def on_frame(self, link: Any, frame: Frame) -> None:
        key = str(link.endpoint)
        self.store.apply(frame, key)
        if isinstance(frame, (Sample, Summary)) and frame.trainer is not None:
            self.goodput.observe(key, frame.trainer, len(frame.gpus))
        if self.engine is not None:
            symptom = isinstance(frame, (Event, LogLine))
            before = self.engine.clock.now() if symptom else 0.0
            try:
                plans = self.engine.observe(key, frame)
            except Exception:  # noqa: BLE001 - one bad frame must not stop the stream
                logger.bind(node=key).exception("playbook engine failed on a frame")
                plans = []
            if symptom:
                # The fault's own time: a trainer told gone after its grace began to fail when it went silent.
                ts = fault_time(frame) if isinstance(frame, Event) else frame.ts
                self._symptoms.append((before, self.engine.clock.now(), ts))
                self.hangs.on_frame(str(frame.node) or str(link.name), frame)
            if plans:
                self._launch(plans)
        for hook in self.hooks.frame:
            hook(link, frame)

    def on_status(self, link: Any) -> None:
        hello_name = str(link.hello.node) if getattr(link, "hello", None) is not None else None
        self.store.set_link(
            str(link.endpoint), str(link.state), name=hello_name or link.name, error=link.last_error, role=link.role,
            foreign_frames=link.foreign_frames,
        )
        endpoint = str(link.endpoint)
        if str(link.state) == "connected":
            if endpoint not in self._up:
                self._up.add(endpoint)
                self.collector.links = len(getattr(self.fleet, "links", ()))
                self.collector.link_up()
        else:
            self._up.discard(endpoint)
        if str(link.state) != "connecting":
            self._tried.add(endpoint)
            if not self._links_tried.is_set() and self._all_tried():  # the scan of every link only until then
                self._links_tried.set()
                # What lives as long as the console (modules, playbooks, the app, a state per node)
                # is kept out of the collector's full walks (console/runtime/collector.py).
                self.collector.settled()
        for hook in self.hooks.link:
            hook(link)

    def on_relay(self, relay: Any) -> None:
        """A relay's own link went up or down: one line for all the nodes behind it (its nodes say it too)."""
        key = str(relay.endpoint)
        if self.engine is not None:
            # The relay's silence is the relay's: no node behind it is lost for it.
            if str(relay.state) == "connected":
                self.engine.relay_up(list(relay.carried), self.engine.clock.now())
            else:
                self.engine.relay_down(list(relay.carried), key)
        if str(relay.state) == "connected":
            self.relays_down.pop(key, None)
        else:
            behind = len(relay.carried)
            self.relays_down[key] = f"{relay.last_error or f'relay {key} is down'} ({behind:,} node{'s' * (behind != 1)} behind it)"
        self.store.generation += 1
        for hook in self.hooks.relay:
            hook(relay)

    @property
    def relay_alert(self) -> str:
        """The relays down, in one line ("" when none is)."""
        down = self.relays_down
        if len(down) <= 1:
            return next(iter(down.values()), "")
        names = sorted(down)
        return f"{len(down)} relays down: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"

    def set_alert(self, text: str | None) -> None:
        """Raise (or, with None, clear) the console's alert; the incident store calls it when its disk fails."""
        self.alert = text
        self.store.generation += 1
        for hook in self.hooks.alert:
            hook(text)

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
        """Time-based rules (heartbeat lost, ``for:`` windows) and recoveries; run every ``tick_interval`` once started."""
        self.retry_store()
        if self.engine is None:
            return
        try:
            plans = self.engine.tick(self.engine.clock.now())
        except Exception:  # noqa: BLE001 - the console keeps going; the log says why
            logger.exception("playbook engine tick failed")
            plans = []
        if plans:
            self._launch(plans)
        self.hangs.tick(self.engine.clock.now())
        if self._recoveries:
            self._check_recoveries()

    def blamed(self, job: str, verdict: CollectiveVerdict) -> None:
        """The collective records name who holds ``job`` up: the engine acts on it, the store keeps who and why."""
        if self.engine is None:
            return
        plans = self.engine.hang_verdict(job, verdict)
        planned = {p.incident.id for p in plans}
        if self.plan_store is not None:
            for incident in self.engine.incidents():
                if incident.blame_why == verdict.summary and incident.id not in planned and incident.state == "open":
                    try:
                        self.plan_store.upsert_incident(incident)  # planned before: only who is to blame changes
                    except Exception:  # noqa: BLE001 - the console keeps going; the log says why
                        logger.exception("cannot record the blame of {}", incident.id)
        if plans:
            self._launch(plans)

    async def _tick_forever(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            # A tick this late means this process was stalled (a busy host, a long GC, a paused VM): the
            # frames of that time may still wait unread, so silence up to now says nothing of the nodes.
            late = loop.time() - due
            if late > LOOP_STALL_S and self.engine is not None:
                self.engine.excuse_silence(self.engine.clock.now())
                logger.log("WARNING" if late > 1.0 else "DEBUG",
                           "the console's loop stalled {:.1f} s: no node's silence of that time is held against it", late)
            self.tick_engine()
            self.collector.tick()  # a baseline held back by its minimum gap
            due = loop.time() + self.tick_interval
            await asyncio.sleep(self.tick_interval)

    # ----------------------------------------------------------------- plans

    @property
    def ticking(self) -> bool:
        """The runtime runs the engine's clock rules itself (started, with a tick interval): a view need not."""
        return self._ticker is not None and not self._ticker.done()

    @property
    def busy(self) -> bool:
        """A plan is running now."""
        return bool(self._plans)

    def _launch(self, plans: list[Plan]) -> None:
        for plan in plans:
            for hook in self.hooks.plan:
                hook(plan)
            self._note_fault(plan)
            if self.executor is not None and not self.read_only:
                task = asyncio.get_running_loop().create_task(self._run_plan(plan))
                self._plans.add(task)
                task.add_done_callback(self._plans.discard)
            else:
                # Read-only: the incident is recorded and shown; nothing acts on it, so nothing it
                # planned to remove is being removed (the agents' reports say what others did).
                if self.engine is not None:
                    for step in plan.steps:
                        self.engine.step_finished(step, "skipped", "read-only console")
                self.settle(plan.incident.id)

    async def _run_plan(self, plan: Plan) -> None:
        assert self.executor is not None
        try:
            await self.executor.run(plan)
        except Exception:  # noqa: BLE001 - recorded by the executor; one plan never stops the console
            logger.bind(node=str(plan.incident.node)).exception("plan for {} failed", plan.incident.id)
        self.settle(plan.incident.id)

    def _note_fault(self, plan: Plan) -> None:
        """Keep when the fault came and the job's step then, and start waiting for the job to train past it."""
        incident = plan.incident
        fault_at = self._fault_time(incident)
        step = self.job_step(incident.job)
        if self.plan_store is not None:
            try:
                # The row the fault is kept on (the executor saves the same plan again, changing nothing).
                self.plan_store.save_plan(plan)
                self.plan_store.mark_fault(incident.id, fault_at, step)
                if self.engine is not None:  # the GPU's UUID, the XID code, history verdicts: per node and GPU
                    self.plan_store.record_history(self.engine.history.take(incident.id))
            except Exception:  # noqa: BLE001 - the plan still runs; the log says why
                logger.bind(node=str(incident.node)).exception("cannot record the fault of {}", incident.id)
                return
            # Watched even when no step is known yet: the first step seen later is the one to pass.
            if incident.id not in self._recoveries:
                self._recoveries[incident.id] = _Recovery(incident.id, incident.job, step)

    def _fault_time(self, incident: Incident) -> float:
        """When the fault behind ``incident`` happened, as near as the console can tell.

        The node's own time of the event or log line that opened it; for a lost
        heartbeat, when the node was last heard; for a metric held ``for`` a
        while, when it began to hold; else when the console opened it.
        """
        opened = incident.opened_at
        assert self.engine is not None
        if incident.kind == "heartbeat_lost":
            node = self.engine.nodes.get(incident.node)
            return min(node.last_seen, opened) if node is not None and node.last_seen else opened
        for before, after, ts in reversed(self._symptoms):
            if after < opened:
                break
            if before <= opened <= after:
                return ts if 0 < ts <= opened and opened - ts < _FAULT_SKEW_S else opened
        playbook = next((pb for pb in self.engine.playbooks if pb.name == incident.playbook), None)
        if playbook is not None and isinstance(playbook.trigger, MetricTrigger):
            return opened - playbook.trigger.condition.hold
        return opened

    def incident_spans(self) -> list[IncidentSpan]:
        """Every incident's fault, detection and recovery times, as the goodput breakdown needs them."""
        if self.incidents is None:
            return []
        return [IncidentSpan(r.id, r.fault_at, r.detected_at, r.recovered_at) for r in self.incidents.incidents()]

    def _record_cost(self, row: IncidentRow) -> None:
        """A recovered incident's steps lost and GPU-hours lost, kept with it in the incident store."""
        cost = self.goodput.cost(IncidentSpan(row.id, row.fault_at, row.detected_at, row.recovered_at))
        logger.bind(node=row.node).info("incident {} cost {} steps, {:.3f} GPU-hours", row.id, cost.steps_lost,
                                        cost.gpu_hours_lost)
        if self.plan_store is not None and hasattr(self.plan_store, "mark_cost"):
            try:
                self.plan_store.mark_cost(row.id, cost.steps_lost, cost.gpu_hours_lost)
            except Exception:  # noqa: BLE001 - the console keeps going; the log says why
                logger.exception("cannot record the cost of {}", row.id)

    def job_step(self, job: str = "") -> int | None:
        """The step ``job`` has trained to: the most advanced trainer among its nodes still in it."""
        if self.engine is None:
            summary = self.store.training()
            return summary.status.step if summary is not None else None
        steps = [n.trainer_step for n in self.engine.nodes.values()
                 if n.trainer_step is not None and not n.out and not n.lost and (not job or not n.job or n.job == job)]
        return max(steps) if steps else None

    def settle(self, incident_id: str) -> None:
        """Its plan has nothing left to run (or waits for an operator): from here the job must train past the fault."""
        watch = self._recoveries.get(incident_id)
        if watch is None or watch.settled:
            return
        if self.executor is not None and not self.read_only and self.plan_store is not None:
            if any(s.state in _UNSETTLED for s in self.plan_store.steps(incident_id)):
                return
        now_step = self.job_step(watch.job)
        watch.settled = True
        # Steps reported before a restore can still be in the store: the job must pass those too.
        known = [s for s in (watch.fault_step, now_step) if s is not None]
        watch.settled_step = max(known) if known else None

    def _check_recoveries(self) -> None:
        assert self.plan_store is not None
        now = self.store.clock.now()
        for watch in list(self._recoveries.values()):
            if not watch.settled:
                continue
            step = self.job_step(watch.job)
            if step is None:
                continue
            if watch.settled_step is None:
                watch.settled_step = step  # no step was known at the fault: the job must train past this one
                continue
            if step <= watch.settled_step:
                continue
            del self._recoveries[watch.incident]
            try:
                self.plan_store.mark_recovered(watch.incident, now)
                rec = self.plan_store.incident(watch.incident)
            except Exception:  # noqa: BLE001 - the console keeps going; the log says why
                logger.exception("cannot mark {} recovered", watch.incident)
                continue
            if rec is None:
                continue
            row = StoreIncidents.row(rec)
            logger.bind(node=rec.node).info("incident {} recovered: the job trains at step {} (fault at step {}), "
                                            "detected in {}, recovered in {}", rec.id, step,
                                            "unknown" if watch.fault_step is None else watch.fault_step,
                                            _seconds(row.detect_s), _seconds(row.recover_s))
            for hook in self.hooks.recovered:
                hook(row)

    def _rewatch(self) -> None:
        """After a restart: incidents that had not recovered yet are waited on again."""
        if self.plan_store is None or self.engine is None:
            return
        for rec in self.plan_store.incidents(states=("open", "acknowledged", "silenced")):
            if rec.fault_step is not None and rec.recovered_at is None and rec.id not in self._recoveries:
                incident = self.plan_store.stored_incident(rec.id)
                self._recoveries[rec.id] = _Recovery(rec.id, incident.job if incident else "", rec.fault_step)
                self.settle(rec.id)

    # ------------------------------------------------------------ actions out

    async def act(self, node: str, action: str, args: dict[str, Any], reason: str) -> ActionResult:
        """The executor's action sink: a playbook step to one node, with the same read-only check as the operator's.

        A restart that finds the node's trainer between two lives (the job
        re-forming after a node left) is sent again until it answers or
        ``trainer_wait`` runs out.
        """
        args = self._with_checkpoint_step(action, args)
        if not self.acting and action in ACTING_ACTIONS:
            result = ActionResult(id=Text(""), action=Text(action), ok=False, node=Text(node),
                                  message=Text("not sent: playbooks only watch in this run"))
        else:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.trainer_wait
            while True:
                result = await self._send(node, action, args, reason)
                if (result.ok or action != AgentAction.RESTART_FROM or result.code != ResultCode.TRAINER_ABSENT
                        or loop.time() >= deadline):
                    break
                await asyncio.sleep(self.retry_every)
        for hook in self.hooks.action:
            hook(node, action, result)
        return result

    def _with_checkpoint_step(self, action: str, args: dict[str, Any]) -> dict[str, Any]:
        """A restart the engine named no common checkpoint for gets the newest any trainer reports.

        Every node gets the same step (a node that just rejoined may still show
        its old process's checkpoints); the trainer falls back to its own rule
        when that step does not validate.
        """
        if action != AgentAction.RESTART_FROM or "step" in args:
            return args
        steps = sorted({s for n in self.store.nodes.values() if n.trainer is not None
                        for s in n.trainer.checkpoints.values()})
        if args.get("checkpoint") == "before" and args.get("before_step") is not None:
            steps = [s for s in steps if s < int(args["before_step"])]
        return {**args, "step": steps[-1]} if steps else args

    async def _send(self, node: str, action: str, args: dict[str, Any], reason: str) -> ActionResult:
        if self.read_only:
            return _refused(node, action, "this console is read-only")
        if self.fleet is None:
            return _refused(node, action, "no fleet connected")
        from gridwatch.playbooks.executor import STEP_KEY

        # With an election, the newest fencing token this console held and the step being run: the agent
        # checks both. A console alone sends neither, as before there were several.
        stamp: dict[str, Any] = {}
        if self.election is not None:
            stamp = {"fence": self.election.fence, "key": STEP_KEY.get()}
        try:
            return await self.fleet.action(node, action, args, reason=reason, timeout=self.action_timeout, **stamp)
        except Exception as exc:  # noqa: BLE001 - the operator sees why, the screen keeps going
            return _refused(node, action, f"{type(exc).__name__}: {exc}")

    async def node_action(self, node: str, action: str, reason: str, args: dict | None = None,
                          who: str | None = None, force: bool = False) -> ActionResult:
        """An operator's action on one node, audited before and after like a playbook step; refused when read-only.

        A node put back in service (``unisolate``) is handed back to the
        scheduler too, when the drain there is gridwatch's. A node a history
        rule keeps out (gridwatch.playbooks.history) is refused, in one line, unless
        ``force``; a forced return is audited with what it overrode.
        """
        who = who or self.operator
        if self.read_only:
            return _refused(node, action, "this console is read-only")
        if self.election is not None:
            from gridwatch.console.runtime.leader import observer_refusal

            observing = observer_refusal(self.election)
            if observing:
                return _refused(node, action, observing)
        refusal = getattr(self.plan_store, "return_refusal", None) if action == AgentAction.UNISOLATE else None
        kept_out = refusal(node) if refusal is not None else None
        if kept_out and not force:
            self.audit(who, f"{action} on {node}", reason, "operator", f"refused: {kept_out}")
            return _refused(node, action, kept_out)
        if kept_out:
            self.audit(who, f"force {action} on {node}", reason, "operator", f"overrides: {kept_out}")
        what = f"{action} on {node}" + (f" {msgspec.json.encode(args).decode()}" if args else "")
        logger.bind(node=node).info("action {} by {}: {}", action, who, reason)
        self.audit(who, what, reason, "before", "")
        result = await self._send(node, action, dict(args or {}), reason)
        self.audit(who, what, reason, "after", f"{'done' if result.ok else 'failed'}: {result.message}")
        if result.ok and action == AgentAction.UNISOLATE and self.executor is not None:
            try:
                told = await self.executor.return_to_service(node, who, reason)
            except Exception as exc:  # noqa: BLE001 - the node is back either way; the operator sees why
                logger.bind(node=node).exception("return to service of {} failed", node)
                told = f"the scheduler was not told: {type(exc).__name__}: {exc}"
            result = msgspec.structs.replace(result, message=Text(f"{result.message}; scheduler: {told}"))
        return result

    def audit(self, who: str, what: str, why: str, phase: str, outcome: str) -> None:
        if self.plan_store is None:
            return
        try:
            self.plan_store.audit(who, what, why, phase=phase, outcome=outcome)
        except Exception:  # noqa: BLE001 - the action still goes; the log says why
            logger.exception("cannot audit {}", what)

    def resolve(self, incident_id: str, why: str, who: str | None = None) -> None:
        """Done with an incident: the store says so and the engine opens a new one for the next symptom."""
        self._check_changes("resolve")
        if self.engine is not None:
            self.engine.resolve(incident_id)
        if self.plan_store is not None:
            self.plan_store.resolve(incident_id, who or self.operator, why)
        for hook in self.hooks.resolved:
            hook(incident_id)

    # -------------------------------------------------------------- lifecycle

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
        # Counted by the store as links and hellos change: the status bar asks on every tick.
        roles = self.store.role_counts()
        return bool(roles) and not roles.get("operator")

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
        outcome = await self.actor.act(incident_id, self.operator, why)
        self.settle(incident_id)
        return outcome

    def _check_changes(self, what: str) -> None:
        if self.read_only:
            raise PermissionError(f"cannot {what}: this console is read-only")
        store = self.plan_store if what == "resolve" else self.incidents
        if store is None and what != "act":
            raise PermissionError(f"cannot {what}: no incident store is attached")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


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
