"""Kernel, driver and host detectors on real lines: each fault line is its kind with its fields, the rest stay quiet."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from gridwatch.agent.detectors import detect, kernel
from gridwatch.wire.protocol import EVENT_KINDS

CORPUS = Path(__file__).parent / "data" / "logcorpus"


def _rows(name: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in (CORPUS / name).read_text().splitlines() if line.strip()]


FAULTS = _rows("kernel.jsonl")
QUIET = _rows("kernel_quiet.jsonl")


def test_the_corpus_is_real_and_big_enough() -> None:
    assert len(FAULTS) >= 150 and len(QUIET) >= 100
    assert all(row["source"] for row in FAULTS + QUIET)
    assert {row["kind"] for row in FAULTS} <= EVENT_KINDS


def test_recall_per_kind_and_fields() -> None:
    found: Counter[str] = Counter()
    total: Counter[str] = Counter()
    wrong: list[str] = []
    for row in FAULTS:
        kind = str(row["kind"])
        total[kind] += 1
        event = detect(str(row["line"]), "/dev/kmsg", 1.0)
        if event is None or event.kind != kind:
            wrong.append(f"{kind}: {event.kind if event else None}: {row['line']}")
            continue
        fields = row["fields"]
        assert isinstance(fields, dict)
        for key, want in fields.items():
            got = getattr(event, key) if key in ("code", "gpu") else event.details.get(key)
            if got != want:
                wrong.append(f"{kind} {key}={got!r}, want {want!r}: {row['line']}")
                break
        else:
            found[kind] += 1
    low = {k: f"{found[k]}/{n}" for k, n in total.items() if found[k] / n < 0.97}
    assert not low, (low, wrong)


def test_precision_quiet_lines_stay_quiet() -> None:
    noisy = [(e.kind, row["line"]) for row in QUIET if (e := detect(str(row["line"]), "/dev/kmsg", 1.0)) is not None]
    assert len(noisy) <= len(QUIET) // 100, noisy


@pytest.mark.parametrize(
    ("line", "kind", "severity", "details"),
    [
        # NVIDIA's A100 memory error management guide: the MIG form names the GPU instance.
        (
            "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No",
            "xid", "error", {"pci_bus_id": "0000:01:00.0", "gpu_instance": "5"},
        ),
        (
            "[   41.670135] pcieport 0000:00:1c.1: AER: Multiple Corrected error received: 0000:00:1c.1",
            "pcie_aer", "info", {"pci_bus_id": "0000:00:1c.1"},
        ),
        (
            "Sep 22 09:59:09 pve kernel: pcieport 0000:80:1b.4: AER: Uncorrectable (Non-Fatal) error message received from 0000:80:1b.4",
            "pcie_aer", "error", {"pci_bus_id": "0000:80:1b.4"},
        ),
        (
            "[Mon Jan 27 19:27:15 2020] EDAC MC0: 1 CE memory read error on CPU_SrcID#0_Ha#0_Chan#2_DIMM#0 (channel:2 slot:0)",
            "edac_memory", "warning", {"location": "CPU_SrcID#0_Ha#0_Chan#2_DIMM#0"},
        ),
        (
            "[131453.740743] nvidia-nvswitch0: SXid (PCI:0000:00:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
            "nvswitch_sxid", "critical", {"port": "30", "nvswitch": "nvidia-nvswitch0"},
        ),
        ("NVRM: GPU 0000:29:00.0: GPU has fallen off the bus.", "fell_off_bus", "critical", {"pci_bus_id": "0000:29:00.0"}),
    ],
)
def test_severity_and_fields_an_operator_acts_on(line: str, kind: str, severity: str, details: dict[str, str]) -> None:
    event = detect(line, "/dev/kmsg", 1.0)
    assert event is not None and (event.kind, event.severity) == (kind, severity)
    for key, value in details.items():
        assert event.details[key] == value
    if kind != "xid":  # an XID's resolution comes from the XID catalogue
        assert event.details["action"]  # what to do, in the operator's words


def test_no_detector_raises_on_random_bytes_or_cut_lines() -> None:
    rng = random.Random(13)
    for _ in range(3000):
        detect(bytes(rng.randrange(256) for _ in range(rng.randrange(200))).decode("utf-8", "replace"))
    # Every cut of every line through this family's path: its prefilter, then each of its detectors.
    prefilter = re.compile(kernel.PREFILTER)
    # Fault lines are cut at every position; the (longer, more numerous) quiet lines at every fifth.
    for rows, step in ((FAULTS, 1), (QUIET, 5)):
        for row in rows:
            line = str(row["line"])
            for cut in range(0, len(line) + 1, step):
                for part in (line[:cut], line[cut:]):
                    if prefilter.search(part):
                        for detector in kernel.DETECTORS:
                            detector(part, "", 0.0)


@pytest.mark.parametrize(
    ("line", "kind", "severity", "details"),
    [
        # leptonai/gpud#1271
        ("Jul 09 10:42:47 pool0-0082 kernel: NVRM: knvlinkDiscoverPostRxDetLinks_GH100: Getting peer0's postRxDetLinkMask failed!",
         "nvlink_error", "critical", {"peer": "0", "function": "knvlinkDiscoverPostRxDetLinks_GH100"}),
        # NVIDIA/open-gpu-kernel-modules#1230
        ("[   84.300480] NVRM: GPU6 kgmmuCheckMemSubsysError_IMPL: Memory Subsystem Error detected. kbusSendSysmembarSingle failed.",
         "gsp_error", "critical", {"driver_gpu": "6", "reason": "the GPU's memory subsystem stopped responding"}),
        # NVIDIA/open-gpu-kernel-modules#1045
        ("[Mon May  4 14:09:23 2026] NVRM: GPU3 _kgspRpcGspEventPmuHalted: Received signal from GSP that PMU has halted.",
         "gsp_error", "critical", {"reason": "the GPU's power management unit (PMU) halted"}),
        # NVIDIA/nvidia-docker#1553
        ("Unable to determine the device handle for GPU 0000:09:00.0: Unknown Error", "fell_off_bus", "critical",
         {"pci_bus_id": "0000:09:00.0", "error": "Unknown Error"}),
        # yangxiaohua2009/custom-kernel#6 (BERT replaying the previous boot's fatal error) and kubernetes/node-problem-detector#846
        ("[    2.345575] [Hardware Error]: event severity: fatal", "machine_check", "critical", {"error_severity": "fatal"}),
        ("kernel: {3}[Hardware Error]: event severity: recoverable", "machine_check", "error", {"error_severity": "recoverable"}),
        ("kernel: {37}[Hardware Error]: event severity: corrected", "machine_check", "info", {"error_severity": "corrected"}),
        ("Sep 16 19:51:15 kernel: [    0.064261] mce: [Hardware Error]: Machine check events logged", "machine_check", "warning", {}),
        # openucx/ucx#7738 and leptonai/gpud#348
        ("b1360: [14280.445226] mlx5_core 0000:61:00.0: wait_func:1132:(pid 141181): CREATE_DCT(0x710) timeout. "
         "Will cause a leak of a command resource", "nic_error", "error", {"pci_bus_id": "0000:61:00.0"}),
        ("[Sun Dec  1 14:54:40 2024] ny2g1r12hh2 kernel: mlx5_core 0000:5c:00.0: mlx5_pcie_event:299:(pid 268269): "
         "Detected insufficient power on the PCIe slot (27W).", "nic_error", "warning", {"pci_bus_id": "0000:5c:00.0"}),
        # systemd/systemd#12236
        ("Apr 07 11:23:01 SecHackLabs systemd-networkd[9460]: bond1: Lost carrier", "nic_link_down", "error",
         {"device": "bond1", "reason": "lost carrier"}),
    ],
)
def test_second_round_kernel_signals(line: str, kind: str, severity: str, details: dict[str, str]) -> None:
    event = detect(line, "/dev/kmsg", 1.0)
    assert event is not None and (event.kind, event.severity) == (kind, severity), line
    assert {k: event.details.get(k) for k in details} == details
    assert event.details["action"]


def test_the_oom_reaper_after_its_kill_is_the_same_kill() -> None:
    # The kill and the reaper's line for the same pid are one event; a reaper line alone still reports the kill.
    kill = "Out of memory: Killed process 22222 (nginx)."
    reaped = "oom_reaper: reaped process 22222 (nginx), now anon-rss:0kB, file-rss:0kB, shmem-rss:0kB"
    assert [e.kind if (e := detect(line, "/dev/kmsg-reaper", 1.0)) else None for line in (kill, reaped)] == ["oom_killer", None]
    alone = detect("oom_reaper: reaped process 345646 (vector), now anon-rss:0kB, file-rss:0kB, shmem-rss:0", "/dev/kmsg-2", 1.0)
    assert alone is not None and (alone.kind, alone.details["pid"]) == ("oom_killer", "345646")


@pytest.mark.parametrize(
    "line",
    [
        "Sep 16 19:51:15 kernel: [    0.064261] mce: [Hardware Error]: Machine check events logged",
        "Unable to determine the device handle for GPU 0000:09:00.0: Unknown Error",
        "[Mon May  4 14:09:23 2026] NVRM: GPU3 _kgspRpcGspEventPmuHalted: Received signal from GSP that PMU has halted.",
        "Jul 09 10:42:47 pool0-0082 kernel: NVRM: knvlinkDiscoverPostRxDetLinks_GH100: Getting peer0's postRxDetLinkMask failed!",
        "mlx5_core 0000:61:00.0: wait_func:1132:(pid 141181): CREATE_DCT(0x710) timeout. Will cause a leak of a command resource",
        "Apr 07 11:23:01 SecHackLabs systemd-networkd[9460]: bond1: Lost carrier",
    ],
)
def test_an_application_log_cannot_report_the_new_hardware_kinds(line: str) -> None:
    # Printed by a job (its own nvidia-smi, a quoted dmesg), these are its words, not the node's.
    assert detect(line, "/var/log/train.log", 1.0, kernel=False) is None
    assert detect(line, "/dev/kmsg", 1.0) is not None
