"""The ports on /metrics: node_exporter's ``node_infiniband_*`` families, under its names and help texts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from gridwatch.agent.sources.ib.ports import DATA_WORD_BYTES, IbPort

if TYPE_CHECKING:
    from prometheus_client.core import Metric

# sysfs file -> node_exporter metric (collector/infiniband_linux.go), labels device and port.
COUNTER_METRICS: dict[str, tuple[str, str]] = {
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
HW_COUNTER_METRICS: dict[str, tuple[str, str]] = {
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
                for name, (metric, help_text) in (COUNTER_METRICS | HW_COUNTER_METRICS).items()}
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
