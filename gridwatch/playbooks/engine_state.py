"""What the engine knows and the bookkeeping every half of it shares: node states, open incidents and their indexes.

:class:`EngineCore` holds the engine's state and the helpers that open, merge,
supersede and close incidents and keep the indexes over them; the matching half
(:mod:`gridwatch.playbooks.engine_match`) and the planning half
(:mod:`gridwatch.playbooks.engine_plan`) build on it, and
:class:`gridwatch.playbooks.engine.Engine` joins them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from loguru import logger

from gridwatch.playbooks.clock import Clock
from gridwatch.playbooks.guards import GuardLedger
from gridwatch.playbooks.history import FleetHistory
from gridwatch.playbooks.model import REMOVING_STEPS, ConditionTrigger, Playbook
from gridwatch.playbooks.plans import Incident, Plan
from gridwatch.wire.heard import HeardOrder
from gridwatch.wire.protocol import FAULT_AT, SchedulerJob, severity_rank

_D = TypeVar("_D")

if TYPE_CHECKING:
    from gridwatch.playbooks.blame_collectives import CollectiveVerdict

_HISTORY = 1000  # closed incidents kept for the console and replay summaries
# A collective verdict names the cause of its job's hang incidents that open this long after it: a
# frozen trainer is reported (trainer_exit) only after the agent's grace, when the records are long read.
BLAME_FRESH = 60.0


def job_words(job: SchedulerJob) -> str:
    """A scheduler job as an incident names it: ``slurm job 4242 (alice, pretrain)``."""
    who = ", ".join(str(part) for part in (job.user, job.name) if part)
    return f"{job.scheduler} job {job.id}" + (f" ({who})" if who else "")


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
    replan_at: float = 0.0  # ... from this time on
    seeded_out: bool = False  # removed before a console restart; the agent's next report says if it still is
    lost: bool = False
    hearsay: bool = False  # no agent speaks for it: read from Prometheus (never taken out on that word alone)
    unheard_via: str = ""  # the relay carrying it is down: its silence is the relay's, no evidence about it
    excused_at: float = float("-inf")  # silence before this is not held against it (its relay was down)
    trainer_step: int | None = None
    scheduler_jobs: tuple[SchedulerJob, ...] = ()  # the Slurm or Kubernetes jobs its agent found on it
    trainer_attached: bool = False  # gridwatch's trainer (or its API) answers on the node: it leaves in place
    checkpoints: Mapping[str, int] = field(default_factory=dict)  # its last TrainerStatus.checkpoints (tier -> step)
    members: frozenset[str] = frozenset()  # its trainer's job members, from its last TrainerStatus (empty: not said)
    boot_id: str = ""  # from its last hello: with a seq, names one frame of one agent run
    # The last frame it sent, by its own time and seq: what a lost heartbeat is named after (last_ident).
    last_frame: tuple[float, int] = (0.0, 0)
    hello_ident: str = ""  # identity of its last hello (what a stack mismatch is named after)

    @property
    def out(self) -> bool:
        return self.reported_isolated or self.removed

    @property
    def checkpoint_steps(self) -> frozenset[int]:
        """The steps its checkpoints hold, any tier (read when a plan picks a step, not at every frame)."""
        return frozenset(self.checkpoints.values())

    @property
    def last_ident(self) -> str:
        """What names its last frame the same way on every console: its own time, plus boot id and seq when known.

        Incident ids are built on it, never on the console's clock, so two consoles (or one that stalled) name
        one fault alike and the agents' idempotency keys hold across them. Made when an incident needs it, not
        at every frame.
        """
        ts, seq = self.last_frame
        ident = str(int(ts))
        if self.boot_id and seq > 0:
            ident += f".{self.boot_id}.{seq}"
        return ident if ts or seq else ""

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


# A dead worker's fault time is its last answer, which may come before its cause's incident opened by a
# status poll and the cause's detection (the XID is read on the agent's next tick).
CONSEQUENCE_LEAD_S = 10.0


def _began(details: dict[str, str], now: float) -> float:
    """A symptom's ``fault_at`` detail (the node's time its fault began) when it is a time before now."""
    try:
        at = float(details.get(FAULT_AT, ""))
    except ValueError:
        return now
    return at if 0 < at <= now else now


class EngineCore:
    """The engine's state and the incident bookkeeping its matching and planning halves share."""

    def __init__(self, playbooks: Iterable[Playbook], clock: Clock) -> None:
        self.clock = clock
        self.playbooks: tuple[Playbook, ...] = tuple(playbooks)
        self.nodes: dict[str, NodeState] = {}
        # The nodes by their last frame, oldest first, with their intervals: a tick reads only those quiet long
        # enough to be lost (see _quiet_nodes), not every node twice a second.
        self._heard: HeardOrder[str, NodeState] = HeardOrder()
        self._born: dict[str, int] = {}  # node -> its place in ``nodes`` (a tick's nodes keep the fleet's order)
        self._ticked_at = float("-inf")
        self._names: dict[str, str] = {}  # endpoint -> node name
        self._open: dict[tuple[str, str], Incident] = {}  # (playbook, scope key) -> open incident
        # Indexes over _open, kept by _add_open/_drop_open, so no frame or plan walks every open incident:
        self._open_keys: dict[str, tuple[str, str]] = {}  # incident id -> its key in _open
        self._on_node: dict[str, set[str]] = {}  # node -> ids of open incidents acting on it
        self._live: dict[str, list[str]] = {}  # job -> live_nodes(job), dropped when a node's live_key changes
        self._sizes: dict[str, int] | None = None  # job -> its nodes (node add or job change drops it)
        # (scheduler, job id) -> the nodes reporting it; dropped when a node's scheduler jobs change
        self._by_scheduler_job: dict[tuple[str, str], set[str]] | None = None
        self._planned: dict[str, int] = {}  # incident id -> steps planned for it so far (a re-plan goes on from there)
        self._replans: dict[str, int] = {}  # incident id -> times a failed removal was planned again
        self._removals: dict[str, tuple[float, list[str]]] = {}  # step id -> (planned at, nodes) awaiting outcome
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
        self._observing: NodeState | None = None  # the node whose frame is being observed (see _frame_ident)
        # (playbook, blamed node, distinct mark) -> reporter -> when it last said so
        self._blamers: dict[tuple[str, str, str], dict[str, float]] = {}
        self._codes: dict[str, int] = {}  # incident id -> the XID code that opened it
        # incident id -> when its fault began on the node's clock (its first symptom's fault_at), where that
        # is earlier than the incident: a trainer's loss is told only after its grace, its restart at its death.
        self._began_at: dict[str, float] = {}
        # (playbook, scope key, XID code) -> when a plan of it let its ``repeat.after`` step act
        self._fixes_of_code: dict[tuple[str, str, int | None], deque[float]] = {}
        self.history = FleetHistory()  # every node's and GPU's incidents, remediations and verdicts
        self._verdicts: dict[str, tuple[float, CollectiveVerdict]] = {}  # job -> (when, newest verdict with a culprit)
        # What is read off the playbooks per frame or per tick (see _per_playbooks): name -> (made for, what).
        self._derived: dict[str, tuple[tuple[Playbook, ...], Any]] = {}

    @property
    def _frame_ident(self) -> str:
        """The identity of the frame being observed (NodeState.last_ident), for the incidents it opens; "" outside."""
        node = self._observing
        return node.last_ident if node is not None else ""

    def _touched(self, node: NodeState, before: tuple[bool, bool, bool, str, bool]) -> None:
        """``node``'s live_key was ``before``: the cached live lists (and job sizes) follow a change."""
        if node.live_key != before:
            self._live.clear()
            if node.job != before[3]:
                self._sizes = None

    # ------------------------------------------------------------------ blame

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

    # ------------------------------------------------------------------ nodes

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

    def _blast_scope(self, incident: Incident) -> tuple[int, frozenset[str] | None]:
        """The job a plan's blast radius is counted in: its size, and its nodes when they are known.

        A node in scheduler jobs (Slurm, Kubernetes): the nodes whose agents report one of those jobs, so
        that one job losing nodes never stops another job's healing. Otherwise the trainer's job (with
        the nodes of no known job) by size, and every removal counts, as without a scheduler."""
        node = self.nodes.get(incident.node)
        if node is None or not node.scheduler_jobs:
            return self._job_size(incident.job) or 1, None
        if self._by_scheduler_job is None:
            index: dict[tuple[str, str], set[str]] = {}
            for n in self.nodes.values():
                for job in n.scheduler_jobs:
                    index.setdefault((str(job.scheduler), str(job.id)), set()).add(n.name)
            self._by_scheduler_job = index
        peers = frozenset({node.name}).union(*(self._by_scheduler_job.get((str(j.scheduler), str(j.id)), ())
                                                for j in node.scheduler_jobs))
        return len(peers), peers

    def _per_playbooks(self, name: str, make: Callable[[tuple[Playbook, ...]], _D]) -> _D:
        """What ``make`` reads off the playbooks, made again only when the set of playbooks is replaced (a reload):
        every frame and every tick ask, and the set changes a few times a week."""
        cached = self._derived.get(name)
        if cached is None or cached[0] is not self.playbooks:
            cached = self._derived[name] = (self.playbooks, make(self.playbooks))
        made: _D = cached[1]
        return made

    def _add_node(self, node: NodeState) -> NodeState:
        """A node first known now (heard from, or taken back out after a restart)."""
        self.nodes[node.name] = node
        self._born[node.name] = len(self._born)
        self._heard.heard(node.name, node, node.last_seen)
        self._heard.every(node.name, node.interval)
        return node

    def _heard_from(self, node: NodeState, now: float) -> None:
        node.last_seen = now
        self._heard.heard(node.name, node, now)

    def _interval_set(self, node: NodeState, interval: float) -> None:
        """``node``'s heartbeat is ``interval`` from now on (so a tick knows the shortest)."""
        node.interval = interval
        self._heard.every(node.name, interval)

    def _quiet_nodes(self, now: float, factor: float) -> list[NodeState]:
        """The nodes silent longer than ``factor`` times the shortest interval, in the fleet's order: every node
        that may be lost or owe a heartbeat; O(those), not O(fleet). A clock that ran back reads every node."""
        if now < self._ticked_at:
            quiet = list(self.nodes.values())
        else:
            quiet = self._heard.quiet(now, factor * self._heard.shortest(1.0))
            if len(quiet) > 1:
                quiet.sort(key=lambda node: self._born[node.name])
        self._ticked_at = now
        return quiet

    def _heartbeat_books(self) -> list[tuple[Playbook, ConditionTrigger]]:
        """The heartbeat playbooks (a tick and every frame ask)."""
        return self._per_playbooks("heartbeat", lambda books: [
            (pb, pb.trigger) for pb in books
            if isinstance(pb.trigger, ConditionTrigger) and pb.trigger.condition == "heartbeat_lost"])

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
        ids = self._on_node.get(incident.node)  # the only node it is filed under (_act_on moves it)
        if ids is not None:
            ids.discard(incident.id)
            if not ids:
                del self._on_node[incident.node]
        return key

    def _act_on(self, incident: Incident, name: str) -> None:
        """The incident acts on ``name`` from now on (blame or a cause found): the node index follows."""
        self._on_node.get(incident.node, set()).discard(incident.id)
        incident.node = name
        if incident.id in self._open_keys:
            self._on_node.setdefault(name, set()).add(incident.id)

    def _target(self, pb: Playbook, symptom: _Symptom) -> str | None:
        """The node a symptom is about: its reporter, or the node a ``detail:`` target names (None if unknown).

        Every rank reports a straggler, naming the slow one; falling back to the
        reporter would blame the healthy nodes that noticed it.
        """
        if not pb.target.startswith("detail:"):
            return symptom.node
        named = symptom.details.get(pb.target.split(":", 1)[1], "")
        return named if named in self.nodes else None

    # -------------------------------------------------------------- incidents

    def _playbook(self, name: str) -> Playbook | None:
        # From an index by name: the tick asks for every open incident's, and a rack gone quiet is a thousand
        # open heartbeat incidents (a walk of every playbook each, twice a second). The first of a name wins.
        return self._per_playbooks("by_name", lambda books: {pb.name: pb for pb in reversed(books)}).get(name)

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

    def _consequence(self, pb: Playbook, node: str, now: float, symptom_details: dict[str, str]) -> Incident | None:
        """The recent incident on ``node`` whose fault this symptom follows from (``consequence_of``), if any.

        An application XID kills the worker that caused it; its restart is the same fault told again,
        not a second one: one fault, one incident.
        """
        if not pb.consequence_of:
            return None
        kinds = set(pb.consequence_of)
        # When the symptom began, on the node's clock: a worker that died while its node was out is told
        # only when torchrun has started it again, by which time the fault's incident may be closed.
        began = _began(symptom_details, now)
        candidates = list(self._open_on(node))
        for closed in reversed(self._closed):  # in the order they closed: only the recent ones can be it
            if closed.closed_at is None or closed.closed_at < began:
                break
            if closed.node == node and closed.state != "merged":
                candidates.append(closed)
        causes = [i for i in candidates if i.playbook != pb.name
                  and -CONSEQUENCE_LEAD_S <= began - self._began_at.get(i.id, i.opened_at) <= pb.consequence_within
                  and kinds & set(i.kind.split("/"))]
        return max(causes, key=lambda i: i.opened_at) if causes else None

    def _symptom(self, pb: Playbook, symptom: _Symptom, now: float) -> list[Plan]:
        target = self._target(pb, symptom) or symptom.node
        follows = self._consequence(pb, target, now, symptom.details)
        if follows is not None:
            self._merge(follows, symptom, now, f"then {pb.name}: {symptom.summary} (a consequence of this fault)")
            return []
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
            if incident.kind == "heartbeat_lost" and incident.recovered_at is not None:
                # It sent a frame or two and went silent again: its plan (skipped as recovered) is made anew.
                incident.recovered_at = None
                incident.notes.append(f"{now:.3f} silent again: planned again")
                plan = self._plan(incident, now)
                return [plan] if plan else []
            return []
        node_state = self.nodes.get(symptom.node)
        if target != symptom.node:
            symptom.summary += f" (acting on {target})"
        held = self.nodes.get(target)
        if held is not None and held.scheduler_jobs:  # the scheduler's jobs on it, named wherever it is told
            symptom.summary += f" [{'; '.join(job_words(j) for j in held.scheduler_jobs)}]"
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
        began = _began(symptom.details, now)
        if began < now:
            self._began_at[incident.id] = began
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

    def _plan(self, incident: Incident, now: float, retry: bool = False) -> Plan | None:
        # Defined by the planning half (engine_plan.Planning); declared here because opening an incident plans it.
        raise NotImplementedError
