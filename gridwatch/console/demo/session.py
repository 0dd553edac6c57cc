"""One demo run: a local cluster plus the console's own runtime attached to it as operator, and what happened.

The demo writes a cluster.toml for its agents and builds the runtime from it
exactly as ``gridwatch console --cluster`` does; the runtime detects, acts,
retries and marks recoveries. The demo only adds the faults it injects, the
repairs of chaos mode, and a summary measured from the trainer's own metrics.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from gridwatch.console.demo.chaos import Chaos, FaultSpec, ScriptedFault, run_script
from gridwatch.console.demo.cluster import Cluster, ClusterOptions
from gridwatch.console.demo.progress import TrainingWatch
from gridwatch.console.demo.summary import DemoSummary, FaultRecord, IncidentFacts, summarize
from gridwatch.console.demo.trust import TrustLedger
from gridwatch.console.runtime.core import ConsoleRuntime
from gridwatch.wire import protocol as p

if TYPE_CHECKING:
    from gridwatch.console.runtime.config import SummaryEvery

Say = Callable[[str], None]
# A fault the demo injected itself and the agent's own report of it are one fault.
_SAME_FAULT_S = 5.0


@dataclass
class DemoOptions:
    cluster: ClusterOptions = field(default_factory=ClusterOptions)
    directory: str | None = None  # default: a new temporary directory, removed afterwards
    chaos_every: float | None = None
    repair_after: float = 40.0  # chaos or a drill: a node taken out comes back after this long
    faults: tuple[ScriptedFault, ...] = ()  # a drill: these faults at these times (--fault)
    seed: int | None = None
    tick_interval: float = 0.5
    skip_playbooks: tuple[str, ...] = ()  # shipped playbooks left out, by name
    act: bool = True  # False: incidents are made, but no step that changes the job or a node is sent
    scheduler: str = "none"  # what drain_node tells: none | slurm | kubernetes
    operator: str = "demo-operator"  # who acts, in the audit log
    # etcd endpoints: the demo's console campaigns for the lead, and a console attached with its
    # cluster.toml shares the acting with it (one leads, the others observe).
    etcd: tuple[str, ...] = ()
    summary_every: SummaryEvery = "auto"  # seconds between a node's summaries, or "auto" (by the fleet's size)


class DemoSession:
    """Start with ``await start()``, always ``await close()``; run headless or under the console in between."""

    def __init__(self, options: DemoOptions, say: Say | None = None, clock: Callable[[], float] = time.time) -> None:
        self.options = options
        self.say = say or (lambda line: None)
        self.clock = clock
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if options.directory:
            self.dir = Path(options.directory)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="gridwatch-demo-")
            self.dir = Path(self._tmp.name)
        self.cluster = Cluster(self.dir, options.cluster, progress=self._progress)
        self.faults: list[FaultRecord] = []
        self.watch = TrainingWatch(self.dir / "run" / "metrics.jsonl", clock)
        self.started_at = clock()
        self.trust = TrustLedger(self.started_at)
        self.runtime: ConsoleRuntime | None = None
        self.fleet: Any = None  # the runtime's, once started
        self.store: Any = None  # the runtime's incident store
        self.engine: Any = None  # the runtime's playbook engine
        self._tasks: list[asyncio.Task[Any]] = []
        self._notes: list[str] = []

    def _progress(self, line: str) -> None:
        self.say(f"demo: {line}")

    def _stamp(self) -> str:
        return f"[{self.clock() - self.started_at:7.1f}s]"

    # ---------------------------------------------------------------- start

    async def start(self) -> None:
        """Start the cluster and build the runtime from the cluster.toml written for it (not connected yet)."""
        from gridwatch.console.runtime.config import ClusterConfig, load_cluster, write_cluster
        from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime

        state = await self.cluster.start()
        if self.cluster.trainer_note:
            self._notes.append(self.cluster.trainer_note)
        # The same file `gridwatch console --cluster` reads: a second console can attach with it.
        path = write_cluster(self.dir / "cluster.toml", ClusterConfig(
            nodes=[n.endpoint for n in state.nodes], key=str(Path(state.operator_key).resolve()),
            known_hosts=str(Path(state.known_hosts).resolve()), db=str((self.dir / "incidents.db").resolve()),
            scheduler=self.options.scheduler, operator=self.options.operator, etcd=list(self.options.etcd),
            summary_every=self.options.summary_every))
        try:
            options = RuntimeOptions.from_cluster(
                load_cluster(path), backoff_max=2.0, tick_interval=self.options.tick_interval,
                acting=self.options.act, skip_playbooks=self.options.skip_playbooks, stop_wait=5.0,
                etcd=list(self.options.etcd))
            runtime = build_runtime(options)
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None
        hooks = runtime.hooks
        hooks.plan.append(self._on_plan)
        hooks.action.append(self._on_action)
        hooks.frame.append(self._on_frame)
        hooks.link.append(self._on_status)
        hooks.alert.append(lambda why: self._progress(why or "alert cleared"))
        hooks.recovered.append(self._on_recovered)
        if runtime.election is not None:
            # A line each time the demo's console changes role, as a headless console prints.
            runtime.election.on_change.append(lambda standing: self._progress(standing.line))
        self.runtime, self.fleet, self.store, self.engine = runtime, runtime.fleet, runtime.plan_store, runtime.engine
        fleet_options = getattr(runtime.fleet, "options", None)
        if fleet_options is not None:
            from gridwatch.console.runtime.config import cadence_line

            self._progress(cadence_line(fleet_options.summary_every, len(getattr(runtime.fleet, "links", ()))))
        mode = "active" if self.options.act else "watching only (no step that acts is sent)"
        count = len(runtime.engine.playbooks) if runtime.engine is not None else 0
        self._progress(f"{count} playbooks {mode}; incidents and audit in {self.dir / 'incidents.db'}; "
                       f"watch from another terminal: gridwatch console --cluster {path} --read-only")
        self.started_at = self.clock()
        self.trust = TrustLedger(self.started_at)

    async def attach(self) -> None:
        """Connect to every agent as operator and start acting (the console does this itself when shown)."""
        assert self.runtime is not None
        await self.runtime.start()
        self._begin()

    def _begin(self) -> None:
        self._tasks.append(asyncio.create_task(self._poll_training()))
        if self.options.chaos_every:
            import random

            chaos = Chaos(self.inject, self._in_service, self.options.chaos_every, self.options.cluster.gpus,
                          rng=random.Random(self.options.seed))
            self._tasks.append(asyncio.create_task(chaos.run()))
            self._progress(f"chaos: a random fault every ~{self.options.chaos_every:g} s")
        if self.options.faults:
            started = self.clock()
            self._tasks.append(asyncio.create_task(run_script(self.options.faults, self.inject,
                                                              lambda: self.clock() - started)))
            self._progress(f"drill: {len(self.options.faults)} faults, the last at "
                           f"{max(f.after_s for f in self.options.faults):g} s")

    async def wait_connected(self, timeout: float = 30.0) -> None:
        deadline = self.clock() + timeout
        while self.fleet.connected < len(self.fleet.links):
            if self.clock() > deadline:
                raise TimeoutError(f"only {self.fleet.connected} of {len(self.fleet.links)} agents connected "
                                   f"after {timeout:g} s; see {self.dir / 'logs'}")
            await asyncio.sleep(0.1)
        self._progress(f"console attached to {len(self.fleet.links)} agents as operator")

    # --------------------------------------------------------------- frames

    def _on_frame(self, link: Any, frame: p.Frame) -> None:
        if isinstance(frame, p.Event) and frame.kind == "fault_injected":
            node = str(frame.node) or link.name
            kind = str(frame.details.get("fault", "")) or "fault"
            self._record_fault(FaultRecord(node=node, kind=kind, at=frame.ts or self.clock(), code=frame.code,
                                           gpu=frame.gpu))

    def _on_status(self, link: Any) -> None:
        self.say(f"{self._stamp()} link {link.name}: {link.state}" + (f" ({link.last_error})" if link.last_error else ""))

    def _on_plan(self, plan: Any) -> None:
        inc = plan.incident
        steps = ", ".join(s.step if s.decision == "act" else f"{s.step} [{s.decision}]" for s in plan.steps)
        self.say(f"{self._stamp()} incident {inc.id} {inc.severity} on {inc.node}: {inc.summary} -> {steps or 'no steps'}")

    def _on_action(self, node: str, action: str, result: p.ActionResult) -> None:
        self.say(f"{self._stamp()}   {action} on {node}: {'ok' if result.ok else 'FAILED'} {result.message}")
        if result.ok and action == p.AgentAction.ISOLATE:
            self.trust.isolated(node, self.clock(), self._isolated_by(node), self.faults)

    def _isolated_by(self, node: str) -> str:
        """The playbook whose plan isolates ``node`` now: its newest open incident."""
        open_here = [i for i in self.engine.incidents() if i.node == node and i.closed_at is None] if self.engine else []
        return max(open_here, key=lambda i: i.opened_at).playbook if open_here else "a playbook"

    def _on_recovered(self, row: Any) -> None:
        detect = "-" if row.detect_s is None else f"{row.detect_s:.1f} s"
        self.say(f"{self._stamp()} incident {row.id} recovered: the job trains past step {row.fault_step}; "
                 f"detected in {detect}, recovered in {row.recover_s:.1f} s")

    def _record_fault(self, fault: FaultRecord) -> None:
        for known in self.faults:
            if known.node == fault.node and known.kind == fault.kind and abs(known.at - fault.at) < _SAME_FAULT_S:
                return
        self.faults.append(fault)

    # --------------------------------------------------------------- faults

    def _in_service(self) -> list[str]:
        out = {n.name for n in self.engine.nodes.values() if n.out or n.lost} if self.engine else set()
        return [n for n in self.cluster.names() if n not in out and self.cluster.agents[n].alive()]

    async def inject(self, node: str, spec: FaultSpec, gpu: int = 0) -> p.ActionResult:
        """Inject a fault through the operator action inject_fault, as `gridwatch fault` does (audited)."""
        assert self.runtime is not None
        at = self.clock()
        result = await self.runtime.node_action(node, p.AgentAction.INJECT_FAULT, f"demo fault: {spec.label}", spec.args(gpu),
                                                who="demo-chaos")
        self.say(f"{self._stamp()} fault {spec.label} on {node} gpu {gpu}: {'ok' if result.ok else 'FAILED'} {result.message}")
        if result.ok:
            self._record_fault(FaultRecord(node=node, kind=spec.kind, at=at, code=spec.code, gpu=gpu))
            if self.options.chaos_every or self.options.faults:
                self._tasks.append(asyncio.create_task(self._repair_later(node)))
        return result

    async def _repair_later(self, node: str) -> None:
        """Chaos and drills: the technician fixes the node and puts it back, so a long soak keeps its nodes."""
        await asyncio.sleep(self.options.repair_after)
        if self.cluster.respawn_agent(node):
            self.say(f"{self._stamp()} repair: agent on {node} restarted")
            await asyncio.sleep(3.0)
        assert self.runtime is not None
        for action in (p.AgentAction.CLEAR_FAULTS, p.AgentAction.UNISOLATE):
            # Through the runtime: audited, and an unisolate hands the node back to the scheduler.
            result = await self.runtime.node_action(node, action, "demo repair: node fixed", who="demo-repair")
            if not result.ok:
                self.say(f"{self._stamp()} repair: {action} on {node} FAILED {result.message}")
                return
        self.trust.returned(node, self.clock())
        if self.cluster.trainer is not None:
            # Its trainer left the job when it was isolated: start it again; it joins the running job.
            from gridwatch.trainer.launch import LaunchError, request_rejoin

            try:
                request_rejoin(self.cluster.run_dir, node)
            except (LaunchError, OSError) as exc:
                self.say(f"{self._stamp()} repair: cannot ask {node}'s trainer to rejoin: {exc}")
        # The technician closes the node's tickets: its next fault is a new incident, not a repeat.
        for incident in list(self.engine.incidents()):
            if incident.node == node:
                try:
                    self.runtime.resolve(incident.id, "node fixed and back in service", who="demo-repair")
                except LookupError:
                    pass  # never planned, so never stored
        self.say(f"{self._stamp()} repair: {node} back in service")

    # ------------------------------------------------------------- training

    async def _poll_training(self) -> None:
        while True:
            self.watch.poll()
            if self.engine is not None:
                # Who the job counts as its members, as each node still in service last said it.
                self.trust.check_members({n.name: n.members for n in self.engine.nodes.values()
                                          if not n.out and not n.lost}, self.clock())
            await asyncio.sleep(0.25)

    # --------------------------------------------------------------- report

    def incident_facts(self) -> list[IncidentFacts]:
        facts = []
        for rec in self.store.incidents():
            steps = self.store.steps(rec.id)
            finished = [s.finished_at for s in steps if s.finished_at is not None]
            facts.append(IncidentFacts(id=rec.id, node=rec.node, kind=rec.kind, playbook=rec.playbook,
                                       detected_at=rec.detected_at,
                                       actions=[s.step for s in steps if s.state == "done"],
                                       acted_until=max(finished) if finished else None))
        return facts

    def summary(self) -> DemoSummary:
        """What the run did, measured from the injected faults and the trainer's own metrics."""
        self.watch.poll()
        summary = summarize(self.faults, self.incident_facts(), self.watch.points, self.started_at, self.clock(),
                            self._notes)
        summary.trust = self.trust.summary()
        return summary

    # --------------------------------------------------------------- close

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.runtime is not None:
            await self.runtime.stop()
        await asyncio.to_thread(self.cluster.stop)
        if self.store is not None:
            self.store.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        logger.debug("demo closed")
