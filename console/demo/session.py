"""One demo run: the cluster, the fleet attached as operator, the playbooks acting, and what happened."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from agents import protocol as p
from console.demo.chaos import Chaos, FaultSpec
from console.demo.cluster import Cluster, ClusterOptions
from console.demo.progress import TrainingWatch
from console.demo.summary import DemoSummary, FaultRecord, IncidentFacts, summarize
from console.supervise import FleetSink, Supervisor

Say = Callable[[str], None]
# A fault the demo injected itself and the agent's own report of it are one fault.
_SAME_FAULT_S = 5.0


@dataclass
class DemoOptions:
    cluster: ClusterOptions = field(default_factory=ClusterOptions)
    directory: str | None = None  # default: a new temporary directory, removed afterwards
    chaos_every: float | None = None
    repair_after: float = 40.0  # chaos: a node taken out comes back after this long
    seed: int | None = None
    tick_interval: float = 0.5
    skip_playbooks: tuple[str, ...] = ()  # shipped playbooks left out, by name
    act: bool = True  # False: incidents are made, but no step that changes the job or a node is sent


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
        self.trainer_status: dict[str, p.TrainerStatus] = {}
        self.watch = TrainingWatch(self.dir / "run" / "metrics.jsonl", clock)
        self.started_at = clock()
        self.fleet: Any = None
        self.store: Any = None
        self.engine: Any = None
        self.supervisor: Supervisor | None = None
        self.runtime: Any = None  # the console's runtime when a screen is attached
        self._tasks: list[asyncio.Task[Any]] = []
        self._notes: list[str] = []

    def _progress(self, line: str) -> None:
        self.say(f"demo: {line}")

    def _stamp(self) -> str:
        return f"[{self.clock() - self.started_at:7.1f}s]"

    # ---------------------------------------------------------------- start

    async def start(self) -> None:
        from console.fleet import Fleet, FleetOptions
        from console.hostlist import Endpoint
        from playbooks.clock import SystemClock
        from playbooks.engine import Engine
        from playbooks.executor import Executor
        from playbooks.loader import load_builtin
        from playbooks.store import IncidentStore

        state = await self.cluster.start()
        if self.cluster.trainer_note:
            self._notes.append(self.cluster.trainer_note)
        endpoints = [Endpoint(n.host, n.port) for n in state.nodes]
        self.fleet = Fleet(endpoints, FleetOptions(key_path=state.operator_key, known_hosts=state.known_hosts,
                                                   backoff_max=2.0),
                           on_frame=self._on_frame, on_status=self._on_status)
        self.store = IncidentStore(self.dir / "incidents.db",
                                   on_trouble=lambda why: self._progress(why or "incident database written again"))
        playbooks = tuple(pb for pb in load_builtin() if pb.name not in self.options.skip_playbooks)
        unknown = set(self.options.skip_playbooks) - {pb.name for pb in load_builtin()}
        if unknown:
            raise RuntimeError(f"no shipped playbook named {', '.join(sorted(unknown))}")
        self.engine = Engine(playbooks, SystemClock())
        executor = Executor(self.store, FleetSink(self.fleet, on_action=self._on_action, args_hook=self._checkpoint_step,
                                       acting=self.options.act), who="playbook")
        self.supervisor = Supervisor(self.engine, executor, on_plan=self._on_plan,
                                     tick_interval=self.options.tick_interval)
        mode = "active" if self.options.act else "watching only (no step that acts is sent)"
        self._progress(f"{len(playbooks)} playbooks {mode}; incidents and audit in {self.dir / 'incidents.db'}")
        self.started_at = self.clock()

    async def attach(self) -> None:
        """Connect to every agent as operator and start acting (the console does this itself when shown)."""
        assert self.fleet is not None and self.supervisor is not None
        await self.fleet.start()
        self._begin()

    def _begin(self) -> None:
        assert self.supervisor is not None
        self.supervisor.start()
        self._tasks.append(asyncio.create_task(self._poll_training()))
        if self.options.chaos_every:
            import random

            chaos = Chaos(self.inject, self._in_service, self.options.chaos_every, self.options.cluster.gpus,
                          rng=random.Random(self.options.seed))
            self._tasks.append(asyncio.create_task(chaos.run()))
            self._progress(f"chaos: a random fault every ~{self.options.chaos_every:g} s")

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
        if self.runtime is not None:
            self.runtime.on_frame(link, frame)
        node = str(frame.node) or link.name
        if isinstance(frame, p.Sample) and frame.trainer is not None:
            self.trainer_status[node] = frame.trainer
        elif isinstance(frame, p.Event) and frame.kind == "fault_injected":
            kind = str(frame.details.get("fault", "")) or "fault"
            self._record_fault(FaultRecord(node=node, kind=kind, at=frame.ts or self.clock(), code=frame.code,
                                           gpu=frame.gpu))
        assert self.supervisor is not None
        self.supervisor.feed(node, frame)

    def _on_status(self, link: Any) -> None:
        if self.runtime is not None:
            self.runtime.on_status(link)
        self.say(f"{self._stamp()} link {link.name}: {link.state}" + (f" ({link.last_error})" if link.last_error else ""))

    def _on_plan(self, plan: Any) -> None:
        inc = plan.incident
        steps = ", ".join(s.step if s.decision == "act" else f"{s.step} [{s.decision}]" for s in plan.steps)
        self.say(f"{self._stamp()} incident {inc.id} {inc.severity} on {inc.node}: {inc.summary} -> {steps or 'no steps'}")

    def _on_action(self, node: str, action: str, result: p.ActionResult) -> None:
        self.say(f"{self._stamp()}   {action} on {node}: {'ok' if result.ok else 'FAILED'} {result.message}")

    def _checkpoint_step(self, node: str, action: str, args: dict[str, Any]) -> dict[str, Any]:
        """Name the checkpoint step for restart_from: the trainer wants a step, a playbook says "newest"."""
        if action != "restart_from" or "step" in args:
            return args
        # Every node gets the same step: the newest any trainer reports (a node that just rejoined
        # may still show its old process's checkpoints).
        steps = sorted({s for status in self.trainer_status.values() for s in status.checkpoints.values()})
        if args.get("checkpoint") == "before" and args.get("before_step") is not None:
            steps = [s for s in steps if s < int(args["before_step"])]
        if steps:
            args = {**args, "step": steps[-1]}
        return args

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
        """Inject a fault through the operator action inject_fault, as `gridwatch fault` does."""
        at = self.clock()
        result = await self.fleet.action(node, "inject_fault", spec.args(gpu), reason=f"demo fault: {spec.label}")
        self.say(f"{self._stamp()} fault {spec.label} on {node} gpu {gpu}: {'ok' if result.ok else 'FAILED'} {result.message}")
        if result.ok:
            self._record_fault(FaultRecord(node=node, kind=spec.kind, at=at, code=spec.code, gpu=gpu))
            if self.options.chaos_every:
                self._tasks.append(asyncio.create_task(self._repair_later(node)))
        return result

    async def _repair_later(self, node: str) -> None:
        """Chaos only: the technician fixes the node and puts it back, so a long soak keeps its nodes."""
        await asyncio.sleep(self.options.repair_after)
        if self.cluster.respawn_agent(node):
            self.say(f"{self._stamp()} repair: agent on {node} restarted")
            await asyncio.sleep(3.0)
        for action in ("clear_faults", "unisolate"):
            result = await self.fleet.action(node, action, {}, reason="demo repair: node fixed")
            if not result.ok:
                self.say(f"{self._stamp()} repair: {action} on {node} FAILED {result.message}")
                return
        if self.cluster.trainer is not None:
            # Its trainer left the job when it was isolated: start it again; it joins the running job.
            from trainer.launch import LaunchError, request_rejoin

            try:
                request_rejoin(self.cluster.run_dir, node)
            except (LaunchError, OSError) as exc:
                self.say(f"{self._stamp()} repair: cannot ask {node}'s trainer to rejoin: {exc}")
        # The technician closes the node's tickets: its next fault is a new incident, not a repeat.
        for incident in list(self.engine.incidents()):
            if incident.node == node and self.engine.resolve(incident.id):
                try:
                    self.store.resolve(incident.id, "demo-repair", "node fixed and back in service")
                except LookupError:
                    pass  # never planned, so never stored
        self.say(f"{self._stamp()} repair: {node} back in service")

    # ------------------------------------------------------------- training

    async def _poll_training(self) -> None:
        while True:
            self.watch.poll()
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
        self.watch.poll()
        result = summarize(self.faults, self.incident_facts(), self.watch.points, self.started_at, self.clock(),
                           self._notes)
        for row in result.incidents:
            if row.recovered_s is not None:
                fault_at = next((f.at for f in self.faults if f.node == row.node), None)
                if fault_at is not None:
                    self.store.mark_recovered(row.id, fault_at + row.recovered_s)
        return result

    # --------------------------------------------------------------- close

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.fleet is not None:
            await self.fleet.stop()
        await asyncio.to_thread(self.cluster.stop)
        if self.store is not None:
            self.store.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        logger.debug("demo closed")
