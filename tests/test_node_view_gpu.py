"""The node view per GPU as nvitop shows it (clocks, PCIe and NVLink throughput) and the node's traffic with its HCAs'."""

from __future__ import annotations

import pytest

from gridwatch.console.fleet.metrics import gpu_pcie_traffic
from gridwatch.console.tui.screens import FleetScreen, NodeScreen
from gridwatch.console.tui.screens.node import format_clocks, format_pair, host_text
from gridwatch.console.tui.widgets import TextTable
from gridwatch.wire.protocol import IbPortSample, NicSample, Text
from tests.support_app import make_app, screen_text, shown, wait_for
from tests.support_frames import make_sample


def _sample(name: str, seq: int):  # noqa: ANN202
    """Two GPUs: a Hopper whose NVML gives every rate, and an older card that gives no NVLink rate nor GPM's PCIe."""
    sample = make_sample(name, seq, gpus=2)
    hopper, old = sample.gpus
    hopper.sm_clock_mhz, hopper.mem_clock_mhz = 1980.0, 2619.0
    hopper.pcie_rx_bps, hopper.pcie_tx_bps = 25.1e9, 12.0e9
    hopper.nvlink_rx_bps, hopper.nvlink_tx_bps = 412.5e9, 398.0e9
    old.sm_clock_mhz = 1410.0  # memory clock, GPM and NVLink rates unknown
    old.pcie_rx_kbs = 1000.0  # nvmlDeviceGetPcieThroughput only, and only one way
    sample.host.nics = [NicSample(name=Text("eth0"), rx_bps=1.2e9, tx_bps=0.1e9)]
    sample.host.ib = [IbPortSample(device=Text(f"mlx5_{i}"), port=1, state=Text("ACTIVE"), link_layer=Text("InfiniBand"),
                                   rx_bps=5.5e9, tx_bps=5e9) for i in range(8)]
    return sample


def _gpu_line(said: str, gpu: str) -> str:
    return next(line for line in said.splitlines() if line.split()[:2] == [gpu, "NVIDIA"])


def test_rates_and_clocks_read_with_units_and_a_dash_when_unknown() -> None:
    assert format_clocks(1980.0, 2619.0) == "1980/2619" and format_clocks(1410.0, None) == "1410/-"
    assert format_clocks(None, None) == "-"
    assert format_pair(25.1e9, 12.0e9) == "25.1G/12.0G" and format_pair(None, 3e6) == "-/3.0M"
    assert format_pair(None, None) == "-"
    hopper, old = _sample("n", 1).gpus
    assert gpu_pcie_traffic(hopper) == (25.1e9, 12.0e9)
    assert gpu_pcie_traffic(old) == (1000.0 * 1024, None)  # NVML's KB/s are KiB/s


def test_the_node_s_traffic_counts_its_hcas_and_says_their_share() -> None:
    app = make_app(["node01", "node02"])
    store = app.runtime.store
    store.apply(_sample("node01", 9))
    said = host_text(store.by_name("node01")).plain
    assert "net rx     45.2G" in said and "(ib 44.0G)" in said  # 1.2 GB/s on eth0, 44 GB/s on the HCAs
    assert "net tx     40.1G" in said and "(ib 40.0G)" in said
    plain = host_text(store.by_name("node02")).plain  # no HCA: no IB part, the NIC alone
    assert "net rx      1.2G" in plain and "(ib" not in plain


@pytest.mark.parametrize(("size", "sparklines"), [((120, 40), False), ((80, 24), False), ((160, 50), True)])
async def test_each_gpu_shows_its_clocks_and_throughput_at_every_size(size: tuple[int, int], sparklines: bool) -> None:
    app = make_app(["node01", "node02"])
    app.runtime.store.apply(_sample("node01", 9))
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.open_node("node01")
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        table = app.screen.query_one("#gpu-table", TextTable)
        cells = {row[0][0]: [c[0] for c in row] for row in table.row_cells()}
        titles = [c.title for c in table.columns]
        clock, pcie, nvlink = (titles.index(t) for t in ("SM/MEM MHz", "PCIE RX/TX", "NVLINK RX/TX"))
        assert [cells["0"][i] for i in (clock, pcie, nvlink)] == ["1980/2619", "25.1G/12.0G", "412.5G/398.0G"]
        assert [cells["1"][i] for i in (clock, pcie, nvlink)] == ["1410/-", "1.0M/-", "-"]
        assert not any("None" in c for row in cells.values() for c in row)
        said = screen_text(app)
        assert "None" not in said
        # What says a GPU is bad stays in view at every size; sparklines only where there is room for them.
        for title in ("GPU", "NAME", "STATE", "XID", "ECC s/d", "THROTTLE", "UTIL %"):
            assert title in said, (size, title)
        assert any(ch in _gpu_line(said, "0") for ch in "▁▂▃▄▅▆▇█") == sparklines
        if size[0] >= 120:  # every column in view
            assert "1980/2619" in _gpu_line(said, "0") and "412.5G/398.0G" in _gpu_line(said, "0")
            assert "(ib 44.0G)" in said
        else:  # the rest is a scroll away
            assert "1980/2619" not in said
            table.focus()
            for _ in range(7):  # a column a press
                await pilot.press("right")
            await wait_for(pilot, lambda: "412.5G/398.0G" in screen_text(app))
            assert screen_text(app).splitlines()[1].rstrip().endswith("NVLINK RX/TX")  # the last column, whole
