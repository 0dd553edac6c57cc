"""The demo's trust ledger and drill script: what counts as evidence about a node, and a rejoin."""

from __future__ import annotations

import pytest

from gridwatch.console.cli.demo import FAULT_KINDS
from gridwatch.console.demo.chaos import FaultSpec, parse_fault
from gridwatch.console.demo.summary import FaultRecord
from gridwatch.console.demo.trust import REFORM_GRACE_S, TrustLedger


def test_a_hardware_xid_is_evidence_about_the_node_an_application_xid_or_a_crashed_worker_is_not() -> None:
    ledger = TrustLedger(started_at=0.0)
    faults = [FaultRecord("node-2", "xid", 10.0, code=79), FaultRecord("node-3", "xid", 20.0, code=13),
              FaultRecord("node-1", "trainer-crash", 30.0)]
    ledger.isolated("node-2", 11.0, "xid-hardware", faults)
    ledger.isolated("node-3", 21.0, "trainer-unresponsive", faults)
    ledger.isolated("node-1", 31.0, "trainer-unresponsive", faults)
    ledger.isolated("node-2", 12.0, "xid-hardware", faults)  # still out: the same isolation
    summary = ledger.summary()
    assert [(i.node, i.evidence) for i in summary.isolations] == [("node-2", "xid 79"), ("node-3", None), ("node-1", None)]
    assert summary.isolated_without_evidence == 2


def test_an_isolated_node_in_the_jobs_members_before_its_return_is_a_rejoin() -> None:
    ledger = TrustLedger(started_at=0.0)
    ledger.isolated("node-2", 10.0, "xid-hardware", [FaultRecord("node-2", "xid", 9.0, code=79)])
    everyone = frozenset({"node-1", "node-2", "node-3"})
    ledger.check_members({"node-1": everyone, "node-2": everyone}, 10.0 + REFORM_GRACE_S / 2)  # still re-forming
    assert ledger.summary().rejoined_before_return == 0
    ledger.check_members({"node-1": frozenset({"node-1", "node-3"}), "node-2": everyone}, 10.0 + REFORM_GRACE_S + 1)
    assert ledger.summary().rejoined_before_return == 0 and ledger.isolations[0].checks == 1  # its own word is not counted
    ledger.check_members({"node-1": everyone}, 10.0 + REFORM_GRACE_S + 2)
    assert ledger.summary().rejoined_before_return == 1
    ledger.returned("node-2", 60.0)
    assert ledger.isolations[0].returned_at == 60.0


def test_a_drill_fault_reads_node_kind_code_and_time() -> None:
    fault = parse_fault("node-2:xid:79@30/1", FAULT_KINDS)
    assert (fault.node, fault.spec, fault.after_s, fault.gpu) == ("node-2", FaultSpec("xid", 79), 30.0, 1)
    assert parse_fault("node-1:trainer-crash@5", FAULT_KINDS).spec == FaultSpec("trainer-crash")


@pytest.mark.parametrize("text", ["node-2:xid:79", "node-2:xid@3", "node-2:thermal:5@3", "node-2:boom@3",
                                  "node-2:xid:79@soon", "node-2:xid:79@-1", ":xid:79@3", "node-2:xid:79@3/x"])
def test_a_bad_drill_fault_is_one_line_that_names_it(text: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_fault(text, FAULT_KINDS)
    assert text in str(err.value) and "\n" not in str(err.value)
