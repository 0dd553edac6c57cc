"""Run planned steps through injected interfaces, with timeouts, recording each before and after.

Where each step goes:

- ``capture_scene``, ``isolate_node`` go to the incident's node (agent actions
  ``capture_scene``, ``isolate``).
- ``checkpoint_now``, ``pause_training``, ``restart_from_checkpoint`` are job-wide:
  the engine lists in ``PlannedStep.nodes`` every live node not taken out of the
  job, and each gets the agent action (``checkpoint_now``, ``pause``,
  ``restart_from``) at once; the step succeeds only if all of them do.
- ``drain_node`` runs the scheduler's command (``scontrol`` or ``kubectl``) as an argv.
- ``notify`` and ``escalate`` go through the notifier; ``wait_for`` polls a probe.

Idempotence: steps are keyed by ``<incident>/<index>`` in the store. A step
recorded as finished is never run again; one found ``running`` (the console
stopped mid-step) is marked ``interrupted`` and not repeated, since it may have
acted. A step that needs confirmation holds the rest of its plan until
:meth:`Executor.confirm` or :meth:`Executor.decline`. An incident a more severe
one took over (``Incident.supersedes``) is resolved and its unrun steps skipped,
so confirming its old plan later does nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import msgspec
from loguru import logger

from agents.protocol import ActionResult
from playbooks.clock import Clock, SystemClock
from playbooks.model import ACTING_STEPS
from playbooks.notify import CommandOutcome, DefaultNotifier, SubprocessRunner
from playbooks.plans import Incident, Plan, PlannedStep
from playbooks.scheduler import DrainRefused, drain_argv
from playbooks.store import STEP_DONE_STATES, IncidentStore, StepRecord, UnknownIncident

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

# Agent action for each node-level step (agents.protocol.ACTIONS).
STEP_ACTIONS: dict[str, str] = {
    "capture_scene": "capture_scene",
    "isolate_node": "isolate",
    "checkpoint_now": "checkpoint_now",
    "pause_training": "pause",
    "restart_from_checkpoint": "restart_from",
}


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


class CommandRunner(Protocol):
    async def run(self, argv: list[str], timeout: float) -> CommandOutcome: ...


class Notifier(Protocol):
    async def notify(self, step: PlannedStep, incident: Incident, text: str, escalation: bool) -> str: ...


class ConditionProbe(Protocol):
    """Answers wait_for conditions (heartbeat, isolated, training, checkpoint) from the console's state."""

    def holds(self, condition: str, node: str) -> bool: ...


class StepFailed(Exception):
    """A step did not do what it should; the message is the outcome recorded."""


class Executor:
    """Runs plans the engine made; one instance per console, sharing its store."""

    def __init__(self, store: IncidentStore, sink: ActionSink, *, clock: Clock | None = None,
                 runner: CommandRunner | None = None, notifier: Notifier | None = None,
                 probe: ConditionProbe | None = None, scheduler: str = "none", who: str = "gridwatch",
                 poll_interval: float = 0.5) -> None:
        self.store = store
        self.sink = sink
        self.clock = clock or SystemClock()
        self.runner = runner or SubprocessRunner()
        self.notifier = notifier or DefaultNotifier()
        self.probe = probe
        self.scheduler = scheduler
        self.who = who
        self.poll_interval = poll_interval

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
        """A node is back in service: give it back to the scheduler if the drain is ours; the outcome, audited."""
        outcome = "no scheduler configured: nothing to resume" if self.scheduler == "none" else "not drained by gridwatch"
        self.store.audit(who, f"return_to_service {node}", reason, phase="after", outcome=outcome)
        return outcome

    async def resume(self) -> list[str]:
        """After a restart: carry on every stored plan that has steps left. Returns their incident ids."""
        resumed = self.store.unfinished()
        for incident_id in resumed:
            await self._continue(incident_id)
        return resumed

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
        self.store.set_step(step_id, "declined", f"declined by {who}")
        for later in self.store.steps(record.incident):
            if later.index > record.index and later.state not in STEP_DONE_STATES:
                self.store.set_step(later.id, "skipped", f"step {record.index + 1} was declined")
        return self.store.steps(record.incident)

    # -------------------------------------------------------------- internals

    def _stand_down(self, incident_id: str, by: Incident) -> None:
        """A more severe incident took over this one: what it has not run (or waits to confirm) never runs."""
        if self.store.incident(incident_id) is None:
            return
        why = f"superseded by {by.id} ({by.severity} {by.playbook})"
        for record in self.store.steps(incident_id):
            if record.state not in STEP_DONE_STATES and record.state != "running":
                self.store.set_step(record.id, "skipped", why)
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
        log = logger.bind(node=incident.node)
        escalated = any(a.what == "escalate" for a in self.store.audit_log(incident_id))
        stop_reason = ""
        for record in self.store.steps(incident_id):
            step = record.planned
            if record.state in STEP_DONE_STATES:
                continue
            if stop_reason:
                self.store.set_step(step.id, "skipped", stop_reason)
                continue
            if record.state == "awaiting_confirmation":
                break  # the rest waits for the operator
            if record.state == "running":
                self.store.set_step(step.id, "interrupted", "the console stopped while this ran; not repeated")
                self.store.audit(self.who, step.step, "resumed plan", incident=incident_id, step=step.id,
                                 phase="after", outcome="interrupted: outcome unknown, not repeated")
                continue
            decision = record.decision
            if decision == "skip":
                self.store.set_step(step.id, "skipped", step.reason)
                continue
            if decision == "needs_confirmation":
                self.store.set_step(step.id, "awaiting_confirmation", step.reason)
                self.store.audit(self.who, step.step, step.reason, incident=incident_id, step=step.id,
                                 phase="engine", outcome="waiting for an operator")
                break
            if decision == "escalate":
                self.store.set_step(step.id, "escalated", step.reason)
                if not escalated:
                    escalated = True
                    await self._escalate(incident, step, step.reason)
                continue
            who = confirmed_by or self.who
            why = f"{incident.playbook}: {incident.summary}"
            self.store.audit(who, self._describe(step), why, incident=incident_id, step=step.id, phase="before")
            self.store.set_step(step.id, "running", started=True)
            try:
                outcome = await asyncio.wait_for(self._perform(step, incident), step.timeout)
                state = "done"
            except asyncio.TimeoutError:
                outcome, state = f"timed out after {step.timeout:g}s", "failed"
            except (StepFailed, DrainRefused, OSError, RuntimeError, ValueError) as exc:
                outcome, state = str(exc) or exc.__class__.__name__, "failed"
            self.store.set_step(step.id, state, outcome)
            self.store.audit(who, self._describe(step), why, incident=incident_id, step=step.id, phase="after",
                             outcome=f"{state}: {outcome}")
            log.info("{} {} -> {}: {}", incident.id, step.step, state, outcome)
            if state == "done" and step.step in ACTING_STEPS:
                self.store.mark_acted(incident_id, self.clock.now())
            if state == "failed" and not step.continue_on_failure:
                stop_reason = f"step {step.index + 1} ({step.step}) failed: {outcome}"
                if not escalated:
                    escalated = True
                    await self._escalate(incident, step, stop_reason)
        return self.store.steps(incident_id)

    async def _tell_unrecorded(self, plan: Plan, trouble: str) -> None:
        """The plan runs, but its record is only in memory: the people its plan would tell hear that too."""
        told = next((s for s in plan.steps if s.step in ("notify", "escalate")), None)
        step = msgspec.structs.replace(told, message="") if told is not None else PlannedStep(
            id=f"{plan.incident.id}/store", incident=plan.incident.id, playbook=plan.incident.playbook, index=-1,
            step="escalate", target=plan.incident.node, at=self.clock.now(), timeout=10.0)
        text = f"{plan.incident.id} is acted on but not yet recorded: {trouble}"
        try:
            await asyncio.wait_for(self.notifier.notify(step, plan.incident, text, True), step.timeout)
        except (asyncio.TimeoutError, OSError, RuntimeError, ValueError) as exc:
            logger.bind(node=plan.incident.node).error("could not tell anyone that {}: {}", text, exc)

    def _describe(self, step: PlannedStep) -> str:
        where = ",".join(step.nodes) if step.nodes else step.target
        return f"{step.step} on {where}"

    async def _escalate(self, incident: Incident, step: PlannedStep, reason: str) -> None:
        text = f"{incident.id} needs a human: {reason}"
        try:
            outcome = await asyncio.wait_for(self.notifier.notify(step, incident, text, True), step.timeout)
        except (asyncio.TimeoutError, OSError, RuntimeError, ValueError) as exc:
            outcome = f"escalation could not be sent: {exc or exc.__class__.__name__}"
        self.store.audit(self.who, "escalate", reason, incident=incident.id, step=step.id, phase="after",
                         outcome=outcome)

    async def _perform(self, step: PlannedStep, incident: Incident) -> str:
        reason = f"{incident.playbook}: {incident.summary}"
        if step.step in ("notify", "escalate"):
            return await self.notifier.notify(step, incident, step.message or incident.summary,
                                              step.step == "escalate")
        if step.step == "drain_node":
            argv = drain_argv(step.scheduler or self.scheduler, step.target, reason)
            if argv is None:
                return "no scheduler backend configured: nothing to drain"
            result = await self.runner.run(argv, step.timeout)
            if result.returncode != 0:
                raise StepFailed(f"{argv[0]} exited {result.returncode}: {result.output.strip()[-200:]}")
            return " ".join(argv[:2]) + " ok"
        if step.step == "wait_for":
            return await self._wait(step)
        action = STEP_ACTIONS[step.step]
        args: dict[str, Any] = {"incident": incident.id}
        if step.step == "restart_from_checkpoint":
            args.update(restart_args(step))
        if not step.nodes:
            raise StepFailed("no node to send it to")
        results = await asyncio.gather(*(self._act(n, action, args, reason) for n in step.nodes))
        failed = [f"{n}: {msg}" for n, ok, msg in results if not ok]
        if failed:
            raise StepFailed("; ".join(failed))
        return f"{action} ok on {len(results)} node{'s' if len(results) != 1 else ''}"

    async def _act(self, node: str, action: str, args: dict[str, Any], reason: str) -> tuple[str, bool, str]:
        try:
            result = await self.sink.act(node, action, dict(args), reason)
        except (OSError, RuntimeError, ConnectionError) as exc:
            return node, False, str(exc) or exc.__class__.__name__
        return node, bool(result.ok), str(result.message)

    async def _wait(self, step: PlannedStep) -> str:
        if self.probe is None:
            raise StepFailed("no condition probe: cannot wait")
        node = step.target
        while not self.probe.holds(step.condition or "", node):
            await asyncio.sleep(self.poll_interval)
        return f"{step.condition} holds on {node}"
