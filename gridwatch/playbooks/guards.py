"""Guards: cooldown, rate limit, repeated fixes and the blast radius, decided per planned step.

The ledger remembers what the engine let act; ``apply_guards`` turns a plan's
``act`` decisions into ``skip``, ``escalate`` or ``needs_confirmation``. A guard
stops the steps that change something; keeping the scene and telling people
still happen, so a human who is paged has the evidence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gridwatch.playbooks.durations import format_duration
from gridwatch.playbooks.model import ACTING_STEPS, REMOVING_STEPS, Playbook
from gridwatch.playbooks.plans import PlannedStep


@dataclass
class GuardLedger:
    """What acted, when: the memory every guard decision reads."""

    acted: dict[tuple[str, str], float] = field(default_factory=dict)  # (playbook, scope key) -> time
    runs: dict[str, deque[float]] = field(default_factory=dict)  # playbook -> times it acted
    fixes: dict[tuple[str, str], deque[float]] = field(default_factory=dict)  # (playbook, scope key)
    removals: list[tuple[float, str]] = field(default_factory=list)  # (time, node) removed from the job
    returns: dict[str, float] = field(default_factory=dict)  # node -> when it was last put back in service

    def removed_within(self, window: float, now: float) -> set[str]:
        """Nodes taken out within ``window`` and still out: one repaired and put back no longer counts
        (the rate limit, not the blast radius, is what notices the same fault coming back)."""
        return {node for when, node in self.removals
                if now - when <= window and self.returns.get(node, float("-inf")) < when}

    def returned(self, node: str, now: float) -> None:
        self.returns[node] = now

    def record(self, playbook: str, key: str, fixed: bool, removed: list[str], now: float) -> None:
        """A plan went ahead; ``fixed`` when it changed something (not only told people)."""
        self.acted[(playbook, key)] = now
        self.runs.setdefault(playbook, deque()).append(now)
        if fixed:
            self.fixes.setdefault((playbook, key), deque()).append(now)
        self.removals.extend((now, node) for node in removed)


def _recent(times: deque[float] | None, window: float, now: float) -> int:
    return sum(1 for t in times or () if now - t <= window)


def blast_limit(playbook: Playbook, job_size: int) -> int | None:
    """How many nodes may be out of the job within the window; None means no limit."""
    g = playbook.guards
    limits = []
    if g.blast_max_nodes is not None:
        limits.append(g.blast_max_nodes)
    if g.blast_max_fraction is not None:
        # A fraction of a small job rounds to zero; one bad node must still be
        # removable, or a two-node job could never heal itself.
        limits.append(max(1, int(g.blast_max_fraction * job_size)))
    return min(limits) if limits else None


def apply_guards(playbook: Playbook, key: str, steps: list[PlannedStep], ledger: GuardLedger,
                 job_size: int, now: float, peers: frozenset[str] | None = None) -> None:
    """Set each step's decision; records in the ledger what is let act.

    ``peers``: the nodes of the incident's scheduler job(s); the blast radius counts only their removals
    (another job's bad hour never stops this one healing). None: every removal counts."""
    g = playbook.guards

    def stop(decision: str, reason: str, start: int = 0, acting_only: bool = True) -> None:
        for step in steps[start:]:
            if step.decision == "act" and (step.step in ACTING_STEPS or not acting_only):
                step.decision, step.reason = decision, reason

    last = ledger.acted.get((playbook.name, key))
    if g.cooldown and last is not None and now - last < g.cooldown:
        stop("skip", f"cooldown: acted on {key} {format_duration(now - last)} ago, quiet for {format_duration(g.cooldown)}",
             acting_only=False)
        return
    if g.rate_max is not None and _recent(ledger.runs.get(playbook.name), g.rate_window, now) >= g.rate_max:
        reason = f"rate limit: {g.rate_max} incidents of {playbook.name} within {format_duration(g.rate_window)}"
        stop("escalate", reason)
        stop("skip", reason, acting_only=False)
        return
    if g.repeat_max is not None and g.repeat_after is None:  # with ``after`` the engine plans ``then`` instead
        repeats = _recent(ledger.fixes.get((playbook.name, key)), g.repeat_window, now)
        if repeats >= g.repeat_max:
            stop("escalate", f"the same fix already ran {repeats} times on {key} within "
                             f"{format_duration(g.repeat_window)}: it is not fixing it")
    limit = blast_limit(playbook, job_size)
    removed_here: list[str] = []
    for i, step in enumerate(steps):
        if step.step not in REMOVING_STEPS or step.decision != "act":
            continue
        if limit is not None:
            before = ledger.removed_within(g.blast_window, now)
            out = (before & peers if peers is not None else before) | set(removed_here) | set(step.nodes)
            if len(out) > limit:
                whose = "its job's" if peers is not None else ""
                stop("escalate", f"blast radius: this would take {len(out)} of {whose + ' ' if whose else ''}"
                                 f"{job_size} nodes out within "
                                 f"{format_duration(g.blast_window)} (limit {limit}); a human decides", start=i)
                break
        removed_here.extend(n for n in step.nodes if n not in removed_here)
    for step in steps:
        if step.confirm and step.decision == "act":
            step.decision, step.reason = "needs_confirmation", "this step waits for an operator to confirm it"
    if any(s.decision == "act" for s in steps):
        fixed = any(s.decision == "act" and s.step in ACTING_STEPS for s in steps)
        acted_removed = [n for s in steps if s.decision == "act" and s.step in REMOVING_STEPS for n in s.nodes]
        ledger.record(playbook.name, key, fixed, list(dict.fromkeys(acted_removed)), now)
