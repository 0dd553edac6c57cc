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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loguru import logger

from gridwatch.playbooks.clock import Clock
from gridwatch.playbooks.durations import format_duration
from gridwatch.playbooks.guards import GuardLedger, apply_guards
from gridwatch.playbooks.history import FleetHistory
from gridwatch.playbooks.model import (
    JOB_STEPS,
    REMOVING_STEPS,
    ConditionTrigger,
    EventTrigger,
    LogTrigger,
    MetricTrigger,
    Playbook,
    Step,
)
from gridwatch.playbooks.plans import JOB_TARGET, Incident, Plan, PlannedStep
from gridwatch.wire.protocol import (
    HEARSAY_VERSION,
    STALE_AFTER_INTERVALS,
    WATCH_METRICS,
    WATCH_OPS,
    Event,
    Frame,
    Hello,
    LogLine,
    Sample,
    Summary,
    Text,
    Watch,
    severity_rank,
)
from gridwatch.wire.xid import xid_catalog

if TYPE_CHECKING:
    from gridwatch.playbooks.blame_collectives import CollectiveVerdict
    from gridwatch.playbooks.seed import SeedSummary
    from gridwatch.playbooks.store import IncidentStore

# A node is gone for job-wide steps after this many hello intervals of silence.
# A restart planned this soon after another, which already left the node out,
# would only restart the job a second time for the same event.
RESTART_COALESCE = 60.0
# A removal that failed is planned again when its node reports, this many times at most (then an operator).
MAX_REPLANS = 3
# A report that blames another node (``target: detail:...``) counts once this
# many distinct nodes made it: every rank of a job reports its straggler, and
# one agent alone must not get a healthy node isolated.
BLAME_REPORTERS = 2
BLAME_WINDOW = 60.0  # seconds the reports of one step may lie apart, at least (a trigger's ``within`` if longer)
_BLAME_SWEEP = 4096  # above this many blamed (node, step)s, stale ones are forgotten
_HISTORY = 1000  # closed incidents kept for the console and replay summaries
# A collective verdict names the cause of its job's hang incidents that open this long after it: a
# frozen trainer is reported (trainer_exit) only after the agent's grace, when the records are long read.
BLAME_FRESH = 60.0


@dataclass
class NodeState:
    """What the engine knows of one node, keyed by the name its agent reports."""

    name: str
    endpoint: str = ""
    interval: float = 1.0  # the heartbeat in force: the hello's tick, or the summaries' cadence while they come
    hello_interval: float = 1.0
    last_seen: float = 0.0
    job: str = ""
    stack_hash: str = ""
    reported_isolated: bool = False
    removed: bool = False  # a removing step of ours succeeded: it is out of the job
    removing: int = 0  # removing steps planned whose outcome is not in yet (kept off job-wide steps meanwhile)
    replan: str = ""  # the incident whose removal failed: planned again when the node next reports
    seeded_out: bool = False  # removed before a console restart; the agent's next report says if it still is
    lost: bool = False
    hearsay: bool = False  # no agent speaks for it: read from Prometheus (never taken out on that word alone)
    unheard_via: str = ""  # the relay carrying it is down: its silence is the relay's, no evidence about it
    excused_at: float = float("-inf")  # silence before this is not held against it (its relay was down)
    trainer_step: int | None = None
    checkpoint_steps: frozenset[int] = frozenset()  # from its last TrainerStatus.checkpoints (tier -> step)
    members: frozenset[str] = frozenset()  # its trainer's job members, from its last TrainerStatus (empty: not said)
    boot_id: str = ""  # from its last hello: with a seq, names one frame of one agent run
    last_ident: str = ""  # identity of the last frame it sent (what a lost heartbeat is named after)
    hello_ident: str = ""  # identity of its last hello (what a stack mismatch is named after)

    @property
    def out(self) -> bool:
        return self.reported_isolated or self.removed

    @property
    def live_key(self) -> tuple[bool, bool, bool, str, bool]:
        """What decides whether job-wide steps go to it: its cached lists change only when this does."""
        return self.lost, self.out, self.removing > 0, self.job, self.hearsay


@dataclass
class _Symptom:
    node: str
    gpu: int | None
    summary: str
    details: dict[str, str] = field(default_factory=dict)
    ident: str = ""  # the identity of the frame behind it (see Engine._identity)
    code: int | None = None  # the XID code, for the repeat rule (same XID, same scope)


_ID_SAFE = re.compile(r"[^A-Za-z0-9]")


def _blame(event: Event) -> str:
    """What an XID points at (XidBlame), from the catalogue; empty for another event or an unlisted code."""
    entry = xid_catalog().get(event.code) if event.kind == "xid" and event.code is not None else None
    return str(entry.blame) if entry is not None else ""


def _share(seen: deque[tuple[float, str]]) -> float:
    """Of the numbered marks (training steps) from the lowest to the highest, the fraction reported."""
    steps = [int(m) for _, m in seen if m.isdigit()]
    return len(steps) / (max(steps) - min(steps) + 1) if steps else 1.0


def agent_can_watch(pb: Playbook) -> Watch | None:
    """The playbook's metric condition as the agent evaluates it (per-GPU metrics the wire names), or None."""
    trig = pb.trigger
    if not isinstance(trig, MetricTrigger):
        return None
    cond = trig.condition
    if cond.metric not in WATCH_METRICS or cond.op not in WATCH_OPS:
        return None
    return Watch(name=Text(pb.name), metric=Text(cond.metric), op=Text(cond.op), threshold=cond.threshold, hold=cond.hold)


def agent_watches(playbooks: Iterable[Playbook]) -> list[Watch]:
    """What a console asks its agents to watch for these playbooks (Subscribe.watches)."""
    return [w for w in (agent_can_watch(pb) for pb in playbooks) if w is not None]


class Engine:
    """Matches playbooks against what nodes report and plans what to do."""

    def __init__(self, playbooks: Iterable[Playbook], clock: Clock) -> None:
        self.clock = clock
        self.playbooks: tuple[Playbook, ...] = tuple(playbooks)
        self.nodes: dict[str, NodeState] = {}
        self._names: dict[str, str] = {}  # endpoint -> node name
        self._open: dict[tuple[str, str], Incident] = {}  # (playbook, scope key) -> open incident
        # Indexes over _open, kept by _add_open/_drop_open, so no frame or plan walks every open incident:
        self._open_keys: dict[str, tuple[str, str]] = {}  # incident id -> its key in _open
        self._on_node: dict[str, set[str]] = {}  # node -> ids of open incidents acting on it
        self._live: dict[str, list[str]] = {}  # job -> live_nodes(job), dropped when a node's live_key changes
        self._sizes: dict[str, int] | None = None  # job -> its nodes (node add or job change drops it)
        self._planned: dict[str, int] = {}  # incident id -> steps planned for it so far (a re-plan goes on from there)
        self._replans: dict[str, int] = {}  # incident id -> times a failed removal was planned again
        self._pending: dict[str, float] = {}  # incident id -> when to plan it
        self._by_id: dict[str, Incident] = {}
        self._closed: deque[Incident] = deque(maxlen=_HISTORY)
        self._counts: dict[tuple[str, str], deque[tuple[float, str]]] = {}  # reports counted: (time, distinct mark)
        # metric condition true since (console time, identity of the first sample it held in)
        self._holds: dict[tuple[str, str, int | None], tuple[float, str]] = {}
        self._latched: set[tuple[str, str, str]] = set()  # (playbook, node, why) fired and still true
        # Silence before this moment is no evidence about a node: the console itself was stalled then.
        self._awake_since = float("-inf")
        self.ledger = GuardLedger()
        self._restarts: dict[str, tuple[float, str, set[str]]] = {}  # job -> (when, incident, nodes)
        self._frame_ident = ""  # identity of the frame being observed, for the incidents it opens
        # (playbook, blamed node, distinct mark) -> reporter -> when it last said so
        self._blamers: dict[tuple[str, str, str], dict[str, float]] = {}
        self._codes: dict[str, int] = {}  # incident id -> the XID code that opened it
        # (playbook, scope key, XID code) -> when a plan of it let its ``repeat.after`` step act
        self._fixes_of_code: dict[tuple[str, str, int | None], deque[float]] = {}
        self.history = FleetHistory()  # every node's and GPU's incidents, remediations and verdicts
        self._verdicts: dict[str, tuple[float, CollectiveVerdict]] = {}  # job -> (when, newest verdict with a culprit)
        # (the playbooks it was made for, their metric playbooks, those of them no agent can watch)
        self._metric_cache: tuple[tuple[Playbook, ...], tuple[Playbook, ...], tuple[Playbook, ...]] | None = None
        self._heartbeat_cache: tuple[tuple[Playbook, ...], list[tuple[Playbook, ConditionTrigger]]] | None = None

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
        self._frame_ident = node.last_ident = self._identity(node, frame, now)
        before = node.live_key
        try:
            plans = self._observe(node, frame, now)
            if node.replan:
                plans += self._replan(node, now)
            return plans
        finally:
            self._frame_ident = ""
            self._touched(node, before)

    def _touched(self, node: NodeState, before: tuple[bool, bool, bool, str, bool]) -> None:
        """``node``'s live_key was ``before``: the cached live lists (and job sizes) follow a change."""
        if node.live_key != before:
            self._live.clear()
            if node.job != before[3]:
                self._sizes = None

    @staticmethod
    def _identity(node: NodeState, frame: Frame, now: float) -> str:
        """What names a frame the same way on every console: its own time, plus boot id and seq when known.

        Incident ids are built on it, never on the console's clock, so two
        consoles (or one that stalled) name one fault alike and the agents'
        idempotency keys hold across them. A frame without a time (hand-made
        in a test) falls back to the clock.
        """
        ident = str(int(frame.ts if frame.ts > 0 else now))
        if node.boot_id and frame.seq > 0:
            ident += f".{node.boot_id}.{frame.seq}"
        return ident

    def _observe(self, node: NodeState, frame: Frame, now: float) -> list[Plan]:
        plans: list[Plan] = []
        summarised = isinstance(frame, Summary)
        if isinstance(frame, Summary):
            # Its cadence is the node's heartbeat now (lost after 3 of them). It is read as a
            # sample (isolated, trainer) and made one only if a playbook needs its metrics.
            node.interval = max(node.hello_interval, frame.every)
        elif isinstance(frame, Sample):
            node.interval = node.hello_interval  # whole samples again (an operator opened it): one a tick
        if isinstance(frame, Event) and frame.kind in ("condition_held", "condition_cleared"):
            return self._agent_condition(node, frame, now)
        if isinstance(frame, Hello):
            node.hello_ident = self._frame_ident
            node.hearsay = str(frame.agent_version) == HEARSAY_VERSION
            node.hello_interval = frame.interval if frame.interval > 0 else node.hello_interval
            node.interval = node.hello_interval
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
            if frame.trainer is not None:
                node.job = str(frame.trainer.job or node.job)
                node.trainer_step = frame.trainer.step
                node.checkpoint_steps = frozenset(frame.trainer.checkpoints.values())
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
        # Every node's state first: nodes that went quiet together must all be
        # known lost before any plan picks the live nodes to restart on.
        for node in self.nodes.values():
            lost = now - self._silent_since(node) > STALE_AFTER_INTERVALS * node.interval
            if lost != node.lost:
                node.lost = lost
                self._live.clear()
        heartbeats = self._heartbeat_books()
        for node in list(self.nodes.values()) if heartbeats else ():
            if node.unheard_via:
                continue  # its relay is down: the relay's incident, not a lost heartbeat of each node behind it
            silent = now - self._silent_since(node)
            for pb, trig in heartbeats:
                if silent <= trig.missed * node.interval:
                    continue
                latch = (pb.name, node.name, "heartbeat")
                if latch not in self._latched and not node.out:
                    self._latched.add(latch)
                    summary = (f"no frame from {node.name} for {silent:.0f}s "
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
                node = self.nodes[name] = NodeState(name=name, last_seen=self.clock.now())
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

    def _standing_verdict(self, pb: Playbook, job: str, now: float) -> CollectiveVerdict | None:
        if not pb.blame:
            return None
        kept = self._verdicts.get(job)
        if kept is None or now - kept[0] > BLAME_FRESH:
            return None
        return kept[1]

    def _blamed_nodes(self, verdict: CollectiveVerdict) -> list[str]:
        return [n for n in verdict.nodes if n in self.nodes] or verdict.nodes

    def _apply_blame(self, incident: Incident, pb: Playbook, verdict: CollectiveVerdict, now: float,
                     act_on: bool) -> None:
        incident.blamed = self._blamed_nodes(verdict)
        incident.blame_why = verdict.summary
        incident.notes.append(f"{now:.3f} collective records: {verdict.summary}")
        if pb.blame and act_on:
            self._act_on(incident, incident.blamed[0])
            incident.summary = verdict.summary

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

    def _live_nodes(self, job: str) -> list[str]:
        cached = self._live.get(job)
        if cached is None:
            cached = self._live[job] = sorted(
                n.name for n in self.nodes.values()
                if not n.lost and not n.out and not n.removing and not n.hearsay  # no agent: nothing to send to
                and (not job or not n.job or n.job == job))
        return cached

    def _job_size(self, job: str) -> int:
        """How many nodes a plan for ``job`` counts against the blast radius (those of no known job too)."""
        if self._sizes is None:
            sizes: dict[str, int] = {}
            for n in self.nodes.values():
                sizes[n.job] = sizes.get(n.job, 0) + 1
            self._sizes = sizes
        return (self._sizes.get(job, 0) + self._sizes.get("", 0)) if job else len(self.nodes)

    # --------------------------------------------------------------- matching

    def _node_for(self, source: str, frame: Frame, now: float) -> NodeState:
        name = str(frame.node) or self._names.get(source, source)
        self._names[source] = name
        node = self.nodes.get(name)
        if node is None:
            node = self.nodes[name] = NodeState(name=name, endpoint=source)
            self._sizes = None
            self._live.clear()
        node.last_seen = now
        if node.lost:
            node.lost = False
            self._live.clear()
        for incident in self._open_on(name):
            if incident.kind == "heartbeat_lost" and incident.recovered_at is None:
                incident.recovered_at = now
                incident.notes.append(f"{now:.3f} recovered: {name} is sending frames again")
        for pb, _ in self._heartbeat_books():
            self._latched.discard((pb.name, name, "heartbeat"))
        return node

    def _heartbeat_books(self) -> list[tuple[Playbook, ConditionTrigger]]:
        """The heartbeat playbooks, picked once per set of playbooks (a tick and every frame ask)."""
        cached = self._heartbeat_cache
        if cached is None or cached[0] is not self.playbooks:
            books = [(pb, pb.trigger) for pb in self.playbooks
                     if isinstance(pb.trigger, ConditionTrigger) and pb.trigger.condition == "heartbeat_lost"]
            cached = self._heartbeat_cache = (self.playbooks, books)
        return cached[1]

    def _open_on(self, name: str) -> list[Incident]:
        """The open incidents acting on node ``name``, from the index (never a walk of every open incident)."""
        found = []
        for incident_id in self._on_node.get(name, ()):
            incident = self._by_id.get(incident_id)
            if incident is not None and incident.node == name and incident_id in self._open_keys:
                found.append(incident)
        return found

    def _add_open(self, key: tuple[str, str], incident: Incident) -> None:
        self._open[key] = incident
        self._open_keys[incident.id] = key
        self._on_node.setdefault(incident.node, set()).add(incident.id)

    def _drop_open(self, incident: Incident) -> tuple[str, str] | None:
        key = self._open_keys.pop(incident.id, None)
        if key is not None:
            self._open.pop(key, None)
        for name in {incident.node, *incident.blamed}:
            ids = self._on_node.get(name)
            if ids is not None:
                ids.discard(incident.id)
                if not ids:
                    del self._on_node[name]
        return key

    def _act_on(self, incident: Incident, name: str) -> None:
        """The incident acts on ``name`` from now on (blame or a cause found): the node index follows."""
        self._on_node.get(incident.node, set()).discard(incident.id)
        incident.node = name
        if incident.id in self._open_keys:
            self._on_node.setdefault(name, set()).add(incident.id)

    def _match_event(self, node: NodeState, event: Event, now: float) -> list[Plan]:
        plans: list[Plan] = []
        for pb in self.playbooks:
            trig = pb.trigger
            if isinstance(trig, LogTrigger):
                plans += self._match_log(node, str(event.message), str(event.source), now, only=pb)
                continue
            if not isinstance(trig, EventTrigger) or event.kind not in trig.kinds:
                continue
            if trig.codes and event.code not in trig.codes:
                continue
            if trig.severities and event.severity not in trig.severities:
                continue
            if trig.resolutions and str(event.resolution) not in trig.resolutions:
                continue
            if trig.blames and _blame(event) not in trig.blames:
                continue
            if trig.message is not None and not trig.message.search(str(event.message)):
                continue
            if any(not p.search(str(event.details.get(k, ""))) for k, p in trig.details):
                continue
            what = f"xid {event.code}" if event.kind == "xid" and event.code is not None else str(event.kind)
            where = f"{node.name} gpu {event.gpu}" if event.gpu is not None else node.name
            summary = f"{what} on {where}" + (f": {event.message}" if event.message else "")
            symptom = _Symptom(node.name, event.gpu, summary, {k: str(v) for k, v in event.details.items()},
                               code=event.code if event.kind == "xid" else None)
            target = self._target(pb, symptom)
            if target is None:
                logger.bind(node=node.name).debug("{}: {} names no node we know; not counted", pb.name, summary)
                continue
            if target != node.name and not self._corroborated(pb, trig, node, target, symptom, now):
                continue
            if self._persists(pb, trig, _Symptom(target, symptom.gpu, "", symptom.details), now):
                plans += self._symptom(pb, symptom, now)
        return plans

    def _target(self, pb: Playbook, symptom: _Symptom) -> str | None:
        """The node a symptom is about: its reporter, or the node a ``detail:`` target names (None if unknown).

        Every rank reports a straggler, naming the slow one; falling back to the
        reporter would blame the healthy nodes that noticed it.
        """
        if not pb.target.startswith("detail:"):
            return symptom.node
        named = symptom.details.get(pb.target.split(":", 1)[1], "")
        return named if named in self.nodes else None

    def _corroborated(self, pb: Playbook, trig: EventTrigger, reporter: NodeState, blamed: str,
                      symptom: _Symptom, now: float) -> bool:
        """Whether a report by ``reporter`` blaming ``blamed`` may count: said by enough distinct nodes.

        A node never blames one outside its own trainer's members (when its
        trainer says who they are); and one report, however often repeated,
        is one node's word: it counts once :data:`BLAME_REPORTERS` nodes said
        the same (the same step, for a playbook counting distinct steps).
        """
        log = logger.bind(node=reporter.name)
        if reporter.members and blamed not in reporter.members:
            log.debug("{}: blames {}, which is not in its trainer's job; not counted", pb.name, blamed)
            return False
        mark = symptom.details.get(trig.distinct, "") if trig.distinct else ""
        window = max(trig.within, BLAME_WINDOW)
        if len(self._blamers) > _BLAME_SWEEP:
            self._blamers = {k: who for k, who in self._blamers.items() if now - max(who.values()) <= window}
        said = self._blamers.setdefault((pb.name, blamed, mark), {})
        said[reporter.name] = now
        for name, when in list(said.items()):
            if now - when > window:
                del said[name]
        if len(said) < BLAME_REPORTERS:
            log.debug("{}: {} blamed by {} alone so far; not counted yet", pb.name, blamed, reporter.name)
            return False
        return True

    def _persists(self, pb: Playbook, trig: EventTrigger, about: _Symptom, now: float) -> bool:
        """True once the reports about one scope are many, spread and dense enough (see EventTrigger)."""
        if trig.count <= 1 and not trig.hold:
            return True
        seen = self._counts.setdefault((pb.name, self._scope_key(pb, about)), deque())
        mark = about.details.get(trig.distinct, "") if trig.distinct else ""
        if not mark or all(m != mark for _, m in seen):
            seen.append((now, mark))
        while seen and now - seen[0][0] > trig.within:
            seen.popleft()
        if trig.share is not None:
            # Sparse old reports are not part of a run that is going on now.
            while len(seen) >= trig.count and _share(seen) < trig.share:
                seen.popleft()
        if len(seen) < trig.count or seen[-1][0] - seen[0][0] < trig.hold:
            return False
        if trig.share is not None and _share(seen) < trig.share:
            return False
        seen.clear()
        return True

    def _match_log(self, node: NodeState, line: str, source: str, now: float,
                   only: Playbook | None = None) -> list[Plan]:
        plans: list[Plan] = []
        for pb in (only,) if only else self.playbooks:
            trig = pb.trigger
            if not isinstance(trig, LogTrigger) or not trig.pattern.search(line):
                continue
            if trig.source is not None and not trig.source.search(source):
                continue
            symptom = _Symptom(node.name, None, f"log on {node.name}: {line[:200]}")
            if self._counted(pb, symptom, trig.count, trig.within, now):
                plans += self._symptom(pb, symptom, now)
        return plans

    def _counted(self, pb: Playbook, symptom: _Symptom, count: int, within: float, now: float) -> bool:
        """True once ``count`` symptoms on one scope fell within ``within``."""
        return self._persists(pb, EventTrigger(frozenset(), count=count, within=within), symptom, now)

    def _agent_condition(self, node: NodeState, event: Event, now: float) -> list[Plan]:
        """A condition the agent evaluated (its window held, or it cleared): taken as this engine's own finding.

        The latch is the one :meth:`_match_metrics` uses, so a condition both the agent
        and this engine see hold opens one incident.
        """
        pb = self._playbook(str(event.details.get("playbook", "")))
        if pb is None or not isinstance(pb.trigger, MetricTrigger) or event.gpu is None:
            return []
        cond = pb.trigger.condition
        if str(event.details.get("condition", "")) != str(cond):
            return []  # about a condition this console no longer has (its playbooks were reloaded)
        latch = (pb.name, node.name, f"metric:{event.gpu}")
        if event.kind == "condition_cleared":
            self._latched.discard(latch)
            self._holds.pop((pb.name, node.name, event.gpu), None)
            return []
        if latch in self._latched:
            return []
        self._latched.add(latch)
        value = str(event.details.get("value", "N/A"))
        held = str(event.details.get("held_s", "?"))
        summary = f"{cond.metric} = {value} on {node.name} gpu {event.gpu} ({cond}, held {held}s, seen by the agent)"
        return self._symptom(pb, _Symptom(node.name, event.gpu, summary, ident=self._frame_ident), now)

    def _metric_books(self, agent_watched: bool) -> tuple[Playbook, ...]:
        """The metric playbooks this engine evaluates itself (from summaries: those the agent cannot), kept per set."""
        cached = self._metric_cache
        if cached is None or cached[0] is not self.playbooks:
            mine = tuple(pb for pb in self.playbooks if isinstance(pb.trigger, MetricTrigger))
            cached = self._metric_cache = (self.playbooks, mine, tuple(pb for pb in mine if agent_can_watch(pb) is None))
        return cached[2] if agent_watched else cached[1]

    def _match_metrics(self, node: NodeState, frame: Sample | Summary, now: float, agent_watched: bool = False) -> list[Plan]:
        """Metric conditions on one sample; from a summary, the ones the agent evaluates are left to it."""
        plans: list[Plan] = []
        books = self._metric_books(agent_watched)
        if not books:
            return plans  # the common case at scale: the agents watch every metric condition
        sample = frame.as_sample() if isinstance(frame, Summary) else frame
        for pb in books:
            trig = pb.trigger
            if not isinstance(trig, MetricTrigger):  # never: _metric_books keeps only those; this tells mypy
                continue
            cond = trig.condition
            for gpu, value in cond.readings(sample):
                key = (pb.name, node.name, gpu)
                latch = (pb.name, node.name, f"metric:{gpu}")
                if not cond.holds(value):
                    self._holds.pop(key, None)
                    self._latched.discard(latch)
                    continue
                # Named after the sample it began in: every console saw that one alike.
                since, ident = self._holds.setdefault(key, (now, self._frame_ident))
                if now - since >= cond.hold and latch not in self._latched:
                    self._latched.add(latch)
                    where = f"{node.name} gpu {gpu}" if gpu is not None else node.name
                    summary = f"{cond.metric} = {value:g} on {where} ({cond}, held {now - since:.0f}s)"
                    plans += self._symptom(pb, _Symptom(node.name, gpu, summary, ident=ident), now)
        return plans

    def _check_stacks(self, now: float) -> list[Plan]:
        books = [pb for pb in self.playbooks
                 if isinstance(pb.trigger, ConditionTrigger) and pb.trigger.condition == "stack_mismatch"]
        hashes = [n.stack_hash for n in self.nodes.values() if n.stack_hash]
        if not books or len(hashes) < 3:
            return []  # with fewer than three nodes there is no majority to differ from
        majority = max(set(hashes), key=hashes.count)
        if hashes.count(majority) * 2 <= len(hashes):
            return []
        plans: list[Plan] = []
        for node in self.nodes.values():
            if not node.stack_hash or node.stack_hash == majority:
                continue
            for pb in books:
                latch = (pb.name, node.name, f"stack:{node.stack_hash}")
                if latch in self._latched:
                    continue
                self._latched.add(latch)
                summary = (f"{node.name} runs software stack {node.stack_hash[:12]}, "
                           f"{hashes.count(majority)} of {len(hashes)} nodes run {majority[:12]}")
                plans += self._symptom(pb, _Symptom(node.name, None, summary, ident=node.hello_ident), now)
        return plans

    # -------------------------------------------------------------- incidents

    def _playbook(self, name: str) -> Playbook | None:
        return next((pb for pb in self.playbooks if pb.name == name), None)

    def _new_id(self, base: str) -> str:
        """``base``, or ``base-2``, ``base-3``... when an incident opened from the same frame holds it."""
        taken = self._by_id  # every incident this engine made or took back, open or closed
        if base not in taken:
            return base
        n = 2
        while f"{base}-{n}" in taken:
            n += 1
        return f"{base}-{n}"

    def _scope_key(self, pb: Playbook, symptom: _Symptom) -> str:
        node = self.nodes.get(symptom.node)
        if pb.scope == "job":
            return f"job:{node.job}" if node and node.job else "job"
        if pb.scope == "gpu" and symptom.gpu is not None:
            return f"{symptom.node}/gpu{symptom.gpu}"
        return symptom.node

    def _cause_for(self, node: str) -> Incident | None:
        """The oldest open node-fault incident acting on ``node`` (any playbook)."""
        causes = [i for i in self._open_on(node) if i.state in ("open", "pending")
                  and (pb := self._playbook(i.playbook)) is not None and pb.removes_nodes]
        return min(causes, key=lambda i: i.opened_at) if causes else None

    def _merge(self, incident: Incident, symptom: _Symptom, now: float, why: str) -> None:
        incident.symptoms += 1
        incident.last_seen_at = now
        if symptom.node not in incident.reporters:
            incident.reporters.append(symptom.node)
        if why:
            incident.notes.append(f"{now:.3f} {why}")

    def _symptom(self, pb: Playbook, symptom: _Symptom, now: float) -> list[Plan]:
        target = self._target(pb, symptom) or symptom.node
        reporter = self.nodes.get(symptom.node)
        standing = self._standing_verdict(pb, reporter.job if reporter else "", now)
        if standing is not None:
            target = self._blamed_nodes(standing)[0]  # the records name the cause: not the reporter
        superseded: Incident | None = None
        state = self.nodes.get(target)
        removes = pb.removes_nodes or (standing is not None and any(s.action in REMOVING_STEPS for s in pb.blame_plan))
        if removes and pb.target != "cause":
            cause = self._cause_for(target)
            if state is not None and state.out:
                # Already out of the job: its later errors need no new plan.
                if cause is not None:
                    self._merge(cause, symptom, now, "")
                return []
            if cause is not None and cause.playbook != pb.name:
                if cause.kind == "heartbeat_lost" and pb.kind != "heartbeat_lost":
                    # Silence is no evidence of this fault: it gets its own capture and removal.
                    superseded = cause
                elif severity_rank(cause.severity) >= severity_rank(pb.severity):
                    self._merge(cause, symptom, now, f"also {pb.name}: {symptom.summary}")
                    return []
                # A worse fault on the node: its own plan must run, and the
                # milder incident (maybe still waiting for an operator) ends here.
                superseded = cause
        if pb.target == "cause":
            cause = self._newest_node_fault(now, pb.dedup_window, pb.severity)
            if cause is not None and (standing is None or cause.node == target):
                self._merge(cause, symptom, now, f"symptom {pb.name} from {symptom.node} attributed to this fault")
                return []
        key = self._scope_key(pb, _Symptom(target, symptom.gpu, ""))
        incident = self._open.get((pb.name, key))
        if incident is not None:
            self._merge(incident, symptom, now, "")
            return []
        node_state = self.nodes.get(symptom.node)
        if target != symptom.node:
            symptom.summary += f" (acting on {target})"
        ident = symptom.ident or self._frame_ident or str(int(now))
        incident = Incident(
            id=self._new_id(f"{pb.name}:{key}:{ident}"), playbook=pb.name, kind=pb.kind, severity=pb.severity,
            scope=pb.scope, node=target, gpu=symptom.gpu if pb.scope == "gpu" else None,
            job=node_state.job if node_state else "", summary=symptom.summary, opened_at=now,
            last_seen_at=now, reporters=[symptom.node], state="pending" if pb.settle else "open",
        )
        if symptom.details.get("step", "").isdigit():
            incident.symptom_step = int(symptom.details["step"])
            incident.notes.append(f"{now:.3f} first symptom at training step {incident.symptom_step}")
        self._add_open((pb.name, key), incident)
        self._by_id[incident.id] = incident
        if symptom.code is not None:
            self._codes[incident.id] = symptom.code
        logger.bind(node=target).info("incident {}: {}", incident.id, incident.summary)
        if superseded is not None:
            self._supersede(superseded, incident, now)
        if standing is not None:
            self._apply_blame(incident, pb, standing, now, act_on=True)
        if pb.settle and standing is None:  # blamed already: nothing left to wait for
            self._pending[incident.id] = now + pb.settle
            return []
        plan = self._plan(incident, now)
        return [plan] if plan else []

    def _supersede(self, old: Incident, new: Incident, now: float) -> None:
        """``new`` (a more severe fault on the same node) takes over ``old`` and its symptoms."""
        self._pending.pop(old.id, None)
        new.symptoms += old.symptoms
        new.reporters = sorted(set(new.reporters) | set(old.reporters))
        new.supersedes.append(old.id)
        new.notes.append(f"{now:.3f} took over {old.id} ({old.severity} {old.playbook}): a more severe fault")
        old.merged_into = new.id
        old.state = "merged"
        self._close(old, now, f"superseded by {new.id} ({new.severity} {new.playbook}); its plan stops here")

    def _newest_node_fault(self, now: float, lookback: float, at_least: str) -> Incident | None:
        """The newest node fault that can explain a job-wide symptom of severity ``at_least``.

        A milder incident (a straggler waiting for an operator) never swallows a
        worse symptom: the symptom's own plan finds its cause instead.
        """
        faults = [i for i in self._open.values()
                  if i.state in ("open", "pending") and now - i.opened_at <= lookback
                  and severity_rank(i.severity) >= severity_rank(at_least)
                  and (pb := self._playbook(i.playbook)) is not None and pb.removes_nodes]
        return max(faults, key=lambda i: i.opened_at) if faults else None

    def _close(self, incident: Incident, now: float, why: str) -> None:
        self._drop_open(incident)
        if incident.state != "merged":
            incident.state = "closed"
        incident.closed_at = now
        incident.notes.append(f"{now:.3f} {why}")
        self._closed.append(incident)

    # ------------------------------------------------------------------ plans

    def _plan(self, incident: Incident, now: float) -> Plan | None:
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
        if g.repeat_after is not None and g.repeat_max is not None:
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
        job_size = self._job_size(incident.job) or 1
        hearsay = self.nodes.get(incident.node)
        if hearsay is not None and hearsay.hearsay:
            for step in steps:
                if step.decision != "act":
                    continue
                if step.step in REMOVING_STEPS or step.step == "reset_gpu":
                    step.decision = "skip"
                    step.reason = (f"{incident.node} is known only from Prometheus: no gridwatch agent speaks "
                                   f"for it, and no node is taken out on an exporter's word alone")
                elif step.step == "capture_scene":
                    # Skipped, not failed: the plan goes on to tell people (notify, Alertmanager).
                    step.decision = "skip"
                    step.reason = f"{incident.node} is known only from Prometheus: no gridwatch agent there keeps a scene"
        apply_guards(pb, key, steps, self.ledger, job_size, now)
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
        return Plan(incident=incident, steps=steps)

    def step_finished(self, step: PlannedStep, state: str, outcome: str = "") -> None:
        """A planned step's outcome (the executor tells each): a node is out of the job only once its
        removal is done. A removal that failed puts the node back in, and its incident is planned again
        when the node next reports (a link that was down is up then)."""
        if step.step not in REMOVING_STEPS or state in ("running", "pending", "planned", "awaiting_confirmation"):
            return
        for name in step.nodes:
            node = self.nodes.get(name)
            if node is None:
                continue
            before = node.live_key
            node.removing = max(0, node.removing - 1)
            if state == "done":
                node.removed = True
                node.replan = ""
            elif state == "failed":
                incident = self._by_id.get(step.incident)
                # A heartbeat incident's node that reports again is back: nothing to plan again.
                if incident is not None and incident.kind != "heartbeat_lost" and incident.id in self._open_keys:
                    node.replan = incident.id
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

    def _replan(self, node: NodeState, now: float) -> list[Plan]:
        """``node`` reports again after its removal failed: its incident's plan is made anew."""
        incident = self._by_id.get(node.replan)
        node.replan = ""
        if incident is None or incident.id not in self._open_keys or node.out:
            return []
        tries = self._replans[incident.id] = self._replans.get(incident.id, 0) + 1
        if tries > MAX_REPLANS:
            incident.notes.append(f"{now:.3f} removal failed {tries - 1} times; left to an operator")
            return []
        incident.notes.append(f"{now:.3f} {node.name} reports again: planned again (try {tries + 1})")
        plan = self._plan(incident, now)
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
            if job_wide and not live:
                step.decision, step.reason = "skip", "no live node left in the job to send it to"
            steps.append(step)
        return steps
