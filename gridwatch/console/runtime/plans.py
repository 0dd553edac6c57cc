"""Plans: the engine's ticks and hang verdicts in, plans launched (or, read-only, only recorded), each fault noted.

The incident records the disk refused are tried again on the engine's tick.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from loguru import logger

from gridwatch.console.runtime.recoveries import Recovering, _Recovery
from gridwatch.playbooks.model import MetricTrigger
from gridwatch.wire.heard import LOOP_STALL_S

if TYPE_CHECKING:
    from gridwatch.playbooks.blame_collectives import CollectiveVerdict
    from gridwatch.playbooks.plans import Incident, Plan

# A node's own time for a fault is believed only this close before the console saw it (clocks drift).
_FAULT_SKEW_S = 300.0


class Launching(Recovering):
    """The engine ticked, its plans launched and their faults noted."""

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

    @property
    def ticking(self) -> bool:
        """The runtime runs the engine's clock rules itself (started, with a tick interval): a view need not."""
        return self._ticker is not None and not self._ticker.done()

    @property
    def busy(self) -> bool:
        """A plan is running now."""
        return bool(self._plans)

    def _launch(self, plans: list[Plan]) -> None:
        self.store.news += 1  # an incident opened or moved on: the views say so at their next tick
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
                self._recoveries[incident.id] = _Recovery(incident.id, incident.job, step,
                                                          lives=self.job_life(incident.job))

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
