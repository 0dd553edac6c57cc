"""Detectors: the log lines an operator must hear about become events, the rest do not."""

from __future__ import annotations

import pytest

from gridwatch.agent.detectors import detect


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


@pytest.mark.parametrize(
    ("line", "kind", "details"),
    [
        # Written by us: an NCCL error that also prints the work's timeout is an error, not a timeout.
        (
            "[Rank 2] NCCL watchdog thread terminated with exception: NCCL error: unhandled system error, "
            "ncclSystemError: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, Timeout(ms)=600000)",
            "nccl_error",
            {"rank": "2", "error": "ncclSystemError"},
        ),
        (
            "[rank4]:[E1016 03:31:38.929234295 ProcessGroupNCCL.cpp:1709] [PG 3 Rank 4] Timeout at NCCL work: 9141, "
            "last enqueued NCCL work: 9141, last completed NCCL work: 9140.",
            "nccl_timeout",
            {"rank": "4"},
        ),
        ("RuntimeError: cuda runtime error (39) : uncorrectable ECC error encountered at x.cpp:265", "ecc_dbe", {"cuda_code": "39"}),
        ("RuntimeError: CUDA error: device-side assert triggered", "cuda_error", {"error": "cudaErrorAssert"}),
        ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "oom", {"error": "CUBLAS_STATUS_ALLOC_FAILED"}),
        (
            "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: 3 (pid: 407727) of binary: /x/python",
            "worker_failed",
            {"exitcode": "-9", "signal": "SIGKILL", "local_rank": "3", "pid": "407727"},
        ),
        ("╭──────── Traceback (most recent call last) ────────╮", "traceback", {}),
        ("{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 0.0002, 'epoch': 0.0}", "nan_loss", {"metric": "grad_norm", "value": "nan"}),
        ("train/loss: nan", "nan_loss", {"metric": "train/loss"}),  # written by us: a prefixed key
        ("Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.", "nan_loss", {"metric": "loss_scale"}),
    ],
)
def test_training_software_lines_carry_what_the_operator_needs(line: str, kind: str, details: dict[str, str]) -> None:
    event = detect(line, "/var/log/trainer.log", 1.0)
    assert event is not None and event.kind == kind, line
    assert {k: event.details.get(k) for k in details} == details


@pytest.mark.parametrize(
    "line",
    [
        # NCCL's own connect retry and a c10d store timeout at start-up are not collective timeouts.
        "[03/16][2025-02-25 15:46:48,390] [misc/socket.cc:551] [s11gn1268:pid=3987720] NCCL INFO socketPollConnect: "
        "connect returned Connection timed out, retrying (1/34) after sleep for 100 msec",
        "[E socket.cpp:793] [c10d] The client socket has timed out after 1800s while trying to connect to (127.0.0.1, 48391).",
        "[rank0]:[E ProcessGroupNCCL.cpp:537] Some NCCL operations have failed or timed out. Due to the asynchronous nature "
        "of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.",
        "step 3 loss: 0.5 (nan-safe)",
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768",
        "Loss scale: 65536.0",
    ],
)
def test_lines_that_look_alarming_but_are_not_stay_quiet(line: str) -> None:
    assert detect(line) is None
