"""The loop closed: an incident is recovered once its job trains past the step it was at when the fault came.

Each recovered incident keeps its time to detect and to recover, and what it cost (steps and GPU-hours lost).
"""

from __future__ import annotations

from dataclasses import dataclass

from loguru import logger

from gridwatch.console.fleet.goodput import IncidentSpan
from gridwatch.console.runtime.base import RuntimeBase
from gridwatch.console.runtime.incidents import IncidentRow, StoreIncidents
from gridwatch.playbooks.store import OPEN_STATES
from gridwatch.wire.readings import SchedulerJob

# Plan steps still to come: an incident in this state has not settled yet.
_UNSETTLED = frozenset({"planned", "running", "awaiting_confirmation"})


@dataclass(slots=True)
class _Recovery:
    """An incident waiting for its job to train past the step it was at when the fault came."""

    incident: str
    job: str
    fault_step: int | None  # None: the console had seen no training step when the fault came
    settled: bool = False  # its plan has nothing left to run
    settled_step: int | None = None  # the job's step then (or the first one seen after it)
    # The scheduler's restart count of the job at the fault (Slurm), None when no node named it. Once the plan
    # requeued the job, only steps of a later life count: its old ranks print on while they die.
    lives: int | None = None
    requeued: bool = False


class Recovering(RuntimeBase):
    """Incidents waited on until their job trains past the fault; their spans and costs."""

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

    def job_step(self, job: str = "", after_life: int | None = None) -> int | None:
        """The step ``job`` has trained to: the most advanced trainer among its nodes still in it; with
        ``after_life``, among the nodes that run a life of it past that restart count only."""
        if self.engine is None:
            summary = self.store.training()
            return summary.status.step if summary is not None else None
        steps = [n.trainer_step for n in self.engine.nodes.values()
                 if n.trainer_step is not None and not n.out and not n.lost and (not job or not n.job or n.job == job)
                 and (after_life is None or any(_named(j, job) and j.restarts > after_life
                                                for j in n.scheduler_jobs))]
        return max(steps) if steps else None

    def job_life(self, job: str) -> int | None:
        """The scheduler's restart count of ``job`` (named ``slurm-42``) where its nodes name it; None: unknown."""
        if self.engine is None or not job:
            return None
        lives = [j.restarts for n in self.engine.nodes.values() for j in n.scheduler_jobs if _named(j, job)]
        return max(lives) if lives else None

    def settle(self, incident_id: str) -> None:
        """Its plan has nothing left to run (or waits for an operator): from here the job must train past the fault."""
        watch = self._recoveries.get(incident_id)
        if watch is None or watch.settled:
            return
        if self.executor is not None and not self.read_only and self.plan_store is not None:
            if any(s.state in _UNSETTLED for s in self.plan_store.steps(incident_id)):
                return
        if watch.lives is not None and self.plan_store is not None:
            watch.requeued = any(s.step == "requeue_job" and s.state == "done"
                                 for s in self.plan_store.steps(incident_id))
        now_step = self.job_step(watch.job)
        watch.settled = True
        # Steps reported before a restore can still be in the store: the job must pass those too.
        known = [s for s in (watch.fault_step, now_step) if s is not None]
        watch.settled_step = max(known) if known else None

    def _check_recoveries(self) -> None:
        assert self.plan_store is not None
        now = self.store.clock.now()
        # A job's step is a walk over every node: once a tick per job, not once per incident waiting on it
        # (five incidents of one job on 1,000 nodes were a quarter of a relayed console's CPU).
        steps: dict[tuple[str, int | None], int | None] = {}
        for watch in list(self._recoveries.values()):
            if not watch.settled:
                continue
            asked = (watch.job, watch.lives if watch.requeued else None)
            if asked not in steps:
                steps[asked] = self.job_step(*asked)
            step = steps[asked]
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
        for rec in self.plan_store.incidents(states=OPEN_STATES):
            if rec.fault_step is not None and rec.recovered_at is None and rec.id not in self._recoveries:
                incident = self.plan_store.stored_incident(rec.id)
                self._recoveries[rec.id] = _Recovery(rec.id, incident.job if incident else "", rec.fault_step)
                self.settle(rec.id)


def _named(job: SchedulerJob, name: str) -> bool:
    """``job`` is the one a trainer status names ``name`` (the agent names a log's job ``slurm-42``)."""
    return name == job.job_name()


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"
