"""InfiniBand and RoCE HCA ports: read from sysfs (or simulated), judged between samples, exported under node_exporter's names.

The reader walks ``/sys/class/infiniband/<device>/ports/<port>/`` as
``ibstat`` and node_exporter's infiniband collector do: ``state``
(``4: ACTIVE``), ``phys_state`` (``5: LinkUp``), ``rate`` (``400 Gb/sec (4X
NDR)``), ``link_layer`` (InfiniBand, or Ethernet for RoCE) and every file
under ``counters/`` and ``hw_counters/``. A file that vanishes or holds garbage
is N/A in the reading and an ``ib_unreadable`` event; a file that blocks
holds up this source alone (the guard reports it hung, the sample goes out).

:class:`IbJudge` turns two readings into events: any ``link_downed`` increment
or a port leaving ACTIVE is ``ib_link_down`` (fatal), a port back to ACTIVE is
``ib_link_up``, an error counter growing faster than the configured rate is
``ib_errors`` (degraded), and a port that was down for ``flap_down_s`` or more
and came back ``flap_count`` times within ``flap_window_s`` is ``ib_link_flap``
(gpud's rule, components/accelerator/nvidia/infiniband/store/scan_flaps.go).
"""

from __future__ import annotations

import enum
import functools
import os
import random
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from loguru import logger

from gridwatch.agent.sources import FaultNotSupported, Reading
from gridwatch.wire.protocol import Event, IbPortSample, Severity, Text, clean_text

if TYPE_CHECKING:
    from prometheus_client.core import Metric

SYSFS_ROOT = "/sys/class/infiniband"
_T = TypeVar("_T")
# A sysfs attribute is one short line; more than this is not one.
_MAX_FILE_BYTES = 4096
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
# The error counters in the order the wire lists them, each with the value it saturates at (None: 64-bit).
# Judged once per port per tick, so walked from here rather than by sorting every counter a port has.
_ERROR_ORDER: tuple[tuple[str, Text, int | None], ...] = tuple(
    (name, Text(name), None if width is None else (1 << width) - 1) for name, width in sorted(ERROR_COUNTERS.items())
)

# sysfs file -> node_exporter metric (collector/infiniband_linux.go), labels device and port.
_COUNTER_METRICS: dict[str, tuple[str, str]] = {
    "excessive_buffer_overrun_errors": ("excessive_buffer_overrun_errors_total", "Number of times that OverrunErrors consecutive flow control update periods occurred, each having at least one overrun error."),
    "link_downed": ("link_downed_total", "Number of times the link failed to recover from an error state and went down"),
    "link_error_recovery": ("link_error_recovery_total", "Number of times the link successfully recovered from an error state"),
    "local_link_integrity_errors": ("local_link_integrity_errors_total", "Number of times that the count of local physical errors exceeded the threshold specified by LocalPhyErrors."),
    "multicast_rcv_packets": ("multicast_packets_received_total", "Number of multicast packets received (including errors)"),
    "multicast_xmit_packets": ("multicast_packets_transmitted_total", "Number of multicast packets transmitted (including errors)"),
    "port_rcv_constraint_errors": ("port_constraint_errors_received_total", "Number of packets received on the switch physical port that are discarded"),
    "port_xmit_constraint_errors": ("port_constraint_errors_transmitted_total", "Number of packets not transmitted from the switch physical port"),
    "port_rcv_data": ("port_data_received_bytes_total", "Number of data octets received on all links"),
    "port_xmit_data": ("port_data_transmitted_bytes_total", "Number of data octets transmitted on all links"),
    "port_rcv_discards": ("port_discards_received_total", "Number of inbound packets discarded by the port because the port is down or congested"),
    "port_xmit_discards": ("port_discards_transmitted_total", "Number of outbound packets discarded by the port because the port is down or congested"),
    "port_rcv_errors": ("port_errors_received_total", "Number of packets containing an error that were received on this port"),
    "port_rcv_packets": ("port_packets_received_total", "Number of packets received on all VLs by this port (including errors)"),
    "port_xmit_packets": ("port_packets_transmitted_total", "Number of packets transmitted on all VLs from this port (including errors)"),
    "port_xmit_wait": ("port_transmit_wait_total", "Number of ticks during which the port had data to transmit but no data was sent during the entire tick"),
    "unicast_rcv_packets": ("unicast_packets_received_total", "Number of unicast packets received (including errors)"),
    "unicast_xmit_packets": ("unicast_packets_transmitted_total", "Number of unicast packets transmitted (including errors)"),
    "port_rcv_remote_physical_errors": ("port_receive_remote_physical_errors_total", "Number of packets marked with the EBP (End of Bad Packet) delimiter received on the port."),
    "port_rcv_switch_relay_errors": ("port_receive_switch_relay_errors_total", "Number of packets that could not be forwarded by the switch."),
    "symbol_error": ("symbol_error_total", "Number of minor link errors detected on one or more physical lanes."),
    "VL15_dropped": ("vl15_dropped_total", "Number of incoming VL15 packets dropped due to resource limitations."),
}
_HW_COUNTER_METRICS: dict[str, tuple[str, str]] = {
    "duplicate_request": ("duplicate_requests_packets_total", "The number of received packets. A duplicate request is a request that had been previously executed."),
    "implied_nak_seq_err": ("implied_nak_seq_errors_total", "The number of time the requested decided an ACK. with a PSN larger than the expected PSN for an RDMA read or response."),
    "local_ack_timeout_err": ("local_ack_timeout_errors_total", "The number of times QP's ack timer expired for RC, XRC, DCT QPs at the sender side. The QP retry limit was not exceed, therefore it is still recoverable error."),
    "np_cnp_sent": ("np_cnp_packets_sent_total", "The number of CNP packets sent by the Notification Point when it noticed congestion experienced in the RoCEv2 IP header (ECN bits)."),
    "np_ecn_marked_roce_packets": ("np_ecn_marked_roce_packets_received_total", "The number of RoCEv2 packets received by the notification point which were marked for experiencing the congestion (ECN bits where '11' on the ingress RoCE traffic)."),
    "out_of_buffer": ("out_of_buffer_drops_total", "The number of drops occurred due to lack of WQE for the associated QPs."),
    "out_of_sequence": ("out_of_sequence_packets_received_total", "The number of out of sequence packets received."),
    "packet_seq_err": ("packet_sequence_errors_total", "The number of received NAK sequence error packets. The QP retry limit was not exceeded."),
    "req_cqe_error": ("req_cqes_errors_total", "The number of times requester detected CQEs completed with errors."),
    "req_cqe_flush_error": ("req_cqes_flush_errors_total", "The number of times requester detected CQEs completed with flushed errors."),
    "req_remote_access_errors": ("req_remote_access_errors_total", "The number of times requester detected remote access errors."),
    "req_remote_invalid_request": ("req_remote_invalid_request_errors_total", "The number of times requester detected remote invalid request errors."),
    "resp_cqe_error": ("resp_cqes_errors_total", "The number of times responder detected CQEs completed with errors."),
    "resp_cqe_flush_error": ("resp_cqes_flush_errors_total", "The number of times responder detected CQEs completed with flushed errors."),
    "resp_local_length_error": ("resp_local_length_errors_total", "The number of times responder detected local length errors."),
    "resp_remote_access_errors": ("resp_remote_access_errors_total", "The number of times responder detected remote access errors."),
    "rnr_nak_retry_err": ("rnr_nak_retry_packets_received_total", "The number of received RNR NAK packets. The QP retry limit was not exceeded."),
    "roce_adp_retrans": ("roce_adp_retransmits_total", "The number of adaptive retransmissions for RoCE traffic."),
    "roce_adp_retrans_to": ("roce_adp_retransmits_timeout_total", "The number of times RoCE traffic reached timeout due to adaptive retransmission."),
    "roce_slow_restart": ("roce_slow_restart_used_total", "The number of times RoCE slow restart was used."),
    "roce_slow_restart_cnps": ("roce_slow_restart_cnps_total", "The number of times RoCE slow restart generated CNP packets."),
    "roce_slow_restart_trans": ("roce_slow_restart_total", "The number of times RoCE slow restart changed state to slow restart."),
    "rp_cnp_handled": ("rp_cnp_packets_handled_total", "The number of CNP packets handled by the Reaction Point HCA to throttle the transmission rate."),
    "rp_cnp_ignored": ("rp_cnp_ignored_packets_received_total", "The number of CNP packets received and ignored by the Reaction Point HCA."),
    "rx_atomic_requests": ("rx_atomic_requests_total", "The number of received ATOMIC request for the associated QPs."),
    "rx_dct_connect": ("rx_dct_connect_requests_total", "The number of received connection requests for the associated DCTs."),
    "rx_read_requests": ("rx_read_requests_total", "The number of received READ requests for the associated QPs."),
    "rx_write_requests": ("rx_write_requests_total", "The number of received WRITE requests for the associated QPs."),
    "rx_icrc_encapsulated": ("rx_icrc_encapsulated_errors_total", "The number of RoCE packets with ICRC errors."),
}
_STATE_HELP = "State of the InfiniBand port (0: no change, 1: down, 2: init, 3: armed, 4: active, 5: act defer)"
_PHYS_HELP = ("Physical state of the InfiniBand port (0: no change, 1: sleep, 2: polling, 3: disable, 4: shift, "
              "5: link up, 6: link error recover, 7: phytest)")

_ID_NAME = re.compile(r"^\s*(\d+)\s*:\s*(\S.*?)\s*$")  # "4: ACTIVE", "5: LinkUp"
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([GMT]?)b/sec\b")  # "400 Gb/sec (4X NDR)", "2.5 Gb/sec (1X SDR)"
_RATE_UNIT = {"": 1e-9, "M": 1e-3, "G": 1.0, "T": 1e3}


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


# --------------------------------------------------------------------------- sysfs


def parse_id_name(text: str) -> tuple[int, str] | None:
    """``"4: ACTIVE"`` -> ``(4, "ACTIVE")``; None for anything else."""
    m = _ID_NAME.match(text)
    return (int(m.group(1)), m.group(2)) if m else None


def parse_rate(text: str) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` -> 400.0 (Gb/s); None for anything else."""
    m = _RATE.match(text)
    return float(m.group(1)) * _RATE_UNIT[m.group(2)] if m else None


def _read_text(path: str) -> str:
    """One sysfs attribute; raises OSError, or ValueError for what is not one short line of text.

    Plain ``os`` calls on string paths: a node with eight HCAs has some 450 of these files a tick.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, _MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_FILE_BYTES:
        raise ValueError(f"more than {_MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("not text") from None
    if "\x00" in text:
        raise ValueError("not text")
    return text.strip()


class SysfsPorts:
    """HCA ports under a sysfs root (``/sys/class/infiniband``; a test passes a tree laid out the same)."""

    simulated = False

    def __init__(self, root: str = SYSFS_ROOT) -> None:
        self.root = str(root)

    def devices(self) -> list[str]:
        """HCA names now (``ibstat -l``); none when the class directory is absent."""
        try:
            return sorted(os.listdir(self.root))
        except OSError:
            return []

    def read_ports(self) -> tuple[list[IbPort], list[Unreadable]]:
        ports: list[IbPort] = []
        bad: list[Unreadable] = []
        for device in self.devices():
            ports_dir = f"{self.root}/{device}/ports"
            try:
                numbers = sorted(int(name) for name in os.listdir(ports_dir) if name.isdigit())
            except OSError as exc:
                bad.append(Unreadable(ports_dir, _os_why(exc)))
                continue
            for number in numbers:
                ports.append(self._port(device, number, f"{ports_dir}/{number}", bad))
        return ports, bad

    def _port(self, device: str, number: int, where: str, bad: list[Unreadable]) -> IbPort:
        port = IbPort(device=device, port=number)
        state = self._attr(f"{where}/state", bad, parse_id_name)
        if state is not None:
            port.state_id, port.state = state
        phys = self._attr(f"{where}/phys_state", bad, parse_id_name)
        if phys is not None:
            port.phys_state_id, port.phys_state = phys
        port.rate_gbps = self._attr(f"{where}/rate", bad, parse_rate)
        port.link_layer = self._attr(f"{where}/link_layer", bad, lambda t: t if t.isprintable() and t else None)
        port.counters = self._counters(f"{where}/counters", bad)
        port.hw_counters = self._counters(f"{where}/hw_counters", bad)
        return port

    @staticmethod
    def _attr(path: str, bad: list[Unreadable], parse: Callable[[str], _T | None]) -> _T | None:
        try:
            text = _read_text(path)
        except FileNotFoundError:
            bad.append(Unreadable(path, "vanished"))
            return None
        except OSError as exc:
            bad.append(Unreadable(path, _os_why(exc)))
            return None
        except ValueError as exc:
            bad.append(Unreadable(path, str(exc)))
            return None
        value = parse(text)
        if value is None:
            bad.append(Unreadable(path, f"garbage {clean_text(text, 40)!r}"))
        return value

    @staticmethod
    def _counters(where: str, bad: list[Unreadable]) -> dict[str, int]:
        out: dict[str, int] = {}
        try:
            names = sorted(entry.name for entry in os.scandir(where) if entry.is_file())
        except FileNotFoundError:
            return out  # mlx4 has no hw_counters; older kernels neither
        except OSError as exc:
            bad.append(Unreadable(where, _os_why(exc)))
            return out
        for name in names:
            path = f"{where}/{name}"
            try:
                text = _read_text(path)
            except FileNotFoundError:
                bad.append(Unreadable(path, "vanished"))
                continue
            except PermissionError:
                continue  # some hw_counters are root-only on some kernels: N/A, as node_exporter skips them
            except OSError as exc:
                if exc.errno in (95, 22):  # EOPNOTSUPP, EINVAL: the device does not keep this counter
                    continue
                bad.append(Unreadable(path, _os_why(exc)))
                continue
            except ValueError as exc:
                bad.append(Unreadable(path, str(exc)))
                continue
            if text.startswith("N/A"):  # "N/A (no PMA)": iWARP and some RoCE devices keep no PortCounters
                continue
            if not text.isdigit():
                bad.append(Unreadable(path, f"garbage {clean_text(text, 40)!r}"))
                continue
            out[name] = int(text)
        return out


def _os_why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


# --------------------------------------------------------------------------- judging


@dataclass(frozen=True)
class IbThresholds:
    """How ports are judged; the agent's ``ib_*`` settings."""

    error_rate: float = 1.0  # errors a second on one counter: degraded
    flap_down_s: float = 25.0
    flap_count: int = 3
    flap_window_s: float = 43500.0  # gpud: 12 h 5 min


class FlapPhase(enum.Enum):
    """Where a port is in gpud's flap count."""

    UP = "up"
    DOWN = "down"  # seen down, not yet for flap_down_s
    DOWN_LONG = "down_long"  # down for flap_down_s or more: coming back counts


@dataclass
class _PortMemory:
    counters: dict[str, int]
    at: float
    active: bool | None
    phase: FlapPhase = FlapPhase.UP
    down_since: float = 0.0
    reverts: deque[float] = field(default_factory=deque)
    degraded: bool = False


class IbJudge:
    """Turns successive readings into wire samples and events; time comes from ``clock`` (seconds)."""

    def __init__(self, thresholds: IbThresholds | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.thresholds = thresholds or IbThresholds()
        self.clock = clock
        self.wall = wall
        self._memory: dict[tuple[str, int], _PortMemory] = {}

    def judge(self, ports: list[IbPort]) -> tuple[list[IbPortSample], list[Event]]:
        now = self.clock()
        samples: list[IbPortSample] = []
        events: list[Event] = []
        for port in ports:
            sample, port_events = self._one(port, now)
            samples.append(sample)
            events.extend(port_events)
        listed = {(p.device, p.port) for p in ports}
        for device, number in [key for key in self._memory if key not in listed]:
            # The HCA left sysfs (fell off PCIe, driver unloaded): as fatal as a link down, said once.
            del self._memory[(device, number)]
            events.append(self._event(IbPort(device=device, port=number), "ib_link_down", Severity.CRITICAL,
                                      "port no longer listed in sysfs: the HCA is gone (PCIe, driver or firmware)"))
        return samples, events

    def _one(self, port: IbPort, now: float) -> tuple[IbPortSample, list[Event]]:
        key = (port.device, port.port)
        counters = {**port.hw_counters, **port.counters}
        sample = IbPortSample(
            device=Text(port.device), port=port.port, state=_text(port.state), phys_state=_text(port.phys_state),
            rate_gbps=port.rate_gbps, link_layer=_text(port.link_layer),
        )
        errors: dict[Text, int] = {}
        saturated: list[Text] = []
        for name, text, ceiling in _ERROR_ORDER:
            value = counters.get(name)
            if value is None:
                continue
            if value:
                errors[text] = value
            if ceiling is not None and value >= ceiling:
                saturated.append(text)
        sample.errors, sample.saturated = errors, saturated
        mem = self._memory.get(key)
        events: list[Event] = []
        if mem is None:  # the first reading is the baseline: nothing to compare yet
            self._memory[key] = _PortMemory(counters=counters, at=now, active=port.active)
            if port.active is False:
                self._memory[key].phase, self._memory[key].down_since = FlapPhase.DOWN, now
            return sample, events
        dt = now - mem.at
        before = mem.counters
        if dt > 0:
            for name, word_bps in (("port_rcv_data", "rx_bps"), ("port_xmit_data", "tx_bps")):
                grown = _grown(before, counters, name)
                if grown is not None:
                    setattr(sample, word_bps, grown * DATA_WORD_BYTES / dt)
        deltas: dict[Text, int] = {}
        for name, text, _ in _ERROR_ORDER:
            last = before.get(name)
            if last is None or counters.get(name, last) == last:
                continue  # not read both times, or unchanged: most counters, most ticks
            grown = _grown(before, counters, name)
            if grown is not None and grown > 0:
                deltas[text] = grown
        sample.deltas = deltas
        events += self._state_events(port, mem, sample, now)
        events += self._error_events(port, mem, sample, dt)
        mem.counters, mem.at = counters, now
        return sample, events

    def _state_events(self, port: IbPort, mem: _PortMemory, sample: IbPortSample, now: float) -> list[Event]:
        events: list[Event] = []
        downed = sample.deltas.get(Text("link_downed"), 0)
        went_down = mem.active is True and port.active is False
        if went_down or downed:
            why = []
            if went_down:
                why.append(f"state {port.state} ({port.phys_state or 'N/A'})")
            if downed:
                why.append(f"link_downed +{downed}")
            events.append(self._event(port, "ib_link_down", Severity.CRITICAL,
                                      f"link down: {', '.join(why)}; collectives over it stall or fail",
                                      counter="link_downed" if downed else None, delta=downed or None))
        elif mem.active is False and port.active is True:
            events.append(self._event(port, "ib_link_up", Severity.INFO, f"link back to {port.state}"))
        if port.active is not None:
            mem.active = port.active
        flap = self._flap(mem, port.active, now)
        if flap is not None:
            events.append(self._event(port, "ib_link_flap", Severity.CRITICAL, flap))
        return events

    def _flap(self, mem: _PortMemory, active: bool | None, now: float) -> str | None:
        """gpud's rule, one reading at a time: down, still down ``flap_down_s`` later, then ACTIVE again."""
        t = self.thresholds
        while mem.reverts and now - mem.reverts[0] > t.flap_window_s:
            mem.reverts.popleft()
        if active is None:
            return None  # unreadable: neither up nor down
        if not active:
            if mem.phase is FlapPhase.UP:
                mem.phase, mem.down_since = FlapPhase.DOWN, now
            elif mem.phase is FlapPhase.DOWN and now - mem.down_since >= t.flap_down_s:
                mem.phase = FlapPhase.DOWN_LONG
            return None
        was, mem.phase = mem.phase, FlapPhase.UP
        if was is not FlapPhase.DOWN_LONG:
            return None  # a short dip is not a flap (gpud: the down must persist)
        mem.reverts.append(now)
        if len(mem.reverts) < t.flap_count:
            return None
        mem.reverts.clear()  # reported once; the next report needs as many flaps again
        return (f"link flapping: down {t.flap_down_s:g} s or more and back {t.flap_count} times within "
                f"{_span(t.flap_window_s)}; a cable, transceiver or switch port is failing")

    def _error_events(self, port: IbPort, mem: _PortMemory, sample: IbPortSample, dt: float) -> list[Event]:
        if dt <= 0:
            return []
        rates = {str(k): v / dt for k, v in sample.deltas.items() if str(k) not in FATAL_COUNTERS}
        worst = max(rates.items(), key=lambda kv: kv[1], default=None)
        over = worst is not None and worst[1] > self.thresholds.error_rate
        events: list[Event] = []
        if over and worst is not None and not mem.degraded:
            name, rate = worst
            others = ", ".join(f"{k} +{sample.deltas[Text(k)]}" for k in sorted(rates) if k != name)
            events.append(self._event(
                port, "ib_errors", Severity.WARNING,
                f"degraded: {name} +{sample.deltas[Text(name)]} ({rate:.1f}/s, over {self.thresholds.error_rate:g}/s)"
                + (f"; also {others}" if others else ""),
                counter=name, delta=sample.deltas[Text(name)], rate=f"{rate:.3g}",
            ))
        mem.degraded = over
        return events

    def _event(self, port: IbPort, kind: str, severity: Severity, message: str, **extra: object) -> Event:
        details = {"device": port.device, "port": str(port.port), "link_layer": port.link_layer,
                   "state": port.state, "phys_state": port.phys_state, **extra}
        return Event(
            kind=Text(kind), severity=Text(severity.value), source=Text("infiniband"), ts=self.wall(),
            message=Text(clean_text(f"{port.device} port {port.port}: {message}")),
            details={Text(k): Text(clean_text(str(v), 200)) for k, v in details.items() if v is not None},
        )


def _grown(before: dict[str, int], after: dict[str, int], name: str) -> int | None:
    """Growth of one counter read both times (None if not); one that went backwards was cleared, so it grew by its value."""
    value, last = after.get(name), before.get(name)
    if value is None or last is None:
        return None
    # IBA counters saturate rather than wrap; one lower than before was reset (perfquery -R, driver reload).
    return value - last if value >= last else value


def _span(seconds: float) -> str:
    return f"{seconds / 3600:.4g} h" if seconds >= 3600 else f"{seconds:g} s"


def _text(value: str | None) -> Text | None:
    return None if value is None else _clean_short(value)


@functools.lru_cache(maxsize=256)
def _clean_short(value: str) -> Text:
    # States, physical states and link layers come from a handful of words: cleaned once each, not every tick.
    return Text(clean_text(value, 100))


# --------------------------------------------------------------------------- the source


@dataclass
class IbReading(Reading):
    """A reading of the HCA ports: the wire's per-port samples beside the events."""

    ib: list[IbPortSample] = field(default_factory=list)


class IbSource:
    """HCA ports as one agent source: read, judged, and kept whole for /metrics.

    Blocking: a sysfs read can hang in the driver (a wedged firmware command),
    so the agent reads it in its own thread under the source deadline.
    Simulated ports are numbers in memory: read inline, as a thread would cost more than the read.
    """

    name = "infiniband"
    blocking = True

    def __init__(self, reader: PortReader, judge: IbJudge | None = None) -> None:
        self.reader = reader
        self.judge = judge or IbJudge()
        self.simulated = reader.simulated
        self.blocking = not reader.simulated
        self.last: list[IbPort] = []  # swapped whole each read: /metrics reads it from its own thread
        self._unreadable: set[str] = set()  # files reported unreadable, until they read again

    def read(self) -> IbReading:
        ports, bad = self.reader.read_ports()
        samples, events = self.judge.judge(ports)
        events += self._unreadable_events(bad)
        self.last = ports
        return IbReading(events=events, ib=samples)

    def _unreadable_events(self, bad: list[Unreadable]) -> list[Event]:
        now_bad = {b.path: b.why for b in bad}
        fresh = [Unreadable(p, w) for p, w in now_bad.items() if p not in self._unreadable]
        self._unreadable = set(now_bad)
        events = []
        for b in fresh:  # once per streak: a file that stays bad is N/A, not news every second
            logger.warning("InfiniBand: {} unreadable ({}); that value is N/A", b.path, b.why)
            events.append(Event(
                kind=Text("ib_unreadable"), severity=Text(Severity.WARNING.value), source=Text("infiniband"),
                ts=self.judge.wall(),
                message=Text(clean_text(f"{b.path}: {b.why}; that value is N/A until it reads again")),
                details={Text("path"): Text(clean_text(b.path, 300)), Text("why"): Text(clean_text(b.why, 200))},
            ))
        return events

    def inject(self, kind: str, hca: int | None = None) -> str:
        """Inject a link fault (simulated HCAs only); see :meth:`SimulatedHcas.inject`."""
        if not isinstance(self.reader, SimulatedHcas):
            raise FaultNotSupported("faults can only be injected into simulated HCAs; this node has real ones")
        return self.reader.inject(kind, hca)

    def clear_faults(self) -> None:
        if isinstance(self.reader, SimulatedHcas):
            self.reader.clear_faults()

    def close(self) -> None:
        return None


# --------------------------------------------------------------------------- simulation

IB_FAULTS = ("ib-flap", "ib-down", "ib-errors")
SIM_HCAS = 8
_SIM_RATE_GBPS = 400.0


@dataclass
class _SimPort:
    device: str
    counters: dict[str, int]
    hw: dict[str, int]
    down: bool = False
    down_until: float | None = None  # a flapping port comes back then
    flaps_left: int = 0
    up_until: float | None = None  # ... and goes down again then
    errors_per_s: float = 0.0


class SimulatedHcas:
    """ConnectX-7 NDR ports (mlx5_0..) in sim mode: ACTIVE at 400 Gb/s, counters growing with traffic.

    Seeded and deterministic for a given clock. ``flap_down_s`` is how long one
    down of an injected flap lasts: a little longer than the judge's threshold,
    so that each one counts.
    """

    simulated = True

    def __init__(self, count: int = SIM_HCAS, seed: int = 0, clock: Callable[[], float] = time.monotonic,
                 flap_down_s: float = 25.0, flap_count: int = 3) -> None:
        self._rng = random.Random(seed)
        self._clock = clock
        self._last: float | None = None
        self.flap_down_s = flap_down_s
        self.flap_count = flap_count
        zero = dict.fromkeys(ERROR_COUNTERS, 0)
        self._ports = [
            _SimPort(
                device=f"mlx5_{i}",
                counters={**{k: v for k, v in zero.items() if k in _COUNTER_METRICS},
                          "port_rcv_data": self._rng.randrange(1 << 40), "port_xmit_data": self._rng.randrange(1 << 40),
                          "port_rcv_packets": 0, "port_xmit_packets": 0, "port_xmit_wait": 0},
                hw={k: v for k, v in zero.items() if k in _HW_COUNTER_METRICS},
            )
            for i in range(count)
        ]

    def read_ports(self) -> tuple[list[IbPort], list[Unreadable]]:
        now = self._clock()
        dt = 1.0 if self._last is None else max(now - self._last, 0.0)
        self._last = now
        return [self._read(p, now, dt) for p in self._ports], []

    def _read(self, p: _SimPort, now: float, dt: float) -> IbPort:
        self._advance_flap(p, now)
        noise = self._rng.random()  # drawn whatever the port's state: one fault leaves the others' numbers alone
        if not p.down:
            # A training job keeps an NDR rail well busy: 30-45 GB/s each way.
            words = int((30e9 + noise * 15e9) * dt / DATA_WORD_BYTES)
            p.counters["port_rcv_data"] += words
            p.counters["port_xmit_data"] += words
            p.counters["port_rcv_packets"] += words // 1024
            p.counters["port_xmit_packets"] += words // 1024
        if p.errors_per_s:
            grown = max(int(p.errors_per_s * dt), 1)
            p.counters["symbol_error"] = min(p.counters["symbol_error"] + grown, 0xFFFF)
            p.counters["port_rcv_errors"] = min(p.counters["port_rcv_errors"] + grown // 4, 0xFFFF)
        state, phys = ((PortState.DOWN, (2, "Polling")) if p.down else (PortState.ACTIVE, (5, "LinkUp")))
        return IbPort(
            device=p.device, port=1, state_id=int(state), state=state.name, phys_state_id=phys[0], phys_state=phys[1],
            rate_gbps=_SIM_RATE_GBPS, link_layer="InfiniBand", counters=dict(p.counters), hw_counters=dict(p.hw),
        )

    def _advance_flap(self, p: _SimPort, now: float) -> None:
        if p.down_until is not None and now >= p.down_until:
            p.down, p.down_until = False, None
            if p.flaps_left > 0:
                p.up_until = now + max(self.flap_down_s / 5, 0.05)
        elif p.up_until is not None and now >= p.up_until:
            p.up_until = None
            self._go_down(p, now)

    def _go_down(self, p: _SimPort, now: float) -> None:
        p.down = True
        p.counters["link_downed"] = min(p.counters["link_downed"] + 1, 0xFF)
        if p.flaps_left > 0:
            p.flaps_left -= 1
            # Just past the threshold, and at least two readings apart, so each down counts as gpud counts it.
            p.down_until = now + self.flap_down_s * 1.5

    def inject(self, kind: str, hca: int | None = None) -> str:
        """``ib-flap``: down and back ``flap_count`` times; ``ib-down``: down until cleared; ``ib-errors``: symbol errors.

        ``hca`` picks mlx5_<hca> (default 0). Raises ValueError for a bad kind or index.
        """
        kind = kind.strip().lower().replace("_", "-")
        index = 0 if hca is None else hca
        if kind not in IB_FAULTS:
            raise ValueError(f"unknown InfiniBand fault {kind!r}; choose one of {', '.join(IB_FAULTS)}")
        if not 0 <= index < len(self._ports):
            raise ValueError(f"no HCA {index} on this node (it has {len(self._ports)})")
        p = self._ports[index]
        now = self._clock()
        if kind == "ib-flap":
            p.flaps_left = self.flap_count
            p.up_until = None
            self._go_down(p, now)
            done = f"{p.device} port 1: link flapping ({self.flap_count} downs of {self.flap_down_s * 1.5:g} s)"
        elif kind == "ib-down":
            p.flaps_left, p.down_until, p.up_until = 0, None, None
            if not p.down:
                self._go_down(p, now)
            done = f"{p.device} port 1: link down until faults are cleared"
        else:
            p.errors_per_s = 200.0
            done = f"{p.device} port 1: symbol errors at 200/s (a bad cable)"
        logger.info("simulated fault injected: {}", done)
        return done

    def clear_faults(self) -> None:
        """Every port back up and clean; the counters keep what they counted, as on real hardware."""
        for p in self._ports:
            p.down, p.down_until, p.up_until, p.flaps_left, p.errors_per_s = False, None, None, 0, 0.0


def open_ib_source(root: str, simulate: int, seed: int = 0, thresholds: IbThresholds | None = None) -> IbSource | None:
    """The node's HCA ports: simulated ones (``simulate`` > 0, one per simulated GPU up to 8), else sysfs.

    None on a node with no ``root`` or no device in it: nothing to read.
    """
    t = thresholds or IbThresholds()
    if simulate > 0:
        sim = SimulatedHcas(min(simulate, SIM_HCAS), seed, flap_down_s=t.flap_down_s, flap_count=t.flap_count)
        return IbSource(sim, IbJudge(t))
    reader = SysfsPorts(root)
    if not reader.devices():
        logger.debug("no InfiniBand / RoCE devices under {}", root)
        return None
    return IbSource(reader, IbJudge(t))


# --------------------------------------------------------------------------- /metrics


def ib_families(ports: list[IbPort]) -> Iterator[Metric]:
    """node_exporter's ``node_infiniband_*`` families (labels device, port) for the last reading.

    A counter the port does not keep (``N/A (no PMA)``) is left out, as node_exporter leaves it out.
    """
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # only where /metrics is served

    labels = ["device", "port"]
    state = GaugeMetricFamily("node_infiniband_state_id", _STATE_HELP, labels=labels)
    phys = GaugeMetricFamily("node_infiniband_physical_state_id", _PHYS_HELP, labels=labels)
    rate = GaugeMetricFamily("node_infiniband_rate_bytes_per_second", "Maximum signal transfer rate", labels=labels)
    counters = {name: CounterMetricFamily(f"node_infiniband_{metric}", help_text, labels=labels)
                for name, (metric, help_text) in (_COUNTER_METRICS | _HW_COUNTER_METRICS).items()}
    lifespan = GaugeMetricFamily(
        "node_infiniband_lifespan_seconds",
        "The maximum period in ms which defines the aging of the counter reads. Two consecutive reads within this "
        "period might return the same values.", labels=labels)
    for p in ports:
        key = [p.device, str(p.port)]
        if p.state_id is not None:
            state.add_metric(key, float(p.state_id))
        if p.phys_state_id is not None:
            phys.add_metric(key, float(p.phys_state_id))
        if p.rate_gbps is not None:
            rate.add_metric(key, p.rate_gbps * 1e9 / 8)
        for name, value in (p.hw_counters | p.counters).items():
            family = counters.get(name)
            if family is not None:
                family.add_metric(key, float(value * DATA_WORD_BYTES if name in ("port_rcv_data", "port_xmit_data") else value))
        if "lifespan" in p.hw_counters:
            lifespan.add_metric(key, float(p.hw_counters["lifespan"] // 1000))  # node_exporter's integer division
    yield from (state, phys, rate)
    yield from (f for f in counters.values() if f.samples)
    if lifespan.samples:
        yield lifespan
