"""Did the loop take out only bad nodes, and did they stay out? Counted in a demo run, against what it injected.

A node may be taken out on evidence about the node: a fault of its GPU or host
(NVIDIA's catalogue says a hardware XID needs the GPU or the node out), a
persisting freeze, a node that went silent, or an operator. An application
XID, a crashed worker or a slow step is about the program: the node stays. An
isolated node stays out of the job until it is returned: a generation of the
job that counts it as a member after its isolation settled is a rejoin.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from gridwatch.wire.xid import XidBlame, xid_catalog

if TYPE_CHECKING:  # the summary holds this module's TrustSummary
    from gridwatch.console.demo.summary import FaultRecord

# Faults that are evidence about the node they hit (the demo's fault kinds, see `gridwatch fault --help`).
NODE_EVIDENCE = frozenset({"ecc-dbe", "fell-off-bus", "hang", "trainer-hang", "agent-kill", "net-cut", "ib-down",
                           "ib-flap", "thermal"})
# How long before an isolation its evidence may lie (detection, settle and the plan's earlier steps).
EVIDENCE_WINDOW_S = 180.0
# After an isolation the job re-forms without the node: until then the old generation still counts it.
REFORM_GRACE_S = 10.0


def is_node_evidence(fault: FaultRecord) -> bool:
    """Whether ``fault`` is about the node (its GPU, host or links), not about the program on it."""
    if fault.kind == "xid":
        entry = xid_catalog().get(fault.code) if fault.code is not None else None
        return entry is not None and entry.blame == XidBlame.HARDWARE
    return fault.kind in NODE_EVIDENCE


class Isolation(msgspec.Struct, kw_only=True):
    node: str
    at: float  # seconds into the run
    who: str  # the playbook, or the operator, that took it out
    evidence: str | None  # the injected fault it answers, or None: taken out without evidence about it
    returned_at: float | None = None
    rejoined_at: float | None = None  # a member of the job again before its return
    checks: int = 0  # how often the job's members were read while it was out (0: nothing said it stayed out)


class TrustSummary(msgspec.Struct, kw_only=True):
    isolations: list[Isolation]
    isolated_without_evidence: int
    rejoined_before_return: int


@dataclass
class TrustLedger:
    """Isolations and returns as they happen, and rejoins as the job's membership shows them."""

    started_at: float
    isolations: list[Isolation] = field(default_factory=list)
    # Each node's members as last said, and when they changed: a set said before an isolation (a trainer
    # between two lives, a summary not yet sent) is no generation formed after it.
    _said: dict[str, tuple[frozenset[str], float]] = field(default_factory=dict)

    def isolated(self, node: str, at: float, who: str, faults: Iterable[FaultRecord]) -> None:
        if any(i.node == node and i.returned_at is None for i in self.isolations):
            return  # still out: the same isolation
        evidence = next((f.label for f in sorted(faults, key=lambda f: -f.at)
                         if f.node == node and 0 <= at - f.at <= EVIDENCE_WINDOW_S and is_node_evidence(f)), None)
        if evidence is None and who.startswith("operator"):
            evidence = "operator"
        self.isolations.append(Isolation(node=node, at=round(at - self.started_at, 3), who=who, evidence=evidence))

    def returned(self, node: str, at: float) -> None:
        for i in self.isolations:
            if i.node == node and i.returned_at is None:
                i.returned_at = round(at - self.started_at, 3)

    def check_members(self, members_of: dict[str, frozenset[str]], now: float) -> None:
        """``members_of``: each node still in service, and its job's members as its trainer last said them."""
        for name, members in members_of.items():
            if members and (name not in self._said or self._said[name][0] != members):
                self._said[name] = (members, now - self.started_at)
        since = now - self.started_at
        for i in self.isolations:
            if i.returned_at is not None or i.rejoined_at is not None or since - i.at < REFORM_GRACE_S:
                continue
            said = [members for name, (members, at) in self._said.items()
                    if name != i.node and name in members_of and at > i.at]
            if said:
                i.checks += 1
            if any(i.node in members for members in said):
                i.rejoined_at = round(since, 3)

    def summary(self) -> TrustSummary:
        return TrustSummary(isolations=list(self.isolations),
                            isolated_without_evidence=sum(1 for i in self.isolations if i.evidence is None),
                            rejoined_before_return=sum(1 for i in self.isolations if i.rejoined_at is not None))


def render(trust: TrustSummary) -> list[str]:
    """The summary's lines: every isolation with its evidence, then the two counts that must be zero."""
    lines = []
    for i in trust.isolations:
        back = f", returned at {i.returned_at:.0f} s" if i.returned_at is not None else ""
        rejoined = (f", IN THE JOB AGAIN at {i.rejoined_at:.0f} s" if i.rejoined_at is not None
                    else f", out of the job in {i.checks} reads of its members" if i.checks else "")
        lines.append(f"  isolated {i.node} at {i.at:.0f} s by {i.who}: "
                     f"{'on ' + i.evidence if i.evidence else 'WITHOUT evidence about the node'}{back}{rejoined}")
    lines.append(f"nodes isolated without evidence about them: {trust.isolated_without_evidence}; "
                 f"isolated nodes in the job again before their return: {trust.rejoined_before_return}")
    return lines
