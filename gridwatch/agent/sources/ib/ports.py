"""What one HCA port reading holds, the counters it is judged by, and the protocol every port reader follows."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

# port_rcv_data and port_xmit_data count 4-byte words, not octets (IBA PortCounters).
DATA_WORD_BYTES = 4

# Error counters and, where the IBA PortCounters attribute is narrower than 64 bits, their width:
# such a counter stops at all ones ("saturates") rather than wrapping, and cannot show news after.
ERROR_COUNTERS: dict[str, int | None] = {
    "link_downed": 8,
    "link_error_recovery": 8,
    "symbol_error": 16,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_rcv_discards": 16,
    "port_xmit_discards": 16,
    "port_rcv_constraint_errors": 8,
    "port_xmit_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "VL15_dropped": 16,
    # hw_counters (mlx5): 64-bit driver counters.
    "rnr_nak_retry_err": None,
    "out_of_sequence": None,
    "packet_seq_err": None,
    "local_ack_timeout_err": None,
    "implied_nak_seq_err": None,
    "out_of_buffer": None,
    "req_cqe_error": None,
    "resp_cqe_error": None,
    "req_remote_access_errors": None,
    "req_remote_invalid_request": None,
    "resp_remote_access_errors": None,
    "resp_local_length_error": None,
    "rx_icrc_encapsulated": None,
    "roce_adp_retrans_to": None,
}
# Fatal on any increment, whatever the rate: the link went down and training traffic with it.
FATAL_COUNTERS = frozenset({"link_downed"})


class PortState(enum.IntEnum):
    """The IBA PortInfo PortState, as sysfs ``state`` writes it (``4: ACTIVE``)."""

    NOP = 0
    DOWN = 1
    INIT = 2
    ARMED = 3
    ACTIVE = 4
    ACTIVE_DEFER = 5


@dataclass
class IbPort:
    """One reading of one HCA port, every counter included (what /metrics exports)."""

    device: str
    port: int
    state_id: int | None = None
    state: str | None = None
    phys_state_id: int | None = None
    phys_state: str | None = None
    rate_gbps: float | None = None
    link_layer: str | None = None
    counters: dict[str, int] = field(default_factory=dict)  # counters/
    hw_counters: dict[str, int] = field(default_factory=dict)  # hw_counters/

    @property
    def active(self) -> bool | None:
        return None if self.state_id is None else self.state_id == PortState.ACTIVE

    def counter(self, name: str) -> int | None:
        value = self.counters.get(name)
        return self.hw_counters.get(name) if value is None else value


@dataclass(frozen=True)
class Unreadable:
    """A port file that could not be used this time: the path and why, in a few words."""

    path: str
    why: str


class PortReader(Protocol):
    """Where the ports come from: sysfs on a real node, a model in sim mode."""

    simulated: bool

    def read_ports(self) -> tuple[list[IbPort], list[Unreadable]]:
        """Every port now, and the files that could not be used."""
        ...
