"""The pure core: frames in, incidents and plans out, on an injected clock, with no I/O.

The console calls :meth:`Engine.observe` for every frame and :meth:`Engine.tick`
on a timer; replay does the same on a simulated clock. Many symptoms of one
fault make one incident: symptoms on the same scope merge, a node-fault on a
node that already has one at least as severe merges, and a job-wide symptom (an
NCCL timeout storm) waits ``settle`` seconds, then attaches to a node fault at
least as severe, or picks the one node that stayed silent, or escalates. A
more severe node fault takes over a milder open incident on its node (a
straggler waiting for an operator): the milder one is closed as merged and the
new incident lists it in ``supersedes``, so the executor stops its plan.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from gridwatch.playbooks.engine_match import BLAME_REPORTERS, BLAME_WINDOW, Matching, agent_can_watch, agent_watches
from gridwatch.playbooks.engine_plan import MAX_REPLANS, RESTART_COALESCE, Planning
from gridwatch.playbooks.engine_state import BLAME_FRESH, NodeState, _Symptom
from gridwatch.playbooks.model import Playbook
from gridwatch.playbooks.plans import Incident, Plan
from gridwatch.wire.protocol import (
    HEARSAY_VERSION,
    STALE_AFTER_INTERVALS,
    Event,
    Frame,
    Hello,
    LogLine,
    Sample,
    Summary,
    TrainerPhase,
)

if TYPE_CHECKING:
    from gridwatch.playbooks.blame_collectives import CollectiveVerdict
    from gridwatch.playbooks.seed import SeedSummary
    from gridwatch.playbooks.store import IncidentStore

# Names other modules import from here, whichever module of the engine defines them.
__all__ = [
    "BLAME_FRESH", "BLAME_REPORTERS", "BLAME_WINDOW", "MAX_REPLANS", "RESTART_COALESCE",
    "Engine", "NodeState", "agent_can_watch", "agent_watches",
]

_ID_SAFE = re.compile(r"[^A-Za-z0-9]")

# A trainer in these phases is not there to leave a node in place (the scheduler's job is what runs).
_NOT_ATTACHED = (TrainerPhase.GONE, TrainerPhase.LEFT, TrainerPhase.DONE)


class Engine(Matching, Planning):
    """Matches playbooks against what nodes report and plans what to do."""

    # ----------------------------------------------------------------- input

    def set_playbooks(self, playbooks: Iterable[Playbook]) -> None:
        """Swap in a new, already validated set; open incidents carry on."""
        self.playbooks = tuple(playbooks)

    def observe(self, source: str, frame: Frame) -> list[Plan]:
        """Take one frame from ``source`` (an endpoint or a node name); return plans made now."""
        now = self.clock.now()
        node = self._node_for(source, frame, now)
        if isinstance(frame, Hello):
            node.boot_id = _ID_SAFE.sub("", str(frame.boot_id))[:8]
            self.history.saw_gpus(node.name, frame.gpus)
        # The frame's own time (a frame without one, hand-made in a test, falls back to the clock).
        node.last_frame = (frame.ts if frame.ts > 0 else now, frame.seq)
        self._observing = node
        before = node.live_key
        try:
            plans = self._observe(node, frame, now)
            if node.replan:
                plans += self._replan(node, now)
            return plans
        finally:
            self._observing = None
            self._touched(node, before)

    def _observe(self, node: NodeState, frame: Frame, now: float) -> list[Plan]:
        plans: list[Plan] = []
        summarised = isinstance(frame, Summary)
        if isinstance(frame, Summary):
            # Its cadence is the node's heartbeat now (lost after 3 of them). It is read as a
            # sample (isolated, trainer) and made one only if a playbook needs its metrics.
            self._interval_set(node, max(node.hello_interval, frame.every))
        elif isinstance(frame, Sample):
            self._interval_set(node, node.hello_interval)  # whole samples again (an operator opened it): one a tick
        if isinstance(frame, Event) and frame.kind in ("condition_held", "condition_cleared"):
            return self._agent_condition(node, frame, now)
        if isinstance(frame, Hello):
            node.hello_ident = self._frame_ident
            node.hearsay = str(frame.agent_version) == HEARSAY_VERSION
            node.hello_interval = frame.interval if frame.interval > 0 else node.hello_interval
            self._interval_set(node, node.hello_interval)
            node.reported_isolated = frame.isolated
            self._settle_seeded(node, frame.isolated)
            # Stacks are compared on tick, once the hellos that arrive together are all in.
            node.stack_hash = str(frame.stack.hash)
        elif isinstance(frame, (Sample, Summary)):
            if node.reported_isolated and not frame.isolated:
                node.removed = False  # put back in by an operator
                self.ledger.returned(node.name, now)
            node.reported_isolated = frame.isolated
            self._settle_seeded(node, frame.isolated)
            node.trainer_attached = (frame.trainer is not None and frame.trainer.read_from is None
                                     and frame.trainer.phase not in _NOT_ATTACHED)
            if (frame.jobs or node.scheduler_jobs) and tuple(frame.jobs) != node.scheduler_jobs:
                node.scheduler_jobs = tuple(frame.jobs)  # named only when an incident opens: no text per frame
                self._by_scheduler_job = None
            if frame.trainer is not None:
                node.job = str(frame.trainer.job or node.job)
                node.trainer_step = frame.trainer.step
                node.checkpoints = frame.trainer.checkpoints
                if isinstance(frame, Sample):
                    node.members = frozenset(str(m) for m in frame.trainer.membership)
            if isinstance(frame, Summary) and frame.members is not None:
                node.members = frozenset(str(m) for m in frame.members)  # sent when it changed, not each time
            plans += self._match_metrics(node, frame, now, agent_watched=summarised)
        elif isinstance(frame, Event):
            if frame.kind == "isolated":
                node.reported_isolated = True
            elif frame.kind == "unisolated":
                node.reported_isolated = node.removed = False
                self.ledger.returned(node.name, now)
            plans += self._match_event(node, frame, now)
        elif isinstance(frame, LogLine):
            plans += self._match_log(node, str(frame.line), str(frame.source), now)
        return plans

    @staticmethod
    def _settle_seeded(node: NodeState, isolated: bool) -> None:
        if node.seeded_out:
            # Isolation outlives agent restarts; if the agent says it is in, an
            # operator put it back (or the isolation never happened).
            node.removed, node.seeded_out = isolated, False

    def excuse_silence(self, now: float) -> None:
        """The console's own loop lagged until ``now``: frames may wait unread, so a node's silence is
        measured from here on, not from its last frame (a console that stalled measures nothing)."""
        self._awake_since = max(self._awake_since, now)

    def _silent_since(self, node: NodeState) -> float:
        """From when ``node``'s silence counts: its last frame, or later when the console or its relay was
        not listening (a loop that stalled, a relay down, measure nothing)."""
        return max(node.last_seen, self._awake_since, node.excused_at)

    def relay_down(self, sources: Iterable[str], relay: str) -> None:
        """The relay carrying ``sources`` (endpoints or node names) is down: their silence is not theirs."""
        for source in sources:
            node = self.nodes.get(self._names.get(source, source))
            if node is not None:
                node.unheard_via = relay

    def relay_up(self, sources: Iterable[str], now: float) -> None:
        """Their relay is back: each node's silence counts from now, not from its last frame before."""
        for source in sources:
            node = self.nodes.get(self._names.get(source, source))
            if node is not None and node.unheard_via:
                node.unheard_via = ""
                node.excused_at = max(node.excused_at, now)

    def tick(self, now: float | None = None) -> list[Plan]:
        """Time-based work: lost heartbeats, settled incidents, closing quiet ones."""
        now = self.clock.now() if now is None else now
        plans: list[Plan] = []
        self.expire_removals(now)
        heartbeats = self._heartbeat_books()
        # Only nodes silent past the shortest threshold can be lost or owe a heartbeat; any node found lost
        # before was silent longer still, so it is among them until a frame of its own clears it.
        quiet = self._quiet_nodes(now, min([STALE_AFTER_INTERVALS, *(trig.missed for _, trig in heartbeats)]))
        # Every node's state first: nodes that went quiet together must all be
        # known lost before any plan picks the live nodes to restart on.
        for node in quiet:
            lost = now - self._silent_since(node) > STALE_AFTER_INTERVALS * node.interval
            if lost != node.lost:
                node.lost = lost
                self._live.clear()
        for node in quiet if heartbeats else ():
            if node.unheard_via:
                continue  # its relay is down: the relay's incident, not a lost heartbeat of each node behind it
            silent = now - self._silent_since(node)
            for pb, trig in heartbeats:
                if silent <= trig.missed * node.interval:
                    continue
                latch = (pb.name, node.name, "heartbeat")
                if latch not in self._latched and not node.out:
                    self._latched.add(latch)
                    # Tenths under ten seconds: a fast cadence's silence is not "0s".
                    summary = (f"no frame from {node.name} for {silent:.{1 if silent < 10 else 0}f}s "
                               f"({trig.missed:g} x its {node.interval:g}s interval)")
                    plans += self._symptom(pb, _Symptom(node.name, None, summary, ident=node.last_ident), now)
        plans += self._check_stacks(now)
        for incident_id, due in sorted(self._pending.items(), key=lambda kv: kv[1]):
            if now >= due:
                del self._pending[incident_id]
                plan = self._plan(self._by_id[incident_id], now)
                if plan is not None:
                    plans.append(plan)
        for key, incident in list(self._open.items()):
            owner = self._playbook(incident.playbook)
            window = owner.dedup_window if owner else 600.0
            ongoing = (incident.kind == "heartbeat_lost" and incident.recovered_at is None)
            if incident.state != "pending" and not ongoing and now - incident.last_seen_at > window:
                self._close(incident, now, "closed: quiet for the dedup window")
        return plans

    def seed_from(self, store: IncidentStore, now: float | None = None) -> SeedSummary:
        """After a console restart: take back open incidents and guard memory from ``store`` (see gridwatch.playbooks.seed)."""
        from gridwatch.playbooks.seed import seed_engine

        return seed_engine(self, store, self.clock.now() if now is None else now)

    def adopt(self, incident: Incident, key: str, removed: list[str],
              restart: tuple[float, list[str]] | None, reopen: bool, planned: int = 0) -> None:
        """Take back an incident planned before a restart: its removed nodes stay out, it may absorb symptoms again.

        ``planned`` is how many steps its plans recorded: a plan made for it again goes on from there."""
        self._planned[incident.id] = max(self._planned.get(incident.id, 0), planned)
        self._sizes = None
        self._live.clear()
        for name in removed:
            node = self.nodes.get(name)
            if node is None:
                # Not heard from yet: known only as out, so no heartbeat rule fires for it.
                node = self._add_node(NodeState(name=name, last_seen=self.clock.now()))
            node.removed = node.seeded_out = True
        if restart is not None and incident.job:
            when, nodes = restart
            earlier = self._restarts.get(incident.job)
            if earlier is None or earlier[0] <= when:
                self._restarts[incident.job] = (when, incident.id, set(nodes))
        self._by_id[incident.id] = incident
        if reopen:
            incident.state = "open"
            self._add_open((incident.playbook, key), incident)
        else:
            self._closed.append(incident)

    def remember_fix(self, playbook: str, key: str, code: int | None, at: float) -> None:
        """After a restart: a plan of ``playbook`` on ``key`` let its ``repeat.after`` step act at ``at`` (oldest first)."""
        self._fixes_of_code.setdefault((playbook, key, code), deque()).append(at)

    # ---------------------------------------------------------------- queries

    def incidents(self, include_closed: bool = False) -> list[Incident]:
        """Open (and pending) incidents, oldest first; closed and merged ones too if asked."""
        found = sorted(self._open.values(), key=lambda i: i.opened_at)
        return [*self._closed, *found] if include_closed else found

    def incident(self, incident_id: str) -> Incident | None:
        return self._by_id.get(incident_id)

    # ------------------------------------------------------------------ blame

    def blame(self, incident_id: str, verdict: CollectiveVerdict) -> Plan | None:
        """The ranks' collective records name the cause of ``incident_id``; the plan made now, if any.

        For a ``blame: collectives`` playbook the incident acts on the blamed
        node, and one still gathering symptoms (``settle``) is planned now. One
        already planned keeps its plan and only records who is to blame.
        """
        incident = self._by_id.get(incident_id)
        pb = self._playbook(incident.playbook) if incident is not None else None
        if incident is None or pb is None or incident.state not in ("open", "pending") or not verdict.culprits:
            return None
        now = self.clock.now()
        pending = incident.id in self._pending
        self._apply_blame(incident, pb, verdict, now, act_on=pending)
        if pending and pb.blame:
            del self._pending[incident.id]
            return self._plan(incident, now)
        return None

    def hang_verdict(self, job: str, verdict: CollectiveVerdict) -> list[Plan]:
        """A verdict over ``job``'s ranks: given to its open hang incidents, and kept for those to come."""
        if not verdict.culprits:
            return []
        self._verdicts[job] = (self.clock.now(), verdict)
        plans: list[Plan] = []
        for incident in list(self._open.values()):
            pb = self._playbook(incident.playbook)
            if pb is None or not pb.blame or incident.blamed or (job and incident.job and incident.job != job):
                continue
            plan = self.blame(incident.id, verdict)
            if plan is not None:
                plans.append(plan)
        return plans

    def resolve(self, incident_id: str) -> bool:
        """The operator resolved it: the next symptom opens a new incident."""
        incident = self._by_id.get(incident_id)
        if incident is None or incident_id not in self._open_keys:
            return False
        self._pending.pop(incident_id, None)
        self._close(incident, self.clock.now(), "resolved by an operator")
        return True

    def live_nodes(self, job: str = "") -> list[str]:
        """Nodes that job-wide steps go to: heard from recently, not taken out nor being taken out."""
        return list(self._live_nodes(job))

    # --------------------------------------------------------------- matching

    def _node_for(self, source: str, frame: Frame, now: float) -> NodeState:
        name = str(frame.node) or self._names.get(source, source)
        self._names[source] = name
        node = self.nodes.get(name)
        if node is None:
            node = self._add_node(NodeState(name=name, endpoint=source, last_seen=now))
            self._sizes = None
            self._live.clear()
        self._heard_from(node, now)
        if node.lost:
            node.lost = False
            self._live.clear()
        if self._on_node.get(name):  # most nodes have no incident open: no list is made for them
            for incident in self._open_on(name):
                if incident.kind == "heartbeat_lost" and incident.recovered_at is None:
                    incident.recovered_at = now
                    incident.notes.append(f"{now:.3f} recovered: {name} is sending frames again")
        if self._latched:
            for pb, _ in self._heartbeat_books():
                self._latched.discard((pb.name, name, "heartbeat"))
        return node
