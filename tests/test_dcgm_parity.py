"""Parity with dcgm-exporter: every metric of its default counters file, with its labels, from the first scrape."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gridwatch.agent.metrics import GPU_LABELS, MetricsExporter
from gridwatch.agent.sources.nvml import NvmlSource, open_gpu_source
from gridwatch.agent.sources.simulated import SimulatedGpus
from gridwatch.wire.protocol import AgentStats, Event, GpuInfo, GpuSample, HostSample, Text
from tests import fake_pynvml
from tests.fake_pynvml import FakeGpu

COUNTERS = Path(__file__).parent / "data" / "dcgm" / "default-counters.csv"


@dataclass(frozen=True)
class Counter:
    name: str
    kind: str  # gauge | counter | label
    help: str


def default_counters() -> list[Counter]:
    """The enabled lines of dcgm-exporter's etc/default-counters.csv (``#`` starts a comment)."""
    out = []
    for row in csv.reader(line for line in COUNTERS.read_text().splitlines() if line.strip() and not line.startswith("#")):
        name, kind, help_text = (cell.strip() for cell in (*row[:2], ",".join(row[2:])))
        out.append(Counter(name, kind, help_text))
    return out


def _families(exporter: MetricsExporter) -> dict[str, tuple[str, list[dict[str, str]], list[float]]]:
    out = {}
    for family in text_string_to_metric_families(exporter.render().decode()):
        out[family.name] = (family.type, [s.labels for s in family.samples], [s.value for s in family.samples])
    return out


def _scrape(infos: list[GpuInfo], gpus: list[GpuSample]) -> dict[str, tuple[str, list[dict[str, str]], list[float]]]:
    exporter = MetricsExporter()
    exporter.update("node07", infos, gpus, HostSample(), AgentStats())
    return _families(exporter)


def _nvml(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu]) -> NvmlSource:
    fake_pynvml.install(monkeypatch, gpus)
    source, notes = open_gpu_source(0, 0)
    assert isinstance(source, NvmlSource), notes
    return source


def test_the_copy_is_dcgm_exporters_file() -> None:
    names = [c.name for c in default_counters()]
    assert len(names) == 26 and "DCGM_FI_DEV_MEMORY_TEMP" in names and "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" in names
    assert {c.kind for c in default_counters()} == {"gauge", "counter", "label"}


@pytest.mark.parametrize("reader", ["simulated", "nvml"])
def test_every_default_counter_is_exported_for_every_gpu_from_the_first_scrape(
    reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if reader == "simulated":
        source: SimulatedGpus | NvmlSource = SimulatedGpus(4, seed=3)
    else:
        source = _nvml(monkeypatch, [FakeGpu(i) for i in range(4)])
    families = _scrape(source.info(), source.sample())
    for counter in default_counters():
        if counter.kind == "label":
            continue
        assert counter.name in families, f"{counter.name} is not exported"
        kind, labels, values = families[counter.name]
        # A counter stays a gauge: prometheus_client would rename it NAME_total, and dashboards query NAME.
        assert kind == "gauge", counter
        assert sorted(int(s["gpu"]) for s in labels) == [0, 1, 2, 3], counter.name
        assert all(set(GPU_LABELS) <= set(s) for s in labels), counter.name
        assert all(v == v for v in values), f"{counter.name}: NaN"  # N/A is absent, never NaN


def test_the_driver_version_is_a_label_of_every_gpu_metric(monkeypatch: pytest.MonkeyPatch) -> None:
    source = _nvml(monkeypatch, [FakeGpu(0)])
    families = _scrape(source.info(), source.sample())
    labels = families["DCGM_FI_DEV_GPU_TEMP"][1][0]
    assert labels["DCGM_FI_DRIVER_VERSION"] == "550.54.15"
    assert labels["UUID"].startswith("GPU-") and labels["pci_bus_id"] == "00000000:18:00.0"
    assert labels["device"] == "nvidia0" and labels["Hostname"] == "node07"


def test_xid_errors_reads_zero_from_the_start_then_the_last_code_with_its_meaning() -> None:
    gpus = SimulatedGpus(2, seed=1)
    exporter = MetricsExporter()
    exporter.update("node07", gpus.info(), gpus.sample(), HostSample(), AgentStats())
    _kind, labels, values = _families(exporter)["DCGM_FI_DEV_XID_ERRORS"]
    assert values == [0.0, 0.0]
    assert [(s["err_code"], s["err_msg"]) for s in labels] == [("0", "No Error"), ("0", "No Error")]
    exporter.record_event(Event(kind=Text("xid"), code=79, gpu=1, severity=Text("critical")))
    _kind, labels, values = _families(exporter)["DCGM_FI_DEV_XID_ERRORS"]
    assert values == [0.0, 79.0]
    assert labels[1]["err_code"] == "79" and "fallen off the bus" in labels[1]["err_msg"]


def test_profiling_fields_are_absent_where_gpm_is_not_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    a100 = FakeGpu(0, name="NVIDIA A100-SXM4-80GB", gpm_supported=False, nvlinks=12)
    h100 = FakeGpu(1)
    source = _nvml(monkeypatch, [a100, h100])
    families = _scrape(source.info(), source.sample())
    for name in ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_NVLINK_L0_TX_BYTES"):
        assert [s["gpu"] for s in families[name][1]] == ["1"], name
    # The rest of the A100's fields still read.
    assert [s["gpu"] for s in families["DCGM_FI_DEV_MEMORY_TEMP"][1]] == ["0", "1"]


def test_per_link_nvlink_rates_stay_on_metrics_and_out_of_the_frames() -> None:
    # 18 links x 2 per GPU would be 40 % of a sample that no view reads; /metrics keeps them.
    from gridwatch.agent.tick import _for_the_wire
    from gridwatch.wire import protocol as p

    gpu = p.GpuSample(index=0, util=50.0, nvlink_link_tx_bps=[1.0] * 18, nvlink_link_rx_bps=[2.0] * 18)
    sent = _for_the_wire(gpu)
    assert sent.nvlink_link_tx_bps == [] and sent.nvlink_link_rx_bps == [] and sent.util == 50.0
    assert gpu.nvlink_link_tx_bps == [1.0] * 18  # the reading /metrics exports is untouched
    assert b"nvlink_link" not in p.encode(p.Sample(gpus=[sent]))
