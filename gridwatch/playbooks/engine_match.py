"""Frames to symptoms: the engine's half that matches events, log lines, metrics and stacks against the playbooks.

:class:`Matching` decides when a report counts (corroborated, persistent,
held long enough) and hands each symptom to the incident bookkeeping of
:class:`gridwatch.playbooks.engine_state.EngineCore`; the module's functions
say which metric conditions an agent can watch itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from loguru import logger

from gridwatch.playbooks.engine_state import EngineCore, NodeState, _Symptom
from gridwatch.playbooks.model import ConditionTrigger, EventTrigger, LogTrigger, MetricTrigger, Playbook
from gridwatch.playbooks.plans import Plan
from gridwatch.wire.protocol import WATCH_METRICS, WATCH_OPS, Event, Sample, Summary, Text, Watch
from gridwatch.wire.xid import xid_catalog

# A report that blames another node (``target: detail:...``) counts once this
# many distinct nodes made it: every rank of a job reports its straggler, and
# one agent alone must not get a healthy node isolated.
BLAME_REPORTERS = 2
BLAME_WINDOW = 60.0  # seconds the reports of one step may lie apart, at least (a trigger's ``within`` if longer)
_BLAME_SWEEP = 4096  # above this many blamed (node, step)s, stale ones are forgotten


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


class Matching(EngineCore):
    """The engine's matching half: frames against the playbooks' triggers, symptoms out."""

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
        where = f"{node.name} gpu {event.gpu}" if event.gpu is not None else node.name
        summary = f"{cond.metric} = {value} on {where} ({cond}, held {held}s, seen by the agent)"
        return self._symptom(pb, _Symptom(node.name, event.gpu, summary, ident=self._frame_ident), now)

    def _metric_books(self, agent_watched: bool) -> tuple[Playbook, ...]:
        """The metric playbooks this engine evaluates itself (from summaries: those the agent cannot), kept per set."""
        def split(books: tuple[Playbook, ...]) -> tuple[tuple[Playbook, ...], tuple[Playbook, ...]]:
            mine = tuple(pb for pb in books if isinstance(pb.trigger, MetricTrigger))
            return mine, tuple(pb for pb in mine if agent_can_watch(pb) is None)  # all, and those no agent watches

        mine, unwatched = self._per_playbooks("metric", split)
        return unwatched if agent_watched else mine

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
