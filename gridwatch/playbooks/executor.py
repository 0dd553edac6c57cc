"""Run planned steps through injected interfaces, with timeouts, recording each before and after.

Where each step goes:

- ``capture_scene``, ``isolate_node`` go to the incident's node (agent actions
  ``capture_scene``, ``isolate``); ``reset_gpu`` too, with the incident's GPU
  (agent action ``reset_gpu``: it answers ok once the GPU reads healthy again).
- ``checkpoint_now``, ``pause_training``, ``restart_from_checkpoint`` are job-wide:
  the engine lists in ``PlannedStep.nodes`` every live node not taken out of the
  job, and each gets the agent action (``checkpoint_now``, ``pause``,
  ``restart_from``) at once; the step succeeds only if all of them do.
- ``requeue_job`` goes to the scheduler too (``gridwatch.playbooks.jobs``), after
  the node's drain: the jobs running on the node that opted in are requeued and
  let start at once; one that did not opt in is left running and the step fails
  (the incident pages). A ``restart_from_checkpoint`` after a requeue that moved
  a job is skipped: the scheduler restarts that job, and no other node is told.
- ``drain_node`` goes to the configured scheduler (``gridwatch.playbooks.scheduler``): the
  node is read first, a drain someone else made is left as it is, and every
  command is audited with its argv and the reason sent. With no scheduler the
  step is skipped. A controller that does not answer leaves the step
  ``pending``; it is tried again (backoff on the executor's clock) until it
  answers or the node is returned to service, and the plan goes on meanwhile.
- ``notify`` and ``escalate`` go through the notifier; ``wait_for`` polls a probe.

Idempotence: steps are keyed by ``<incident>/<index>`` in the store. A step
recorded as finished is never run again; one found ``running`` (the console
stopped mid-step) is marked ``interrupted`` and not repeated, since it may have
acted. A step that needs confirmation holds the rest of its plan until
:meth:`Executor.confirm` or :meth:`Executor.decline`. An incident a more severe
one took over (``Incident.supersedes``) is resolved and its unrun steps skipped,
so confirming its old plan later does nothing.

A step that runs past its timeout is over when the audit says so: a command it
ran is killed with its process group and reaped first (``SubprocessRunner``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Protocol

import msgspec
from loguru import logger

from gridwatch.playbooks.clock import Clock, SystemClock
from gridwatch.playbooks.jobs import Job, JobRequeuer, jobs_backend_for
from gridwatch.playbooks.model import ACTING_STEPS, SCHEDULER_STEPS
from gridwatch.playbooks.notify import CommandRunner, DefaultNotifier, SubprocessRunner
from gridwatch.playbooks.plans import Incident, Plan, PlannedStep
from gridwatch.playbooks.scheduler import (
    Backend,
    Backoff,
    ControllerUnreachable,
    DrainRefused,
    Hold,
    SchedulerClient,
    SchedulerError,
    backend_for,
    command_text,
    drain_reason,
    incident_of,
)
from gridwatch.playbooks.store import OPEN_STATES, STEP_DONE_STATES, IncidentStore, StepRecord, UnknownIncident
from gridwatch.wire.protocol import ActionResult, AgentAction, ResultCode

__all__ = ["CommandRunner", "Executor", "StepFailed", "StepPending", "PENDING", "PENDING_OUTCOME", "NO_SCHEDULER"]

# The args of the agent action ``restart_from`` (relayed as-is to the trainer's
# control socket), the one contract between the executor and the trainer:
#   {"incident": ID, "checkpoint": "newest"}
#       restart from the newest checkpoint that validates;
#   {"incident": ID, "checkpoint": "before", "before_ts": T, "before_step": N | None}
#       restart from the newest valid checkpoint of a step below N (saved before
#       epoch time T when N is None): the one before a NaN loss, say;
#   ... plus "step": S when the engine knew a checkpoint step S that every node
#       the step goes to reported in TrainerStatus.checkpoints (newest, or newest
#       below N). The trainer takes S when it validates, else falls back to the
#       rule of "checkpoint"; "incident" is for its log only.
RESTART_ARG_KEYS: tuple[str, ...] = ("incident", "checkpoint", "before_ts", "before_step", "step")

# Agent action for each node-level step.
STEP_ACTIONS: dict[str, AgentAction] = {
    "capture_scene": AgentAction.CAPTURE_SCENE,
    "isolate_node": AgentAction.ISOLATE,
    "checkpoint_now": AgentAction.CHECKPOINT_NOW,
    "pause_training": AgentAction.PAUSE,
    "restart_from_checkpoint": AgentAction.RESTART_FROM,
    "reset_gpu": AgentAction.RESET_GPU,  # args {"gpu": the incident's GPU}; the agent reads it healthy after the reset
}

# The step state while a drain waits for the scheduler's controller, and how its outcome starts.
PENDING = "pending"
PENDING_OUTCOME = "controller unreachable, retrying"
# ... and when the command timed out: the controller may have done it; the node is read before anything more.
UNKNOWN_OUTCOME = "outcome unknown (the command timed out), reading the node again"
# A drain step's outcome (state skipped) when no scheduler is configured.
NO_SCHEDULER = "no scheduler configured"
# The step being run: its agent actions carry this as their idempotency key (``Action.key``), so an agent
# that did the step already answers a repeat (a standby finishing the plan) with the first outcome.
STEP_KEY: ContextVar[str | None] = ContextVar("step_key", default=None)


def restart_args(step: PlannedStep) -> dict[str, Any]:
    """The ``restart_from`` args for a planned restart, less ``incident`` (see RESTART_ARG_KEYS)."""
    args: dict[str, Any] = {"checkpoint": step.checkpoint}
    if step.checkpoint == "before":
        args["before_ts"] = step.before_ts
        args["before_step"] = step.before_step
    if step.checkpoint_step is not None:
        args["step"] = step.checkpoint_step
    return args


class ActionSink(Protocol):
    """Sends an action to a node's agent and returns its answer (the console's fleet does this over SSH)."""

    async def act(self, node: str, action: str, args: dict[str, Any], reason: str) -> ActionResult: ...


class Notifier(Protocol):
    async def notify(self, step: PlannedStep, incident: Incident, text: str, escalation: bool) -> str: ...


class ConditionProbe(Protocol):
    """Answers wait_for conditions (heartbeat, isolated, training, checkpoint) from the console's state."""

    def holds(self, condition: str, node: str) -> bool: ...


class StepFailed(Exception):
    """A step did not do what it should; the message is the outcome recorded."""


class StepSkipped(Exception):
    """The step had nothing to do once it came to run; the message says why."""


class StepPending(Exception):
    """The step cannot be done yet (the scheduler's controller did not answer); it is tried again."""


class _CommandAudit:
    """Writes each scheduler command to the audit log with its argv; remembers the one running."""

    def __init__(self, store: IncidentStore, who: str, why: str, incident: str | None, step: str | None) -> None:
        self.store = store
        self.who = who
        self.why = why
        self.incident = incident
        self.step = step
        self.running: list[str] | None = None

    def __call__(self, argv: list[str], outcome: str | None) -> None:
        self.running = argv if outcome is None else None
        self.store.audit(self.who, command_text(argv), self.why, incident=self.incident, step=self.step,
                         phase="before" if outcome is None else "after", outcome=outcome or "")

    def killed(self, why: str) -> str:
        """The step ended while a command ran, so it was killed: audit that; the words to add to the outcome."""
        if self.running is None:
            return ""
        argv, self.running = self.running, None
        self.store.audit(self.who, command_text(argv), self.why, incident=self.incident, step=self.step,
                         phase="after", outcome=f"killed: {why}")
        return f"; {argv[0]} was killed before it finished"


class Executor:
    """Runs plans the engine made; one instance per console, sharing its store.

    ``scheduler`` is one of ``gridwatch.playbooks.model.SCHEDULERS``; another name is a
    ValueError (DrainRefused) in one sentence.
    """

    def __init__(self, store: IncidentStore, sink: ActionSink, *, clock: Clock | None = None,
                 runner: CommandRunner | None = None, notifier: Notifier | None = None,
                 probe: ConditionProbe | None = None, scheduler: str = "none", who: str = "gridwatch",
                 poll_interval: float = 0.5, drain_retry: Backoff | None = None,
                 scheduler_timeout: float = 30.0) -> None:
        self.store = store
        self.sink = sink
        self.clock = clock or SystemClock()
        self.runner = runner or SubprocessRunner()
        self.notifier = notifier or DefaultNotifier()
        self.probe = probe
        self.scheduler = scheduler
        self.backend: Backend | None = backend_for(scheduler)
        self.who = who
        self.poll_interval = poll_interval
        self.drain_retry = drain_retry or Backoff()
        self.scheduler_timeout = scheduler_timeout  # return to service has no step, so no step timeout
        self._retrying: dict[str, tuple[str, asyncio.Task[None]]] = {}  # step id -> (node, its retry)
        self._jobs_seen: dict[str, list[Job]] = {}  # requeue step id -> the jobs a try found on its node
        self._requeued: dict[str, str] = {}  # incident id -> what its requeue step moved, in words
        # Asked before each step starts: None, or why this console may not start one now (another leads).
        self.gate: Callable[[], str | None] = lambda: None
        # Asked before each step starts: None, or why the incident's condition no longer holds (a lost
        # heartbeat's node that sends frames again): the rest of its plan is skipped, saying so.
        self.recheck: Callable[[str], str | None] = lambda incident_id: None
        # Told of each step as it starts and ends (step, state, outcome): the leader publishes it.
        self.on_step: list[Callable[[PlannedStep, str, str], None]] = []

    async def run(self, plan: Plan) -> list[StepRecord]:
        """Record the plan and run what has not run yet, in order; returns every step's record."""
        self.store.save_plan(plan)
        trouble = getattr(self.store, "trouble", None)
        if trouble:
            await self._tell_unrecorded(plan, trouble)
        for old in plan.incident.supersedes:
            self._stand_down(old, plan.incident)
        return await self._continue(plan.incident.id)

    async def return_to_service(self, node: str, who: str, reason: str) -> str:
        """A node is back in service: give it back to the scheduler if the drain is ours; the outcome, audited.

        A drain still waiting for the controller is stopped first (it would
        drain the node later). The node is read before anything is done: a drain
        someone else made stays, and the outcome says so.
        """
        what = f"return_to_service {node}"
        stopped, tasks = self._stop_pending(f"{node} was returned to service by {who}", node=node)
        await asyncio.gather(*tasks, return_exceptions=True)  # a try under way ends before the node is read
        before = f"stopped the pending drain of {', '.join(stopped)}; " if stopped else ""
        if self.backend is None:
            outcome = f"{before}{NO_SCHEDULER}: nothing to resume"
            self.store.audit(who, what, reason, phase="after", outcome=outcome)
            return outcome
        audit = _CommandAudit(self.store, who, reason, None, None)
        client = SchedulerClient(self.backend, self.runner, audit, self.scheduler_timeout)
        try:
            found = await asyncio.wait_for(client.hold(node), self.scheduler_timeout)
            audit.incident = incident_of(found.reason)  # the incident whose drain it is, when it is ours
            self.store.audit(who, what, reason, incident=audit.incident, phase="before")
            _, outcome = await asyncio.wait_for(client.resume(node, found), self.scheduler_timeout)
        except TimeoutError:
            outcome = (f"{self.backend.title} did not answer within {self.scheduler_timeout:g}s"
                       f"{audit.killed('timed out')}; the node may still be drained there")
        except ControllerUnreachable as exc:
            resume = command_text(self.backend.resume_argvs(node)[0])
            outcome = f"{exc}: the node stays drained there; run `{resume}` once it answers"
        except (SchedulerError, DrainRefused, OSError) as exc:
            outcome = f"could not resume it in {self.backend.title}: {exc}"
        outcome = before + outcome
        self.store.audit(who, what, reason, incident=audit.incident, phase="after", outcome=outcome)
        logger.bind(node=node).info("return to service: {}", outcome)
        return outcome

    async def resume(self) -> list[str]:
        """After a restart: carry on every stored plan with steps left, pending drains included; their ids."""
        resumed = self.store.unfinished()
        for record in self.store.incidents(states=OPEN_STATES):
            if record.id not in resumed and any(s.state == PENDING for s in self.store.steps(record.id)):
                resumed.append(record.id)
        for incident_id in resumed:
            await self._continue(incident_id)
        return resumed

    @property
    def pending_drains(self) -> dict[str, str]:
        """The drains being tried again now: step id -> node."""
        return {step_id: node for step_id, (node, _) in self._retrying.items()}

    async def close(self) -> None:
        """Stop trying pending drains (the console is stopping); they stay pending in the store for the next one."""
        tasks = [task for _, task in self._retrying.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._retrying.clear()

    async def confirm(self, step_id: str, who: str) -> list[StepRecord]:
        """An operator confirms a step waiting for it: it runs, then the rest of its plan."""
        record = self._awaiting(step_id)
        self.store.audit(who, f"confirm {record.step}", record.reason, incident=record.incident, step=step_id,
                         phase="operator")
        self.store.set_step(step_id, "planned", decision="act")
        return await self._continue(record.incident, confirmed_by=who)

    async def decline(self, step_id: str, who: str, why: str = "") -> list[StepRecord]:
        """An operator declines a step: it and the rest of its plan are not run."""
        record = self._awaiting(step_id)
        self.store.audit(who, f"decline {record.step}", why, incident=record.incident, step=step_id, phase="operator")
        self._settle_step(record.planned, "declined", f"declined by {who}")
        for later in self.store.steps(record.incident):
            if later.index > record.index and later.state not in STEP_DONE_STATES:
                self._settle_step(later.planned, "skipped", f"step {record.index + 1} was declined")
        return self.store.steps(record.incident)

    # -------------------------------------------------------------- internals

    def _stand_down(self, incident_id: str, by: Incident) -> None:
        """A more severe incident took over this one: what it has not run (or waits to confirm) never runs."""
        if self.store.incident(incident_id) is None:
            return
        why = f"superseded by {by.id} ({by.severity} {by.playbook})"
        self._stop_pending(why, incident=incident_id)
        for record in self.store.steps(incident_id):
            if record.state not in STEP_DONE_STATES and record.state != "running":
                self._settle_step(record.planned, "skipped", why)
        self.store.resolve(incident_id, self.who, why)

    def _awaiting(self, step_id: str) -> StepRecord:
        record = self.store.step(step_id)
        if record is None:
            raise UnknownIncident(f"no step {step_id!r}")
        if record.state != "awaiting_confirmation":
            raise ValueError(f"step {step_id} is {record.state}, not waiting for confirmation")
        return record

    async def _continue(self, incident_id: str, confirmed_by: str | None = None) -> list[StepRecord]:
        incident = self.store.stored_incident(incident_id)
        if incident is None:
            raise UnknownIncident(f"no incident {incident_id!r}")
        escalated = any(a.what == "escalate" for a in self.store.audit_log(incident_id))
        stop_reason = ""
        for record in self.store.steps(incident_id):
            step = record.planned
            if record.state in STEP_DONE_STATES:
                continue
            if record.state == PENDING and step.id in self._retrying:
                continue  # its retry is under way; the rest of the plan went on without it
            if stop_reason:
                self._settle_step(step, "skipped", stop_reason)
                continue
            if record.state == "awaiting_confirmation":
                break  # the rest waits for the operator
            if record.state == "running":
                self._settle_step(step, "interrupted", "the console stopped while this ran; not repeated")
                self.store.audit(self.who, step.step, "resumed plan", incident=incident_id, step=step.id,
                                 phase="after", outcome="interrupted: outcome unknown, not repeated")
                continue
            decision = record.decision
            if decision == "skip":
                self._settle_step(step, "skipped", step.reason)
                continue
            if decision == "needs_confirmation":
                self.store.set_step(step.id, "awaiting_confirmation", step.reason)
                self.store.audit(self.who, step.step, step.reason, incident=incident_id, step=step.id,
                                 phase="engine", outcome="waiting for an operator")
                break
            if decision == "escalate":
                self._settle_step(step, "escalated", step.reason)
                if not escalated:
                    escalated = True
                    await self._escalate(incident, step, step.reason)
                continue
            who = confirmed_by or self.who
            why = f"{incident.playbook}: {incident.summary}"
            if step.step in SCHEDULER_STEPS and self._backend_of(step) is None:
                # Nothing was told: "done" would make the operator believe the node left the pool.
                self._settle_step(step, "skipped", NO_SCHEDULER)
                self.store.audit(who, self._describe(step), why, incident=incident_id, step=step.id, phase="after",
                                 outcome=f"skipped: {NO_SCHEDULER}")
                continue
            gone = self.recheck(incident_id)
            if gone is not None:
                stop_reason = f"no longer holds: {gone}"
                self._settle_step(step, "skipped", stop_reason)
                self.store.audit(who, self._describe(step), why, incident=incident_id, step=step.id, phase="after",
                                 outcome=f"skipped: {stop_reason}")
                logger.bind(node=step.target).info("{} skipped: {}", step.id, stop_reason)
                continue
            held = self.gate()
            if held is not None:
                logger.bind(node=step.target).info("{} waits: {}", step.id, held)
                break  # the rest is run by the console that leads
            self.store.audit(who, self._describe(step), why, incident=incident_id, step=step.id, phase="before")
            self.store.set_step(step.id, "running", started=True)
            self._tell(step, "running", "")
            audit = _CommandAudit(self.store, who, why, incident_id, step.id)
            key = STEP_KEY.set(step.id)
            try:
                outcome = await asyncio.wait_for(self._perform(step, incident, who, audit), step.timeout)
                state = "done"
            except TimeoutError:
                outcome, state = f"timed out after {step.timeout:g}s{audit.killed('the step timed out')}", "failed"
                if step.step in SCHEDULER_STEPS:
                    # The controller may have taken the drain (or the requeue) before the command was killed: not "failed",
                    # but unknown; the retry reads the node again before it records (or sends) anything.
                    outcome, state = f"{UNKNOWN_OUTCOME} ({outcome})", PENDING
            except StepPending as exc:
                outcome, state = f"{PENDING_OUTCOME} ({exc})", PENDING
            except StepSkipped as exc:
                outcome, state = str(exc), "skipped"
            except (StepFailed, DrainRefused, OSError, RuntimeError, ValueError) as exc:
                outcome, state = str(exc) or exc.__class__.__name__, "failed"
            finally:
                STEP_KEY.reset(key)
            self._finish(step, who, why, state, outcome)
            if state == PENDING:
                self._start_retry(step, incident, who, unknown=outcome.startswith(UNKNOWN_OUTCOME))
            if state == "failed" and not step.continue_on_failure:
                stop_reason = f"step {step.index + 1} ({step.step}) failed: {outcome}"
                if not escalated:
                    escalated = True
                    await self._escalate(incident, step, stop_reason)
        return self.store.steps(incident_id)

    def _finish(self, step: PlannedStep, who: str, why: str, state: str, outcome: str) -> None:
        self.store.set_step(step.id, state, outcome)
        self.store.audit(who, self._describe(step), why, incident=step.incident, step=step.id, phase="after",
                         outcome=f"{state}: {outcome}")
        logger.bind(node=step.target).info("{} {} -> {}: {}", step.incident, step.step, state, outcome)
        if state == "done" and step.step in ACTING_STEPS:
            self.store.mark_acted(step.incident, self.clock.now())
        self._tell(step, state, outcome)

    def _settle_step(self, step: PlannedStep, state: str, outcome: str) -> None:
        """Record a step's end that ran nothing (skipped, escalated, declined, interrupted), and tell the
        listeners as of a step that ran: the engine stops counting a removal that will not happen."""
        self.store.set_step(step.id, state, outcome)
        self._tell(step, state, outcome)

    def _tell(self, step: PlannedStep, state: str, outcome: str) -> None:
        for call in self.on_step:
            try:
                call(step, state, outcome)
            except Exception:  # noqa: BLE001 - who listens must not stop the plan
                logger.exception("a step listener failed on {}", step.id)

    async def _tell_unrecorded(self, plan: Plan, trouble: str) -> None:
        """The plan runs, but its record is only in memory: the people its plan would tell hear that too."""
        told = next((s for s in plan.steps if s.step in ("notify", "escalate")), None)
        step = msgspec.structs.replace(told, message="") if told is not None else PlannedStep(
            id=f"{plan.incident.id}/store", incident=plan.incident.id, playbook=plan.incident.playbook, index=-1,
            step="escalate", target=plan.incident.node, at=self.clock.now(), timeout=10.0)
        text = f"{plan.incident.id} is acted on but not yet recorded: {trouble}"
        try:
            await asyncio.wait_for(self.notifier.notify(step, plan.incident, text, True), step.timeout)
        except (TimeoutError, OSError, RuntimeError, ValueError) as exc:
            logger.bind(node=plan.incident.node).error("could not tell anyone that {}: {}", text, exc)

    def _describe(self, step: PlannedStep) -> str:
        where = ",".join(step.nodes) if step.nodes else step.target
        return f"{step.step} on {where}"

    async def _escalate(self, incident: Incident, step: PlannedStep, reason: str) -> None:
        text = f"{incident.id} needs a human: {reason}"
        try:
            outcome = await asyncio.wait_for(self.notifier.notify(step, incident, text, True), step.timeout)
        except (TimeoutError, OSError, RuntimeError, ValueError) as exc:
            outcome = f"escalation could not be sent: {exc or exc.__class__.__name__}"
        self.store.audit(self.who, "escalate", reason, incident=incident.id, step=step.id, phase="after",
                         outcome=outcome)

    # ------------------------------------------------------------ the scheduler

    def _backend_of(self, step: PlannedStep) -> Backend | None:
        """A playbook may name a scheduler for its step; otherwise the one the console is configured with."""
        return backend_for(step.scheduler) if step.scheduler else self.backend

    async def _drain(self, step: PlannedStep, incident: Incident, who: str, audit: _CommandAudit) -> str:
        backend = self._backend_of(step)
        if backend is None:
            raise StepFailed(NO_SCHEDULER)
        reason = drain_reason(incident.id, incident.playbook, who, incident.summary)
        audit.why = reason  # each command's audit row carries the reason sent
        client = SchedulerClient(backend, self.runner, audit, step.timeout)
        try:
            return await client.drain(step.target, reason)
        except ControllerUnreachable as exc:
            raise StepPending(str(exc)) from None
        except SchedulerError as exc:
            raise StepFailed(str(exc)) from None

    async def _scheduler_step(self, step: PlannedStep, incident: Incident, who: str, audit: _CommandAudit) -> str:
        if step.step == "requeue_job":
            return await self._requeue(step, incident, audit)
        return await self._drain(step, incident, who, audit)

    async def _requeue(self, step: PlannedStep, incident: Incident, audit: _CommandAudit) -> str:
        """Requeue the jobs on the incident's node once it is drained; the outcome, job by job."""
        backend = self._backend_of(step)
        jobs = jobs_backend_for(backend.kind) if backend is not None else None
        if backend is None or jobs is None:
            raise StepFailed(NO_SCHEDULER)
        client = SchedulerClient(backend, self.runner, audit, step.timeout)
        seen = self._jobs_seen.setdefault(step.id, [])
        try:
            held = await client.hold(step.target)
            if held.hold is Hold.NONE:
                raise StepPending(f"{step.target} is not drained in {backend.title} yet, and a job requeued now "
                                  f"could start on it again")
            done = await JobRequeuer(client, jobs).requeue(step.target, seen)
        except ControllerUnreachable as exc:
            raise StepPending(str(exc)) from None
        except SchedulerError as exc:
            raise StepFailed(str(exc)) from None
        outcome = done.outcome(backend.title, step.target)
        if done.done:
            self._requeued[incident.id] = "; ".join(done.done)
        if done.refused:
            raise StepFailed(outcome)
        self._jobs_seen.pop(step.id, None)
        return outcome

    def _start_retry(self, step: PlannedStep, incident: Incident, who: str, unknown: bool = False) -> None:
        task = asyncio.create_task(self._keep_draining(step, incident, who, unknown), name=f"drain {step.id}")
        self._retrying[step.id] = (step.target, task)

    async def _keep_draining(self, step: PlannedStep, incident: Incident, who: str, unknown: bool = False) -> None:
        """Try a pending drain again, waiting longer each time, until the controller answers (each try reads
        the node first: a drain the controller took from a command that timed out is found, not sent twice)."""
        said = UNKNOWN_OUTCOME if unknown else PENDING_OUTCOME
        why = f"{incident.playbook}: {incident.summary}"
        failures = 1
        try:
            while True:
                wait = self.drain_retry.delay(failures)
                tries = f"tried {failures} time{'s' if failures > 1 else ''}"
                self.store.set_step(step.id, PENDING, f"{said} ({tries}; next in {wait:g}s)")
                due = self.clock.now() + wait
                while self.clock.now() < due:
                    await asyncio.sleep(self.poll_interval)
                gone = self.recheck(incident.id)
                if gone is not None:  # the node came back while the controller was away: no drain
                    self._settle_step(step, "skipped", f"no longer holds: {gone}")
                    self.store.audit(who, self._describe(step), why, incident=incident.id, step=step.id,
                                     phase="after", outcome=f"skipped: no longer holds: {gone}")
                    return
                audit = _CommandAudit(self.store, who, why, incident.id, step.id)
                try:
                    outcome = await asyncio.wait_for(self._scheduler_step(step, incident, who, audit), step.timeout)
                except (TimeoutError, StepPending):
                    audit.killed("the try timed out")
                    failures += 1
                    continue
                except (StepFailed, DrainRefused, OSError, RuntimeError, ValueError) as exc:
                    outcome = str(exc) or exc.__class__.__name__
                    self._finish(step, who, why, "failed", outcome)
                    if not any(a.what == "escalate" for a in self.store.audit_log(incident.id)):
                        await self._escalate(incident, step, f"step {step.index + 1} ({step.step}) failed: {outcome}")
                    return
                self._finish(step, who, why, "done", f"{outcome} (on try {failures + 1})")
                return
        except Exception:  # noqa: BLE001 - the step stays pending in the store; the next console takes it up
            logger.bind(node=step.target).exception("retrying the drain of {} stopped", step.target)
        finally:
            self._retrying.pop(step.id, None)

    def _stop_pending(self, why: str, *, node: str | None = None,
                      incident: str | None = None) -> tuple[list[str], list[asyncio.Task[None]]]:
        """Stop the pending drains of ``node`` or of ``incident``: skipped, saying why.

        Returns their incidents and the retries cancelled (await them before reading the scheduler).
        """
        if incident is not None:
            ids = [incident]
        else:
            ids = [r.id for r in self.store.incidents(states=OPEN_STATES) if r.node == node]
        stopped: list[str] = []
        tasks: list[asyncio.Task[None]] = []
        for record in (s for i in ids for s in self.store.steps(i)):
            if record.state != PENDING or (node is not None and record.target != node):
                continue
            entry = self._retrying.pop(record.id, None)
            if entry is not None:
                entry[1].cancel()
                tasks.append(entry[1])
            undone = "not requeued" if record.step == "requeue_job" else "not drained"
            self._settle_step(record.planned, "skipped", f"{undone}: {why}")
            self.store.audit(self.who, f"{record.step} on {record.target}", why, incident=record.incident,
                             step=record.id, phase="after", outcome=f"skipped: {undone}: {why}")
            stopped.append(record.incident)
        return stopped, tasks

    # ---------------------------------------------------------- the other steps

    async def _perform(self, step: PlannedStep, incident: Incident, who: str, audit: _CommandAudit) -> str:
        reason = f"{incident.playbook}: {incident.summary}"
        if step.step in ("notify", "escalate"):
            return await self.notifier.notify(step, incident, self._told(step, incident), step.step == "escalate")
        if step.step in SCHEDULER_STEPS:
            return await self._scheduler_step(step, incident, who, audit)
        if step.step == "wait_for":
            return await self._wait(step)
        action = STEP_ACTIONS[step.step]
        args: dict[str, Any] = {"incident": incident.id}
        if step.step == "restart_from_checkpoint":
            moved = self._requeued.get(incident.id)
            if moved:  # the scheduler restarts that job from its own checkpoint; nobody else is told anything
                raise StepSkipped(f"not sent: the scheduler restarts the job ({moved})")
            args.update(restart_args(step))
        if step.step == "reset_gpu":
            if incident.gpu is None:
                raise StepFailed("the incident names no GPU to reset")
            args["gpu"] = incident.gpu
        if not step.nodes:
            raise StepFailed("no node to send it to")
        answers = await asyncio.gather(*(self._act(n, action, args, reason) for n in step.nodes))
        if all(code == ResultCode.NOT_SENT for _, _, _, code in answers):
            # A watch-only run: nothing was tried, so nothing failed (no escalation, no re-plan of a removal).
            raise StepSkipped(str(answers[0][2]))
        results = [(n, ok, msg) for n, ok, msg, _ in answers]
        failed = [f"{n}: {msg}" for n, ok, msg in results if not ok]
        if failed:
            raise StepFailed("; ".join(failed))
        said = f"{action} ok on {len(results)} node{'s' if len(results) != 1 else ''}"
        if step.step == "capture_scene":  # where the evidence lives, on the node and at the console
            said += ": " + "; ".join(f"{n}: {msg}" for n, _, msg in results)
        return said

    def _told(self, step: PlannedStep, incident: Incident) -> str:
        """What a notify says: the playbook's sentence when every step before it (but telling) was done; else
        what each of them did, so no message claims a node isolated that was not (a guard escalated it)."""
        said = step.message or incident.summary
        before = [r for r in self.store.steps(incident.id)  # this plan's (a re-plan's steps carry its own time)
                  if r.index < step.index and r.planned.at == step.at and r.step not in ("notify", "escalate", "wait_for")]
        if all(r.state == "done" for r in before):
            return said
        facts = "; ".join(f"{r.step} {r.state}" + (f" ({r.outcome[:120]})" if r.state != "done" and r.outcome else "")
                          for r in before)
        return f"{incident.summary}. Steps: {facts}"

    async def _act(self, node: str, action: str, args: dict[str, Any], reason: str) -> tuple[str, bool, str, str]:
        try:
            result = await self.sink.act(node, action, dict(args), reason)
        except (OSError, RuntimeError, ConnectionError) as exc:
            return node, False, str(exc) or exc.__class__.__name__, ""
        return node, bool(result.ok), str(result.message), str(result.code or "")

    async def _wait(self, step: PlannedStep) -> str:
        if self.probe is None:
            raise StepFailed("no condition probe: cannot wait")
        node = step.target
        while not self.probe.holds(step.condition or "", node):
            await asyncio.sleep(self.poll_interval)
        return f"{step.condition} holds on {node}"
