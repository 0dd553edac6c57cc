"""The NVML source against a fake pynvml: N/A is N/A, lost GPUs and XIDs are reported once."""

from __future__ import annotations

import inspect

import pynvml as real_pynvml
import pytest

from gridwatch.agent.sources import FaultNotSupported
from gridwatch.agent.sources.nvml import NVLINK_EVERY, NvmlSource, open_gpu_source
from gridwatch.wire.throttle import decode_throttle
from tests import fake_pynvml
from tests.fake_pynvml import FakeGpu


def test_the_fake_speaks_pynvml_names_and_values() -> None:
    for name, value in fake_pynvml.CONSTANTS.items():
        assert getattr(real_pynvml, name) == value, name
    for name, code in fake_pynvml.ERROR_CLASSES.items():
        assert issubclass(getattr(real_pynvml, name), real_pynvml.NVMLError), name
        assert getattr(real_pynvml, name)().value == code
    fake = fake_pynvml.build(fake_pynvml.FakeNvml(gpus=[]))
    for name in fake_pynvml.FUNCTIONS:
        real_params = list(inspect.signature(getattr(real_pynvml, name)).parameters)
        fake_params = list(inspect.signature(getattr(fake, name)).parameters)
        assert fake_params == real_params, name


def _source(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu]) -> tuple[NvmlSource, fake_pynvml.FakeNvml]:
    state = fake_pynvml.install(monkeypatch, gpus)
    source, notes = open_gpu_source(0, 0)
    assert isinstance(source, NvmlSource), notes
    return source, state


def test_a_healthy_gpu_reads_in_operator_units(monkeypatch: pytest.MonkeyPatch) -> None:
    source, _ = _source(monkeypatch, [FakeGpu(0, power_mw=612_500, energy_mj=9_000_000, bus_id="00000000:3B:00.0")])
    (s,) = source.sample()
    assert (s.util, s.mem_util, s.temp_c) == (97, 41, 66)
    assert s.power_w == pytest.approx(612.5)
    assert s.energy_j == pytest.approx(9000.0)
    assert s.mem_used_mb == pytest.approx(70000) and s.mem_total_mb == pytest.approx(81559)
    assert (s.sm_clock_mhz, s.mem_clock_mhz, s.procs, s.state) == (1980, 2619, 1, "ok")
    assert source.info()[0].pci_bus_id == "0000:3b:00.0"
    assert source.info()[0].name == "NVIDIA H100 80GB HBM3"


def test_an_unsupported_or_blank_field_is_na_not_zero_and_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGpu(
        0,
        unsupported={"nvmlDeviceGetPowerUsage", "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetNvLinkState"},
        blank={"nvmlDeviceGetTotalEnergyConsumption"},
    )
    source, _ = _source(monkeypatch, [gpu])
    for _ in range(3):
        (s,) = source.sample()
    assert s.power_w is None and s.pcie_replay is None and s.energy_j is None and s.nvlink_errors is None
    assert s.util == 97  # the rest still reads
    assert gpu.calls["nvmlDeviceGetPowerUsage"] == 1


def test_ampere_reports_remapped_rows_where_older_gpus_retire_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    hopper = FakeGpu(0, unsupported={"nvmlDeviceGetRetiredPages"}, remapped=(0, 1, 1, 0))
    volta = FakeGpu(1, unsupported={"nvmlDeviceGetRemappedRows"}, retired_dbe=[0x1000, 0x2000], retired_sbe=[0x3000])
    source, _ = _source(monkeypatch, [hopper, volta])
    h, v = source.sample()
    assert h.retired_pages is None and h.remapped_rows_pending is True and h.remapped_rows_failed is False
    assert v.retired_pages == 3 and v.remapped_rows_pending is None


def test_throttle_reasons_and_nvlink_errors_are_named_and_summed(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGpu(0, throttle=0x40 | 0x20 | 0x1, nvlink_errors={(0, 2): 3, (5, 0): 4}, nvlinks=12)
    source, _ = _source(monkeypatch, [gpu])
    (s,) = source.sample()
    assert s.throttle == ["sw_thermal", "hw_thermal"]
    assert s.nvlink_errors == 7
    gpu.nvlink_errors[(1, 3)] = 5
    readings = [source.sample()[0].nvlink_errors for _ in range(NVLINK_EVERY)]
    assert readings[0] == 7 and readings[-1] == 12  # counted up on the next NVLink read, never lost
    assert gpu.calls["nvmlDeviceGetNvLinkErrorCounter"] == 2 * 12 * 4
    assert decode_throttle(0x4 | 0x8 | 0x80) == ["sw_power", "hw_slowdown", "power_brake"]


def test_a_lost_gpu_reads_lost_and_emits_one_event(monkeypatch: pytest.MonkeyPatch) -> None:
    source, state = _source(monkeypatch, [FakeGpu(0), FakeGpu(1)])
    source.sample()
    state.gpus[1].lost = True
    events = []
    for _ in range(3):
        healthy, lost = source.sample()
        events += source.poll_events()
        assert healthy.state == "ok" and healthy.util == 97
        assert lost.state == "lost" and lost.util is None and lost.temp_c is None
    assert [(e.kind, e.gpu, e.severity) for e in events] == [("fell_off_bus", 1, "critical")]
    assert events[0].details["pci_bus_id"] == "0000:28:00.0"


def test_xid_from_the_event_set_carries_code_gpu_and_pci_id(monkeypatch: pytest.MonkeyPatch) -> None:
    source, state = _source(monkeypatch, [FakeGpu(0), FakeGpu(1)])
    assert source.poll_events() == []
    state.queue_xid(1, 48)
    state.queue_xid(0, 13)
    events = source.poll_events()
    assert [(e.kind, e.code, e.gpu, e.severity) for e in events] == [("xid", 48, 1, "critical"), ("xid", 13, 0, "warning")]
    assert events[0].details["pci_bus_id"] == "0000:28:00.0" and events[0].source == "nvml"
    assert source.poll_events() == []


def test_no_driver_means_no_gpus_and_one_note(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pynvml.install(monkeypatch, 2, driver=False)
    source, notes = open_gpu_source(0, 0)
    assert source is None
    assert len(notes) == 1 and notes[0].startswith("no NVIDIA driver: running without GPUs")


def test_real_gpus_refuse_fault_injection_and_close_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    source, state = _source(monkeypatch, [FakeGpu(0)])
    with pytest.raises(FaultNotSupported, match="simulated GPUs"):
        source.inject("thermal", 0)
    source.close()
    assert state.shutdowns == 1


def test_simulate_gives_simulated_gpus_without_touching_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    state = fake_pynvml.install(monkeypatch, 2)
    source, notes = open_gpu_source(4, seed=7)
    assert source is not None and source.simulated and len(source.info()) == 4
    assert not state.initialised and notes == ["simulated GPUs: 4 (seed 7)"]
