"""/metrics: dcgm-exporter names and labels over real HTTP, N/A absent rather than zero."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gridwatch.agent.metrics import MetricsExporter
from gridwatch.agent.sources.simulated import SimulatedGpus
from gridwatch.wire.protocol import AgentStats, Event, GpuInfo, GpuSample, HostSample, NicSample, Text

# What dcgm-exporter's own output draws from promtool; nothing else may appear.
DCGM_LINT = ("label names should be written in 'snake_case' not 'camelCase'", "should not include type 'counter'")


def _exporter() -> MetricsExporter:
    infos = [
        GpuInfo(index=0, uuid=Text("GPU-aaaa"), name=Text("NVIDIA H100 80GB HBM3"), pci_bus_id=Text("0000:3b:00.0"),
                driver=Text("550.54.15")),
        GpuInfo(index=1, uuid=Text("GPU-bbbb"), name=Text("NVIDIA H100 80GB HBM3"), pci_bus_id=Text("0000:5d:00.0")),
    ]
    gpus = [
        GpuSample(index=0, util=97, temp_c=66, power_w=None, energy_j=1234.5, mem_used_mb=70000, mem_total_mb=81559,
                  throttle=[Text("hw_thermal"), Text("sw_thermal")], ecc_dbe=0),
        GpuSample(index=1, state=Text("lost")),
    ]
    host = HostSample(cpu_percent=25.0, mem_used_mb=1024, mem_total_mb=4096, load1=1.5, psi_io=12.0,
                      nics=[NicSample(name=Text("ib0"), rx_bps=1e9, tx_bps=2e9, rx_errors=3, up=True, speed_mbps=400000)])
    agent = AgentStats(cpu_percent=0.5, rss_mb=42, clients=2, dropped_frames=7, tick_ms=3.0)
    exporter = MetricsExporter()
    exporter.update("node07", infos, gpus, host, agent)
    exporter.record_event(Event(kind=Text("xid"), code=79, gpu=1, severity=Text("critical")))
    return exporter


def _scrape(exporter: MetricsExporter) -> str:
    port = exporter.start("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return response.read().decode()
    finally:
        exporter.close()


def _samples(text: str) -> dict[tuple[str, str], tuple[dict[str, str], float]]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.labels.get("gpu") or s.labels.get("nic") or s.labels.get("resource") or s.labels.get("kind") or ""
            out[(s.name, key)] = (s.labels, s.value)
    return out


def test_scrape_has_dcgm_names_labels_and_units() -> None:
    samples = _samples(_scrape(_exporter()))
    labels, util = samples[("DCGM_FI_DEV_GPU_UTIL", "0")]
    assert util == 97
    assert labels == {
        "gpu": "0", "UUID": "GPU-aaaa", "pci_bus_id": "00000000:3B:00.0", "device": "nvidia0",
        "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "node07", "DCGM_FI_DRIVER_VERSION": "550.54.15",
    }
    assert samples[("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "0")][1] == 1234500  # mJ, as dcgm reports it
    assert samples[("DCGM_FI_DEV_FB_FREE", "0")][1] == 11559
    assert samples[("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "0")][1] == 0x60
    assert samples[("DCGM_FI_DEV_XID_ERRORS", "1")][1] == 79
    assert samples[("gridwatch_host_cpu_utilization_ratio", "")][1] == 0.25
    assert samples[("gridwatch_host_nic_receive_bytes_per_second", "ib0")][1] == 1e9
    assert samples[("gridwatch_host_nic_speed_bytes_per_second", "ib0")][1] == 400000 * 125_000
    assert samples[("gridwatch_host_pressure_some_avg10_ratio", "io")][1] == 0.12
    assert samples[("gridwatch_agent_dropped_frames_total", "")][1] == 7
    assert samples[("gridwatch_events_total", "xid")][1] == 1


def test_na_fields_and_lost_gpus_are_absent_not_zero() -> None:
    samples = _samples(_exporter().render().decode())
    assert ("DCGM_FI_DEV_POWER_USAGE", "0") not in samples  # power N/A on GPU 0
    assert ("DCGM_FI_DEV_SM_CLOCK", "0") not in samples
    lost = [name for name, gpu in samples if gpu == "1" and name.startswith("DCGM_FI_DEV")]
    assert sorted(lost) == ["DCGM_FI_DEV_XID_ERRORS"]
    assert samples[("gridwatch_gpu_state", "1")][0]["state"] == "lost"
    assert ("gridwatch_host_disk_read_bytes_per_second", "") not in samples


def test_before_any_update_the_page_still_serves() -> None:
    assert "gridwatch_events_total" not in _samples(MetricsExporter().render().decode())


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_finds_nothing_beyond_what_dcgm_exporter_itself_draws() -> None:
    gpus = SimulatedGpus(8, seed=1)
    gpus.inject("thermal", 2)
    exporter = _exporter()
    exporter.update("node01", gpus.info(), gpus.sample(), HostSample(cpu_percent=3.0), AgentStats())
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=exporter.render(), capture_output=True, timeout=60, check=False
    )
    problems = [line for line in result.stderr.decode().splitlines() if line.strip()]
    assert result.returncode in (0, 3), result.stderr
    unexpected = [p for p in problems if not any(ok in p for ok in DCGM_LINT)]
    assert unexpected == []
    assert not any(p.startswith("gridwatch_host") or p.startswith("gridwatch_agent") for p in problems)
