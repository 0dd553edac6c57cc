"""Seed a restarted console's engine from the incident store: open incidents, what the guards remember, history."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loguru import logger

from gridwatch.playbooks.history import HistoryKind
from gridwatch.playbooks.model import ACTING_STEPS, REMOVING_STEPS, Playbook
from gridwatch.playbooks.store import IncidentStore, StepRecord

if TYPE_CHECKING:
    from gridwatch.playbooks.engine import Engine


@dataclass
class SeedSummary:
    """What a seeded engine took back from the store."""

    reopened: list[str] = field(default_factory=list)  # incidents open again, absorbing new symptoms
    acted: list[str] = field(default_factory=list)  # incidents whose plan went back into the guard ledger
    removed: list[str] = field(default_factory=list)  # nodes our plans took out of the job
    history: int = 0  # history rows (incidents, remediations, returns, verdicts) the history rules read again
    repeats: int = 0  # earlier ``repeat.after`` steps the repeat rule counts again


def memory_window(playbooks: tuple[Playbook, ...]) -> float:
    """How far back the guards and dedup look: older incidents cannot change a decision."""
    spans = [600.0]
    for pb in playbooks:
        g = pb.guards
        spans += [pb.dedup_window + pb.settle, g.cooldown, g.blast_window]
        if g.rate_max is not None:
            spans.append(g.rate_window)
        if g.repeat_max is not None:
            spans.append(g.repeat_window)
        spans += [rule.window for rule in g.history]
    return max(spans)


def scope_key(incident_id: str, playbook: str) -> str:
    """The scope key an incident id was made with (``<playbook>:<key>:<opened>``)."""
    return incident_id[len(playbook) + 1:incident_id.rindex(":")]


def seed_engine(engine: Engine, store: IncidentStore, now: float) -> SeedSummary:
    """Give a fresh engine the memory it had before a restart, so it neither acts twice nor forgets its guards.

    Every incident within :func:`memory_window` whose plan let steps act goes
    back into the guard ledger (cooldown, rate limit, repeats, blast radius) at
    the time it was planned; an incident not resolved and still inside its
    dedup window is open again, so the same fault replayed by an agent merges
    into it; nodes its plans took out stay out.
    """
    summary = SeedSummary()
    playbooks = {pb.name: pb for pb in engine.playbooks}
    rows = store.history(since=now - max(memory_window(engine.playbooks), engine.history.keep))
    engine.history.load(rows)
    summary.history = len(rows)
    codes = {e.incident: e.code for e in rows if e.kind == HistoryKind.INCIDENT}
    for record in store.incidents_since(now - memory_window(engine.playbooks)):
        pb = playbooks.get(record.playbook)
        incident = store.stored_incident(record.id)
        if pb is None or incident is None:
            continue  # a playbook no longer loaded guards nothing
        if not incident.id.startswith(f"{pb.name}:") or incident.id.count(":") < 2:
            store.report_bad_row("incidents", incident.id, "its id is not <playbook>:<scope>:<event>")
            continue
        key = scope_key(incident.id, pb.name)
        steps = store.steps(incident.id)
        acting = [s for s in steps if s.decision == "act"]
        removed = list(dict.fromkeys(n for s in acting if s.step in REMOVING_STEPS for n in s.planned.nodes))
        # Out of the job: a removal that was done, or whose outcome is unknown (the agent's next report says).
        out = list(dict.fromkeys(n for s in acting if s.step in REMOVING_STEPS and s.state in _MAYBE_OUT
                                 for n in s.planned.nodes))
        if acting:
            at = min(s.planned.at for s in acting)
            engine.ledger.record(pb.name, key, any(s.step in ACTING_STEPS for s in acting), removed, at)
            summary.acted.append(incident.id)
        after = pb.guards.repeat_after
        if after is not None and any(s.step == after for s in acting):
            # The same XID back after this fix counts it again (the engine keys on the code, kept in the history).
            engine.remember_fix(pb.name, key, codes.get(incident.id), min(s.planned.at for s in acting))
            summary.repeats += 1
        open_again = (record.state != "resolved" and incident.state in ("open", "pending")
                      and now - max(incident.last_seen_at, incident.opened_at) <= pb.dedup_window)
        engine.adopt(incident, key, out, _restart(acting), open_again, planned=len(steps))
        if open_again:
            summary.reopened.append(incident.id)
        summary.removed += [n for n in out if n not in summary.removed]
    logger.info("engine seeded from {}: {} incidents open again, {} plans in the guards' memory ({} repeated fixes), "
                "{} history rows, nodes out: {}", store.path, len(summary.reopened), len(summary.acted),
                summary.repeats, summary.history, ", ".join(summary.removed) or "none")
    return summary


# The states of a removing step after which its node may be out of the job.
_MAYBE_OUT = frozenset({"done", "running", "interrupted", "pending"})


def _restart(acting: list[StepRecord]) -> tuple[float, list[str]] | None:
    """When a job-wide restart from the newest checkpoint was let act, and on which nodes."""
    for s in acting:
        if s.step == "restart_from_checkpoint" and s.planned.checkpoint == "newest":
            return s.planned.at, list(s.planned.nodes)
    return None
