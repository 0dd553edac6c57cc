"""NVML GPM (Hopper and later) through the NVML source: dcgm's units, N/A where unsupported, never a hung sample."""

from __future__ import annotations

import threading
import time

import pytest

from gridwatch.agent.sources import GuardedSource, SourceState
from gridwatch.agent.sources.nvml import NvmlSource, open_gpu_source
from tests import fake_pynvml
from tests.conftest import wait_until, wait_until_async
from tests.fake_pynvml import FakeGpu, busy_gpm

MIB = 1024 * 1024


def _source(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu]) -> tuple[NvmlSource, fake_pynvml.FakeNvml]:
    state = fake_pynvml.install(monkeypatch, gpus)
    source, notes = open_gpu_source(0, 0)
    assert isinstance(source, NvmlSource), notes
    return source, state


def test_gpm_reads_in_dcgm_units_ratios_and_bytes_per_second(monkeypatch: pytest.MonkeyPatch) -> None:
    source, _ = _source(monkeypatch, [FakeGpu(0)])
    (s,) = source.sample()
    assert (s.gr_engine_active, s.sm_active, s.sm_occupancy) == pytest.approx((0.96, 0.81, 0.34))
    assert (s.tensor_active, s.dram_active) == pytest.approx((0.47, 0.42))
    assert s.pcie_tx_bps == pytest.approx(30.5 * MIB) and s.pcie_rx_bps == pytest.approx(61 * MIB)
    assert s.nvlink_rx_bps == pytest.approx(18 * 12_000 * MIB) and s.nvlink_tx_bps == pytest.approx(18 * 11_000 * MIB)
    assert len(s.nvlink_link_tx_bps) == 18 and s.nvlink_link_tx_bps[17] == pytest.approx(11_000 * MIB)
    assert s.nvlink_link_rx_bps[0] == pytest.approx(12_000 * MIB)


def test_each_reading_covers_the_last_tick_from_two_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGpu(0)
    source, state = _source(monkeypatch, [gpu])
    source.sample()
    gpu.gpm = {**busy_gpm(), 5: 3.0}  # the job stalls: tensor pipes go quiet
    (s,) = source.sample()
    assert s.tensor_active == pytest.approx(0.03)
    # One sample at start, then one per tick: the previous tick's sample is the first of the pair.
    assert gpu.calls["nvmlGpmSampleGet"] == 3
    assert len(state.gpm_samples) == 2
    source.close()
    assert all(sample.freed for sample in state.gpm_samples)


def test_no_gpm_means_na_and_is_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    old_driver = FakeGpu(0, unsupported={"nvmlGpmQueryDeviceSupport"})
    ampere = FakeGpu(1, name="NVIDIA A100-SXM4-80GB", gpm_supported=False)
    source, state = _source(monkeypatch, [old_driver, ampere])
    for _ in range(3):
        samples = source.sample()
    for s in samples:
        assert s.gr_engine_active is None and s.tensor_active is None and s.nvlink_link_tx_bps == []
        assert s.util == 97 and s.mem_temp_c == 71  # everything else still reads
    assert "nvmlGpmSampleGet" not in old_driver.calls and "nvmlGpmSampleGet" not in ampere.calls
    assert state.gpm_samples == []


def test_a_metric_the_gpu_lacks_is_na_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGpu(0, gpm={k: v for k, v in busy_gpm().items() if k != 3})  # no SM occupancy on this part
    source, _ = _source(monkeypatch, [gpu])
    (s,) = source.sample()
    assert s.sm_occupancy is None and s.sm_active == pytest.approx(0.81)


def test_a_failed_gpm_sample_costs_one_tick_then_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGpu(0)
    source, _ = _source(monkeypatch, [gpu])
    gpu.unsupported.add("nvmlGpmSampleGet")  # answers an error this tick
    (s,) = source.sample()
    assert s.tensor_active is None and s.util == 97
    gpu.unsupported.discard("nvmlGpmSampleGet")
    source.sample()  # takes the first sample of a new pair
    (s,) = source.sample()
    assert s.tensor_active == pytest.approx(0.47)


def test_a_gpu_lost_during_gpm_reads_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGpu(0)
    source, _ = _source(monkeypatch, [gpu])
    gpu.lost = True
    (s,) = source.sample()
    assert s.state == "lost"
    assert [e.kind for e in source.poll_events()] == ["fell_off_bus"]


async def test_a_hung_gpm_read_never_hangs_the_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    gpu = FakeGpu(0)
    source, _ = _source(monkeypatch, [gpu])
    guard = GuardedSource(source, timeout=0.3)
    assert (await guard.read()).reading is not None
    gpu.blocking["nvmlGpmSampleGet"] = release
    started = time.monotonic()
    outcome = await guard.read()
    assert outcome.reading is None and guard.state is SourceState.HUNG
    assert time.monotonic() - started < 2.0
    assert [e.kind for e in outcome.events] == ["source_failed"]
    release.set()
    del gpu.blocking["nvmlGpmSampleGet"]
    await wait_until(lambda: not guard.busy, timeout=5, what="the hung GPM read to finish")

    async def answers() -> bool:
        # One read on a loaded machine can itself pass the 0.3 s deadline; the source must answer again soon.
        return (await guard.read()).reading is not None

    await wait_until_async(answers, timeout=10, what="the source to answer again")
    assert guard.state is SourceState.OK

