"""Which rank is stuck: match every rank's collective record by (process group, sequence number) and name the culprits.

A hang in a collective is reported by every rank that waits in it, never by the
one that holds it up. The rule, per process group (the newest one in which a
rank waits, or waited until its collective failed):

- the collective the others wait in is the highest sequence number a rank waits in;
- a rank whose trainer did not answer is blamed (frozen or gone: a stopped
  process, a dead host), unless it is not a member of that group;
- a rank whose newest collective in the group is older, and which left it at
  least ``min_wait_s`` ago, never entered it: it is busy before it (spinning in
  Python, a data loader, a host-side loop); when a rank did not answer, only the
  ranks that did not answer are blamed (a late rank is then most likely slowed
  by the same stall);
- a rank that entered it but never started it (scheduled, not started), or that
  is still in it while another rank completed it, is stuck inside it (a device
  that does not progress);
- ranks that wait in it, or waited until it failed, are its victims, not its cause.

When every member answered and waits in the same collective nothing is blamed:
the records cannot tell, and the caller falls back to its other rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

import msgspec

from gridwatch.wire.control import CollectiveEntry, CollectiveRecord, CollectiveState, ProcessGroupInfo


class BlameReason(StrEnum):
    """Why a rank is blamed for a collective the others wait in."""

    NO_ANSWER = "no_answer"  # its trainer did not answer: frozen or gone
    NEVER_ENTERED = "never_entered"  # its newest collective is older: busy before it
    STUCK_INSIDE = "stuck_inside"  # entered it, never got through it


class Culprit(msgspec.Struct, kw_only=True, frozen=True):
    """One blamed rank, its node, and why."""

    rank: int
    node: str
    reason: BlameReason
    last_seq: int | None = None  # its newest collective in the group (None: it did not answer)


class CollectiveVerdict(msgspec.Struct, kw_only=True):
    """Who holds up which collective: the culprits, the ranks that wait, and the sentence an operator reads."""

    pg: str
    seq: int
    op: str
    world: int
    culprits: list[Culprit] = []
    waiting: list[int] = []  # ranks that wait in it (or waited until it failed)
    summary: str = ""

    @property
    def nodes(self) -> list[str]:
        """The culprits' nodes, each once, in rank order."""
        return list(dict.fromkeys(c.node for c in sorted(self.culprits, key=lambda c: c.rank)))


_WAITING = (CollectiveState.STARTED, CollectiveState.FAILED)


def _group_entries(record: CollectiveRecord, pg: str) -> dict[int, CollectiveEntry]:
    return {e.seq: e for e in record.entries if e.pg == pg}


def _waits(entry: CollectiveEntry, now: float, min_wait_s: float) -> bool:
    if entry.state == CollectiveState.FAILED:
        return True
    return entry.state == CollectiveState.STARTED and now - (entry.started_at or entry.scheduled_at) >= min_wait_s


def _hung_group(records: Mapping[str, CollectiveRecord | None], min_wait_s: float) -> ProcessGroupInfo | None:
    """The newest process group in which some rank waits (long enough) or waited until its collective failed."""
    best: ProcessGroupInfo | None = None
    for record in records.values():
        if record is None:
            continue
        for group in record.groups:
            entries = _group_entries(record, str(group.name))
            if not entries:
                continue
            last = entries[max(entries)]
            if _waits(last, record.now, min_wait_s) and (best is None or group.ordinal > best.ordinal
                                                         or (group.ordinal == best.ordinal
                                                             and len(group.members) > len(best.members))):
                best = group
    return best


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def blame(records: Mapping[str, CollectiveRecord | None], min_wait_s: float = 0.0) -> CollectiveVerdict | None:
    """The verdict over every rank's record, keyed by node (None: that node's trainer did not answer).

    None when no rank waits in a collective (at least ``min_wait_s`` seconds, or until it failed).
    """
    group = _hung_group(records, min_wait_s)
    if group is None:
        return None
    pg = str(group.name)
    members = [str(m) for m in group.members]
    per_rank: dict[int, dict[int, CollectiveEntry]] = {}
    nows: dict[int, float] = {}
    for rank, node in enumerate(members):
        record = records.get(node)
        if record is not None and any(str(g.name) == pg for g in record.groups):
            per_rank[rank] = _group_entries(record, pg)
            nows[rank] = record.now
    seq = max((s for rank, entries in per_rank.items() for s, e in entries.items() if _waits(e, nows[rank], min_wait_s)),
              default=0)
    if not seq:
        return None  # the waiting rank is not among the group's members as its records name them
    op = next(str(e.op) for entries in per_rank.values() for s, e in entries.items() if s == seq)
    completed = any(entries.get(seq) is not None and entries[seq].state == CollectiveState.COMPLETED
                    for entries in per_rank.values())
    culprits: list[Culprit] = []
    waiting: list[int] = []
    for rank, node in enumerate(members):
        entries = per_rank.get(rank)
        if entries is None:
            if node in records and records[node] is not None:
                # Answered, but never in this group: it is in another job or generation, not this one's cause.
                continue
            culprits.append(Culprit(rank=rank, node=node, reason=BlameReason.NO_ANSWER))
            continue
        last = max(entries, default=0)
        entry = entries.get(seq)
        if entry is None:
            newest = entries.get(last)
            idle = nows[rank] - (newest.ended_at or newest.started_at or newest.scheduled_at) if newest else min_wait_s
            # Not yet late: a rank that left its last collective only just now is still computing its step.
            if last < seq and idle >= min_wait_s:
                culprits.append(Culprit(rank=rank, node=node, reason=BlameReason.NEVER_ENTERED, last_seq=last))
            continue
        if entry.state == CollectiveState.SCHEDULED or (entry.state == CollectiveState.STARTED and completed):
            culprits.append(Culprit(rank=rank, node=node, reason=BlameReason.STUCK_INSIDE, last_seq=last))
        elif entry.state in _WAITING:
            waiting.append(rank)
    if any(c.reason == BlameReason.NO_ANSWER for c in culprits):
        # A trainer that does not answer explains the wait by itself; a rank that answers but is late
        # to the collective is then most likely slowed by the same stall (a loaded node), not a cause.
        culprits = [c for c in culprits if c.reason == BlameReason.NO_ANSWER]
    verdict = CollectiveVerdict(pg=pg, seq=seq, op=op, world=len(members), culprits=culprits, waiting=waiting)
    verdict.summary = _sentence(verdict)
    return verdict


def _sentence(v: CollectiveVerdict) -> str:
    what = f"{v.op} #{v.seq}"
    wait = f"{_plural(len(v.waiting), 'rank')} wait{'s' if len(v.waiting) == 1 else ''} in it"
    if not v.culprits:
        return f"all {_plural(len(v.waiting), 'rank')} wait in {what} of {v.pg}: the records cannot tell which is stuck"
    parts = []
    for c in v.culprits:
        who = f"rank {c.rank} on {c.node}"
        if c.reason == BlameReason.NO_ANSWER:
            parts.append(f"{who} did not answer (frozen or gone) while {_plural(len(v.waiting), 'rank')} "
                         f"wait{'s' if len(v.waiting) == 1 else ''} in {what}")
            continue
        if c.reason == BlameReason.NEVER_ENTERED:
            parts.append(f"{who} never entered {what} (its newest is #{c.last_seq})")
        else:
            parts.append(f"{who} entered {what} but never got through it (stuck inside)")
    if any(c.reason != BlameReason.NO_ANSWER for c in v.culprits):
        parts[-1] += f"; {wait}"
    return "; ".join(parts)
