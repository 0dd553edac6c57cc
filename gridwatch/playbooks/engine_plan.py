"""Incidents to plans: the engine's half that turns an incident into guarded steps and follows their outcomes.

:class:`Planning` finds a job-wide symptom's cause, applies the repeat rule,
the guards and the coalescing of restarts, and keeps the node states in step
with what the executor reports of each removal.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from gridwatch.playbooks.durations import format_duration
from gridwatch.playbooks.engine_state import EngineCore, NodeState
from gridwatch.playbooks.guards import apply_guards
from gridwatch.playbooks.model import JOB_STEPS, REMOVING_STEPS, Playbook, Step
from gridwatch.playbooks.plans import JOB_TARGET, Incident, Plan, PlannedStep

# A restart planned this soon after another, which already left the node out,
# would only restart the job a second time for the same event.
RESTART_COALESCE = 60.0
# A removal that failed is planned again when its node reports, this many times at most (then an operator).
MAX_REPLANS = 3
REPLAN_AFTER_S = 10.0  # ... and not before this long after it failed
# A removal told of no outcome this long after it was planned no longer keeps its nodes off job-wide steps.
REMOVAL_MAX_S = 900.0


class Planning(EngineCore):
    """The engine's planning half: an incident's plan, and what its steps' outcomes change."""

    def _plan(self, incident: Incident, now: float, retry: bool = False) -> Plan | None:
        pb = self._playbook(incident.playbook)
        if pb is None:
            return None
        incident.state = "open"
        escalate_all = ""
        by_records = pb.blame and bool(incident.blamed)  # the collective records named the cause
        if pb.target == "cause":
            cause = self._newest_node_fault(now, pb.dedup_window + pb.settle, pb.severity)
            if cause is not None and cause.id != incident.id and (not by_records or cause.node in incident.blamed):
                cause.symptoms += incident.symptoms
                cause.last_seen_at = now
                cause.reporters = sorted(set(cause.reporters) | set(incident.reporters))
                cause.notes.append(f"{now:.3f} {incident.symptoms} {pb.name} symptoms attributed to this fault")
                incident.state, incident.merged_into = "merged", cause.id
                incident.notes.append(f"{now:.3f} merged into {cause.id}: caused by {cause.node}")
                self._close(incident, now, f"merged into {cause.id}")
                return None
            job_nodes = [n for n in self.nodes.values()
                         if not n.out and (not incident.job or not n.job or n.job == incident.job)]
            silent = [n.name for n in job_nodes if n.name not in incident.reporters]
            if by_records:
                # The records say who never entered the collective: that wins over who stayed silent.
                incident.notes.append(f"{now:.3f} cause: {incident.node}, named by the collective records")
            elif len(silent) == 1 and len(incident.reporters) >= 2:
                self._act_on(incident, silent[0])
                incident.summary = (f"{pb.kind} reported by {len(incident.reporters)} nodes; cause: {silent[0]}, "
                                    f"the one node that did not report it")
                incident.notes.append(f"{now:.3f} cause: {silent[0]}, the one node of {len(job_nodes)} "
                                      f"that did not report it")
            else:
                escalate_all = (f"cannot tell which node caused it: {len(incident.reporters)} nodes reported it, "
                                f"{len(silent)} did not")
                incident.notes.append(f"{now:.3f} {escalate_all}")
        open_key = self._open_keys.get(incident.id)
        key = open_key[1] if open_key is not None else incident.node
        spec = pb.blame_plan if by_records and pb.blame_plan else pb.plan
        fixes: deque[float] | None = None
        g = pb.guards
        if g.repeat_after is not None and g.repeat_max is not None and not retry:
            fixes = self._fixes_of_code.setdefault((pb.name, key, self._codes.get(incident.id)), deque())
            while fixes and now - fixes[0] > g.repeat_window:
                fixes.popleft()
            if len(fixes) >= g.repeat_max:
                spec = g.repeat_then
                incident.summary += (f"; came back after {len(fixes)} {g.repeat_after} within "
                                     f"{format_duration(g.repeat_window)}: hardware inspection")
                incident.notes.append(f"{now:.3f} repeat rule: {incident.summary}")
        code = self._codes.get(incident.id)
        spec, judged = self.history.before_plan(pb, incident, code, spec, now)
        steps = self._steps(pb, incident, now, spec)
        if escalate_all:
            for step in steps:
                if step.step in REMOVING_STEPS or step.step in JOB_STEPS:
                    step.decision, step.reason = "escalate", escalate_all
        job_size, peers = self._blast_scope(incident)
        hearsay = self.nodes.get(incident.node)
        if hearsay is not None and hearsay.hearsay:
            for step in steps:
                if step.decision != "act":
                    continue
                if step.step in REMOVING_STEPS or step.step in ("reset_gpu", "requeue_job"):
                    step.decision = "skip"
                    step.reason = (f"{incident.node} is known only from Prometheus: no gridwatch agent speaks "
                                   f"for it, and no node is taken out on an exporter's word alone")
                elif step.step == "capture_scene":
                    # Skipped, not failed: the plan goes on to tell people (notify, Alertmanager).
                    step.decision = "skip"
                    step.reason = f"{incident.node} is known only from Prometheus: no gridwatch agent there keeps a scene"
        if not retry:  # a re-plan of a failed removal is the same decision, taken again
            apply_guards(pb, key, steps, self.ledger, job_size, now, peers)
        if fixes is not None and any(s.step == g.repeat_after and s.decision == "act" for s in steps):
            fixes.append(now)
        self._coalesce_restarts(incident, steps, now)
        self.history.after_guards(pb, incident, code, steps, judged, now)
        for step in steps:
            if step.decision == "act" and step.step in REMOVING_STEPS:
                for name in step.nodes:
                    if name in self.nodes:
                        # Out of job-wide steps from now on; out of the job once the step says it is done.
                        node = self.nodes[name]
                        before = node.live_key
                        node.removing += 1
                        self._touched(node, before)
                self._removals[step.id] = (now, [n for n in step.nodes if n in self.nodes])
        return Plan(incident=incident, steps=steps)

    def step_finished(self, step: PlannedStep, state: str, outcome: str = "") -> None:
        """A planned step's outcome (the executor tells each): a node is out of the job only once its
        removal is done. A removal that failed puts the node back in, and its incident is planned again
        when the node next reports (a link that was down is up then)."""
        if step.step not in REMOVING_STEPS or state in ("running", "pending", "planned", "awaiting_confirmation"):
            return
        counted = self._removals.pop(step.id, None)  # told once per step, whatever path told it
        for name in step.nodes:
            node = self.nodes.get(name)
            if node is None:
                continue
            before = node.live_key
            if counted is not None and name in counted[1]:
                node.removing = max(0, node.removing - 1)
            if state == "done":
                node.removed = True
                node.replan = ""
            elif state == "failed":
                incident = self._by_id.get(step.incident)
                # A heartbeat incident's node that reports again is back: nothing to plan again.
                if incident is not None and incident.kind != "heartbeat_lost" and incident.id in self._open_keys:
                    node.replan = incident.id
                    node.replan_at = self.clock.now() + REPLAN_AFTER_S
                    incident.notes.append(f"{self.clock.now():.3f} {step.step} on {name} failed ({outcome}); "
                                          f"planned again when {name} reports")
            # skipped, interrupted, escalated: not known to be out; the agent's reports say if it is
            self._touched(node, before)

    def no_longer_holds(self, incident_id: str) -> str | None:
        """Why ``incident_id``'s condition is gone, checked before each of its steps runs (a standby
        taking the lead re-checks this way too): a lost heartbeat whose node has sent frames since."""
        incident = self._by_id.get(incident_id)
        if incident is None or incident.kind != "heartbeat_lost" or incident.recovered_at is None:
            return None
        return (f"{incident.node} is sending frames again (since "
                f"{format_duration(max(0.0, incident.recovered_at - incident.opened_at))} after the incident opened)")

    def suppose_done(self, plans: Iterable[Plan]) -> None:
        """Replay and dry-run have no executor: each removal the plans let act is taken as done."""
        for plan in plans:
            for step in plan.steps:
                if step.decision == "act" and step.step in REMOVING_STEPS:
                    self.step_finished(step, "done")

    def expire_removals(self, now: float) -> None:
        """A removal told of no outcome within REMOVAL_MAX_S (a path that never reported) stops keeping its
        nodes off job-wide steps: a healthy node is never left out for good on a count."""
        for step_id, (at, names) in list(self._removals.items()):
            if now - at <= REMOVAL_MAX_S:
                continue
            del self._removals[step_id]
            for name in names:
                node = self.nodes.get(name)
                if node is not None and node.removing:
                    before = node.live_key
                    node.removing -= 1
                    self._touched(node, before)

    def _replan(self, node: NodeState, now: float) -> list[Plan]:
        """``node`` reports again after its removal failed: its incident's plan is made anew, past the guards
        (the first plan passed them; the removal is counted in the blast radius already)."""
        if now < node.replan_at:
            return []  # a link that was just down: not at its very next frame
        incident = self._by_id.get(node.replan)
        node.replan = ""
        if incident is None or incident.id not in self._open_keys or node.out:
            return []
        tries = self._replans[incident.id] = self._replans.get(incident.id, 0) + 1
        if tries > MAX_REPLANS:
            incident.notes.append(f"{now:.3f} removal failed {tries - 1} times; left to an operator")
            return []
        incident.notes.append(f"{now:.3f} {node.name} reports again: planned again (try {tries + 1})")
        plan = self._plan(incident, now, retry=True)
        return [plan] if plan is not None else []

    def _coalesce_restarts(self, incident: Incident, steps: list[PlannedStep], now: float) -> None:
        """Nodes lost together make one restart of the job, not one per node."""
        for step in steps:
            if step.step != "restart_from_checkpoint" or step.decision != "act" or step.checkpoint != "newest":
                continue
            earlier = self._restarts.get(incident.job)
            if earlier and now - earlier[0] <= RESTART_COALESCE and incident.node not in earlier[2]:
                step.decision = "skip"
                step.reason = f"the job already restarts without {incident.node} for {earlier[1]}"
            else:
                self._restarts[incident.job] = (now, incident.id, set(step.nodes))

    def _common_checkpoint(self, nodes: list[str], below: int | None) -> int | None:
        """The newest checkpoint step (below ``below`` if given) that every one of ``nodes`` reported."""
        held = [self.nodes[n].checkpoint_steps for n in nodes if n in self.nodes]
        if not held or len(held) < len(nodes) or not all(held):
            return None
        common = frozenset.intersection(*held)
        if below is not None:
            common = frozenset(s for s in common if s < below)
        return max(common) if common else None

    def _steps(self, pb: Playbook, incident: Incident, now: float,
               plan: tuple[Step, ...] | None = None) -> list[PlannedStep]:
        plan = pb.plan if plan is None else plan
        removing = {incident.node} if any(s.action in REMOVING_STEPS for s in plan) else set()
        live = [n for n in self._live_nodes(incident.job) if n not in removing]
        cause = self.nodes.get(incident.node)
        before_step = incident.symptom_step
        if before_step is None and cause is not None:
            before_step = cause.trainer_step
        steps = []
        first = self._planned.get(incident.id, 0)  # a re-plan's steps follow the earlier ones (ids stay unique)
        self._planned[incident.id] = first + len(plan)
        for index, spec in enumerate(plan, start=first):
            job_wide = spec.action in JOB_STEPS
            step = PlannedStep(
                id=f"{incident.id}/{index}", incident=incident.id, playbook=pb.name, index=index,
                step=spec.action, target=JOB_TARGET if job_wide else incident.node,
                nodes=list(live) if job_wide else ([incident.node] if spec.action not in ("notify", "escalate") else []),
                at=now, confirm=spec.confirm, timeout=spec.timeout,
                continue_on_failure=spec.continue_on_failure, scheduler=spec.scheduler,
                checkpoint=spec.checkpoint, channel=spec.channel, url=spec.url, command=list(spec.command),
                message=spec.message or incident.summary, condition=spec.condition,
            )
            if spec.action == "restart_from_checkpoint" and spec.checkpoint == "before":
                step.before_ts, step.before_step = incident.opened_at, before_step
            if spec.action == "restart_from_checkpoint":
                step.checkpoint_step = self._common_checkpoint(step.nodes, step.before_step
                                                               if spec.checkpoint == "before" else None)
            if spec.action == "requeue_job" and cause is not None and cause.trainer_attached:
                step.decision = "skip"
                step.reason = (f"the job on {incident.node} is gridwatch's trainer: it leaves the node in place "
                               f"and goes on, not requeued")
            if job_wide and not live:
                step.decision, step.reason = "skip", "no live node left in the job to send it to"
            steps.append(step)
        return steps
