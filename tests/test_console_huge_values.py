"""A node that sends 1e308 for every reading (a broken exporter, or on purpose): every view still draws."""

from __future__ import annotations

from gridwatch.console.tui.screens import FleetScreen, NodeScreen
from gridwatch.wire.protocol import GpuSample, HostSample, NicSample, Sample, TrainerStatus
from tests.support_app import SIZE, make_app, screen_text, shown, wait_for

HUGE = 1e308
_GPU_FLOATS = ("util mem_util mem_used_mb mem_total_mb temp_c power_w energy_j sm_clock_mhz mem_clock_mhz pcie_tx_kbs "
               "pcie_rx_kbs mem_temp_c enc_util dec_util mem_reserved_mb gr_engine_active sm_active sm_occupancy "
               "tensor_active dram_active pcie_tx_bps pcie_rx_bps nvlink_tx_bps nvlink_rx_bps").split()


def _huge_sample(ts: float) -> Sample:
    host = HostSample(cpu_percent=HUGE, mem_used_mb=HUGE, mem_total_mb=HUGE, disk_read_bps=HUGE, disk_write_bps=HUGE,
                      psi_cpu=HUGE, psi_memory=HUGE, psi_io=HUGE, nics=[NicSample(name="eth0", rx_bps=HUGE, tx_bps=HUGE)])
    trainer = TrainerStatus(job="j", phase="training", step=10**18, loss=HUGE, grad_norm=HUGE, world_size=10**9,
                            tokens_per_s=HUGE, step_time_s=HUGE)
    return Sample(node="node01", ts=ts, gpus=[GpuSample(index=0, **dict.fromkeys(_GPU_FLOATS, HUGE))], host=host,
                  trainer=trainer)


async def test_a_node_sending_1e308_opens_and_every_view_draws() -> None:
    app = make_app(["node01", "node02"])
    store = app.runtime.store
    node = store.by_name("node01")
    assert node is not None
    store.apply(_huge_sample(store.clock.now()), node.key)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        await pilot.press("enter")
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        assert "node01" in screen_text(app)
        await pilot.press("escape")
        for command in ("training", "incidents", "logs", "nodes"):
            await pilot.press(":", *command, "enter")
            await pilot.pause(0.2)
        await wait_for(pilot, lambda: shown(app, FleetScreen))
    assert app.return_code in (None, 0)
