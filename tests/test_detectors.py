"""Detectors: the log lines an operator must hear about become events, the rest do not."""

from __future__ import annotations

import pytest

from agents.detectors import detect


def test_xid_line_becomes_an_event_with_code_and_pci_id() -> None:
    line = "[ 1234.567] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."
    event = detect(line, "/dev/kmsg", 12.5)
    assert event is not None
    assert (event.kind, event.code, event.severity) == ("xid", 79, "critical")
    assert event.details["pci_bus_id"] == "0000:3b:00.0"
    assert event.details["pid"] == "4242"
    assert event.source == "log:/dev/kmsg" and event.ts == 12.5
    assert "fallen off the bus" in event.message


def test_application_xid_is_only_a_warning() -> None:
    event = detect("NVRM: Xid (PCI:0000:18:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception")
    assert event is not None and (event.code, event.severity) == (13, "warning")


@pytest.mark.parametrize(
    ("line", "kind", "severity"),
    [
        (
            "[rank3]:[E ProcessGroupNCCL.cpp:607] [Rank 3] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=1, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600021 milliseconds",
            "nccl_timeout",
            "error",
        ),
        ("node07:1234:1290 [0] NCCL WARN NET/IB : Got completion with error 12", "nccl_error", "warning"),
        ("torch.distributed.DistBackendError: NCCL error in: ../ProcessGroupNCCL.cpp:1970, ncclInternalError", "nccl_error", "error"),
        ("Traceback (most recent call last):", "traceback", "error"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom", "error"),
        ("step 1200 | loss: nan | lr 3e-4", "nan_loss", "error"),
        ("step=1201 loss=inf grad_norm=12.0", "nan_loss", "error"),
        ("{'loss': NaN, 'step': 7}", "nan_loss", "error"),
        ("NVRM: GPU at PCI:0000:9a:00: GPU-1234 has fallen off the bus.", "fell_off_bus", "critical"),
    ],
)
def test_each_detector(line: str, kind: str, severity: str) -> None:
    event = detect(line, "/var/log/trainer.log", 1.0)
    assert event is not None, line
    assert (event.kind, event.severity) == (kind, severity)


def test_rank_is_picked_up_when_the_line_names_it() -> None:
    event = detect("[rank3]:[E ProcessGroupNCCL.cpp:607] [Rank 3] Watchdog caught collective operation timeout")
    assert event is not None and event.details["rank"] == "3"


@pytest.mark.parametrize(
    "line",
    [
        "step 1200 | loss: 2.3141 | lr 3e-4",
        "INFO: loss went down nicely, information follows",
        "NCCL INFO Bootstrap : Using eth0:10.0.0.7<0>",
        "an ordinary line about nothing",
        "",
    ],
)
def test_ordinary_lines_are_not_events(line: str) -> None:
    assert detect(line) is None
