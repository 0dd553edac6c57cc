"""NVIDIA's XID catalogue as shipped: every code with its resolution and source, on every path an XID takes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gridwatch.agent.detectors.kernel import DETECTORS
from gridwatch.agent.sources.nvml import NvmlSource, open_gpu_source
from gridwatch.agent.sources.simulated import SimulatedGpus
from gridwatch.playbooks.clock import ManualClock
from gridwatch.playbooks.engine import Engine
from gridwatch.playbooks.loader import load_builtin
from gridwatch.wire import protocol as p
from gridwatch.wire import xid as xc
from gridwatch.wire.xid import xid_entry, xid_meaning, xid_resolution, xid_severity
from tests import fake_pynvml

ROOT = Path(__file__).resolve().parent.parent
# A real kernel line (gpud's test data), with its source.
XID119 = ("[Sun Feb 23 16:24:18 2025] NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, Timeout after "
          "6s of waiting for RPC response from GPU4 GSP! Expected function 103 (GSP_RM_ALLOC) (0x2081 0x4).")
XID119_SOURCE = ("https://github.com/leptonai/gpud/blob/4a8de33a3f02e207f39e9023d67125592d599731/"
                 "components/accelerator/nvidia/xid/testdata/dmesg-with-xid-119.log")


def test_the_catalogue_lists_every_published_code_with_a_resolution_and_a_source() -> None:
    catalog = xc.xid_catalog()
    assert sorted(catalog) == list(range(1, 163))  # NVIDIA's catalogue, XID 1 to 162
    for code, entry in catalog.items():
        assert entry.code == code and entry.name and entry.description
        assert entry.source.startswith("https://docs.nvidia.com/deploy/xid-errors/")
        assert isinstance(entry.resolution, xc.XidResolution) and entry.resolution != xc.XidResolution.UNKNOWN
    assert {c for c, e in catalog.items() if e.resolution == xc.XidResolution.RESET_GPU} >= {64, 95, 109, 119, 120, 140}
    assert xid_resolution(79) == xc.XidResolution.RESTART_BM and xid_severity(79) == "critical"
    assert xid_resolution(13) == xc.XidResolution.RESTART_APP and xid_entry(13).blame == xc.XidBlame.APPLICATION
    assert xid_entry(94).blame == xc.XidBlame.HARDWARE and xid_severity(94) == "error"
    assert xid_resolution(43) == xc.XidResolution.IGNORE and xid_severity(43) == "info"
    assert xid_meaning(119) == "GSP RPC Timeout"


def test_an_unlisted_code_is_a_warning_with_an_unknown_resolution() -> None:
    assert xid_meaning(999) == "unlisted XID" and xid_severity(999) == "warning"
    assert xid_resolution(999) == xc.XidResolution.UNKNOWN
    assert p.Event(kind=p.Text("xid"), code=999).resolution == "UNKNOWN"


def test_the_catalogue_is_package_data_of_the_wheel() -> None:
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "data/*.json" in data["gridwatch.wire"]  # so an installed wheel has the file xid_catalog() reads
    assert json.loads((ROOT / "gridwatch" / "wire" / "data" / "xid_catalog.json").read_text())["entries"]


def test_an_xid_from_the_kernel_log_carries_its_resolution_over_the_wire() -> None:
    event = next(e for e in (d(XID119, "log:/dev/kmsg", 1.0) for d in DETECTORS) if e is not None)
    assert event.kind == "xid" and event.code == 119, XID119_SOURCE
    decoded = p.decode_agent_frame(p.encode(event))
    assert isinstance(decoded, p.Event) and decoded.resolution == "RESET_GPU"


def test_an_event_from_an_older_agent_gets_the_catalogue_resolution_on_decode() -> None:
    old = p.decode_agent_frame(b'{"type":"event","kind":"xid","code":48,"gpu":1}')
    assert isinstance(old, p.Event) and old.resolution == "WORKFLOW_XID_48"
    newer = p.decode_agent_frame(b'{"type":"event","kind":"xid","code":48,"resolution":"SOMETHING_NEW"}')
    assert isinstance(newer, p.Event) and newer.resolution == "SOMETHING_NEW"  # shown, never refused


def test_nvml_xid_events_carry_the_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    state = fake_pynvml.install(monkeypatch, 2)
    source, notes = open_gpu_source(0, 0)
    assert isinstance(source, NvmlSource), notes
    state.queue_xid(1, 120)
    state.queue_xid(0, 13)
    events = source.poll_events()
    assert [(e.code, e.gpu, e.resolution) for e in events] == [(120, 1, "RESET_GPU"), (13, 0, "RESTART_APP")]
    source.close()


def test_simulated_xid_events_carry_the_resolution() -> None:
    gpus = SimulatedGpus(2, seed=3)
    gpus.inject("xid", gpu=1, code=119)
    (event,) = gpus.poll_events()
    assert (event.kind, event.code, event.resolution, event.severity) == ("xid", 119, "RESET_GPU", "critical")


@pytest.mark.parametrize(("code", "playbook"), [(13, "xid-application"), (31, "xid-application"),
                                                (94, "xid-contained-ecc"), (48, "xid-hardware"), (79, "xid-hardware"),
                                                (74, "xid-hardware"), (119, "xid-reset-gpu"), (120, "xid-reset-gpu"),
                                                (95, "xid-reset-gpu"), (43, None), (63, None)])
def test_shipped_playbooks_select_by_resolution(code: int, playbook: str | None) -> None:
    clock = ManualClock(1000.0)
    engine = Engine(load_builtin(), clock)
    for name in ("node1", "node2", "node3", "node4"):
        engine.observe(name, p.Hello(node=p.Text(name), interval=5.0))
    plans = engine.observe("node2", p.Event(node=p.Text("node2"), kind=p.Text("xid"), code=code, gpu=0))
    assert [pl.incident.playbook for pl in plans] == ([playbook] if playbook else [])


def test_a_match_on_resolution_is_checked_against_the_names() -> None:
    from gridwatch.playbooks.schema import check_text

    _, errors = check_text("name: x\ntrigger: {event: xid, match: {resolution: [RESET]}}\nplan: [notify]\n", "x.yaml")
    assert [e.message for e in errors] == [
        "an XID resolution must be one of " + ", ".join(r.value for r in xc.XidResolution)
        + "; got 'RESET' (did you mean 'RESET_GPU'?)"]
    _, errors = check_text("name: x\ntrigger: {event: xid}\nplan: [reset_gpu]\n", "x.yaml")
    assert [e.message for e in errors] == ["reset_gpu acts on the incident's GPU; it needs scope: gpu"]
