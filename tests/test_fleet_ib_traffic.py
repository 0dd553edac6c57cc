"""The fleet table's RX/TX count a node's InfiniBand / RoCE HCA ports, not only its NICs."""

from __future__ import annotations

from collections import Counter

from gridwatch.console.fleet.metrics import aggregate, hca_traffic, host_traffic
from gridwatch.console.fleet.state import ManualClock, StateStore
from gridwatch.wire.frames import summarize
from gridwatch.wire.protocol import HostSample, IbPortSample, NicSample, Text
from tests.support_frames import T0, make_hello, make_sample


def _ib_sample(name: str, seq: int):  # noqa: ANN202
    sample = make_sample(name, seq, gpus=2)
    sample.host.nics = [NicSample(name=Text("eth0"), rx_bps=1000.0, tx_bps=500.0)]
    sample.host.ib = [IbPortSample(device=Text(f"mlx5_{i}"), port=1, state=Text("ACTIVE"), rx_bps=5.5e9, tx_bps=5e9)
                      for i in range(8)] + [IbPortSample(device=Text("mlx5_9"), port=1)]  # no rate yet
    return sample


def test_hca_ports_add_to_the_nics() -> None:
    host = _ib_sample("n", 1).host
    assert host_traffic(host) == (1000.0 + 8 * 5.5e9, 500.0 + 8 * 5e9)
    assert host_traffic(HostSample()) == (None, None)
    assert host_traffic(HostSample(ib=[IbPortSample(device=Text("mlx5_0"), port=1, rx_bps=0.0)])) == (0.0, 0.0)
    assert host_traffic(HostSample(ib=[IbPortSample(device=Text("mlx5_0"), port=1)])) == (None, None)
    # The HCAs' share, which the node view says beside the total.
    assert hca_traffic(host) == (8 * 5.5e9, 8 * 5e9)
    assert hca_traffic(HostSample(nics=host.nics)) == (None, None)


def test_an_infiniband_node_does_not_read_zero_in_a_sample_or_a_summary() -> None:
    sample = _ib_sample("node01", 1)
    agg = aggregate(sample, Counter())
    assert agg.rx_bps == 1000.0 + 8 * 5.5e9 and agg.tx_bps == 500.0 + 8 * 5e9
    summary = summarize(sample)
    assert summary.rx_bps == round(1000.0 + 8 * 5.5e9) and summary.tx_bps == round(500.0 + 8 * 5e9)
    assert aggregate(summary, Counter()).rx_bps == summary.rx_bps
    store = StateStore(ManualClock(T0))
    store.set_link("node01", "connected", role="operator")
    store.apply(make_hello("node01", 2))
    store.apply(sample)
    row = store.node_row(store.by_name("node01"), T0)
    assert row.rx_bps is not None and row.rx_bps > 44e9
