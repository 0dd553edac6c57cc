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


# ---------------------------------------------------------------- reports that span lines

# A C++ abort from NVIDIA/Megatron-LM#935 and instructlab/training#520: the terminate line opens it,
# the what() line that follows says why, and the two are one event of the kind the reason names.
TERMINATE = "terminate called after throwing an instance of 'c10::DistBackendError'"
WHAT = (
    "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 3] Process group watchdog thread terminated with exception: "
    "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=1, "
    "NumelOut=1, Timeout(ms)=1) ran for 90 milliseconds before timing out."
)


def _events(lines: list[str], source: str) -> list[tuple[str, dict[str, str]]]:
    out = []
    for line in lines:
        event = detect(line, source, 1.0)
        if event is not None:
            out.append((str(event.kind), {str(k): str(v) for k, v in event.details.items()}))
    return out


def test_an_abort_and_its_what_are_one_event_of_the_kind_the_reason_names() -> None:
    events = _events([TERMINATE, WHAT], "/var/log/abort-1.log")
    assert [kind for kind, _ in events] == ["nccl_timeout"]
    assert events[0][1]["exception"] == "c10::DistBackendError" and events[0][1]["rank"] == "3"


def test_an_abort_whose_reason_names_no_kind_is_a_process_crash() -> None:
    # Written by us: std::bad_alloc's what() names no kind of ours.
    events = _events(["terminate called after throwing an instance of 'std::bad_alloc'", "  what():  std::bad_alloc"], "/var/log/abort-2.log")
    assert events == [("process_crash", {"reason": "abort", "exception": "std::bad_alloc",
                                         "meaning": "the process aborted on an uncaught C++ exception (std::bad_alloc)"})]


def test_an_abort_is_read_per_log() -> None:
    # The terminate line of one log does not claim the what() line of another.
    assert _events([TERMINATE], "/var/log/abort-3.log") == []
    other = _events(["  what():  std::bad_alloc"], "/var/log/abort-4.log")
    assert other == []
    assert [kind for kind, _ in _events([WHAT], "/var/log/abort-3.log")] == ["nccl_timeout"]


def test_terminate_without_an_active_exception_is_its_own_event() -> None:
    # From Amanbhandula/AlphaPose#12: no what() follows this one.
    event = detect("terminate called without an active exception", "/var/log/abort-5.log", 1.0)
    assert event is not None and (event.kind, event.details["reason"]) == ("process_crash", "abort")


# torchelastic's ChildFailedError table from lzhxmu/CPPO#6, with another rank's failure before the root cause.
ELASTIC_TABLE = [
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "============================================================",
    "src/open_r1/grpo_gsm.py FAILED",
    "------------------------------------------------------------",
    "Failures:",
    "[1]:",
    "  time      : 2025-05-21_15:43:04",
    "  host      : other-host",
    "  rank      : 1 (local_rank: 1)",
    "  exitcode  : -15 (pid: 14751)",
    "  error_file: <N/A>",
    "  traceback : Signal 15 (SIGTERM) received by PID 14751",
    "------------------------------------------------------------",
    "Root Cause (first observed failure):",
    "[0]:",
    "  time      : 2025-05-21_15:43:03",
    "  host      : mlxlab115rp2n7682d40d9-20250521025625-6dyyd3-8nir8b-worker",
    "  rank      : 0 (local_rank: 0)",
    "  exitcode  : -9 (pid: 14750)",
    "  error_file: <N/A>",
    "  traceback : Signal 9 (SIGKILL) received by PID 14750",
    "============================================================",
]


def test_torchelastic_failure_table_is_one_event_with_the_root_cause() -> None:
    # The other rank's entry (written by us: CPPO#6 had none) is not the root cause, and not an event.
    events = _events(ELASTIC_TABLE, "/var/log/elastic-1.log")
    assert len(events) == 1
    kind, details = events[0]
    assert kind == "worker_failed"
    assert {k: details[k] for k in ("rank", "local_rank", "exitcode", "signal", "pid")} == {
        "rank": "0", "local_rank": "0", "exitcode": "-9", "signal": "SIGKILL", "pid": "14750",
    }
    assert details["host"].startswith("mlxlab115")
    assert "no restart left" in details["meaning"]


def test_torchelastic_table_names_the_signal_it_prints() -> None:
    # pytorch/pytorch#175254 adds the signal's name to the exit code line.
    events = _events(
        ["Root Cause (first observed failure):", "  rank      : 5 (local_rank: 1)", "  exitcode  : -11 (pid: 5277) (SIGSEGV)",
         "  traceback : Signal 11 (SIGSEGV) received by PID 5277"],
        "/var/log/elastic-2.log",
    )
    assert [(kind, d["rank"], d["signal"]) for kind, d in events] == [("worker_failed", "5", "SIGSEGV")]


def test_table_fields_outside_a_table_are_quiet() -> None:
    for line in ELASTIC_TABLE[6:12] + ["  traceback : Signal 9 (SIGKILL) received by PID 14750"]:
        assert detect(line, "/var/log/elastic-3.log", 1.0) is None, line


@pytest.mark.parametrize(
    ("line", "kind", "details"),
    [
        # ComputationalRadiationPhysics/picongpu#198
        ("srun: error: taurusi2031: tasks 10-11: Exited with exit code 1", "worker_failed",
         {"host": "taurusi2031", "task": "10-11", "exitcode": "1"}),
        # leptonai/gpud's NCCL fixture: a segfault inside NCCL, as the kernel logs it.
        ("[Thu Oct 10 03:06:53 2024] pt_main_thread[2536443]: segfault at 7f797fe00000 ip 00007f7c7ac69996 "
         "sp 00007f7c12fd7c30 error 4 in libnccl.so.2[7f7c7ac00000+d3d3000]", "process_crash",
         {"library": "libnccl.so.2", "process": "pt_main_thread", "reason": "segfault"}),
        # tatsu-lab/stanford_alpaca#207: the IB completion error on its own line, after "Last error:".
        ("NET/IB : Got completion from peer 11.214.147.122<39138> with error 12, opcode 0, len 0, vendor err 129", "nccl_error",
         {"ib_status": "12", "peer": "11.214.147.122<39138>"}),
        # NVIDIA/nccl-tests#219
        ("fengyun: Test NCCL failure common.cu:959 'internal error - please report this issue to the NCCL developers / '",
         "nccl_error", {"error": "internal error - please report this issue to the NCCL developers / "}),
        # tensorflow/tensorflow#14231
        ("2017-11-03 11:34:30.628747: E C:\\tf_jenkins\\home\\workspace\\rel-win\\M\\windows-gpu\\PY\\35\\tensorflow\\stream_executor"
         "\\cuda\\cuda_driver.cc:924] failed to allocate 1.97G (2120187392 bytes) from device: CUDA_ERROR_OUT_OF_MEMORY",
         "oom", {"error": "CUDA_ERROR_OUT_OF_MEMORY", "tried": "1.97G"}),
        # MIC-DKFZ/nnUNet#2213
        ("numpy.core._exceptions._ArrayMemoryError: Unable to allocate 1.61 GiB for an array with shape (753, 536, 536) and data type float64",
         "oom", {"error": "MemoryError", "memory": "host", "tried": "1.61 GiB"}),
        # ShannonAI/Self_Explaining_Structures_Improve_NLP_Models#6: PyTorch's OOM message's tail on its own line.
        ("Tried to allocate 20.00 MiB (GPU 0; 1.96 GiB total capacity; 1.24 GiB already allocated; 2.88 MiB free; "
         "1.25 GiB reserved in total by PyTorch)", "oom", {"tried": "20.00 MiB", "cuda_device": "0"}),
    ],
)
def test_second_round_signals_carry_what_the_operator_needs(line: str, kind: str, details: dict[str, str]) -> None:
    event = detect(line, "/var/log/trainer.log", 1.0)
    assert event is not None and event.kind == kind, line
    assert {k: event.details.get(k) for k in details} == details


@pytest.mark.parametrize(
    "line",
    [
        # The launcher stopping the other workers after a failure: context, not failures.
        "srun: error: c002: task 0: Killed",
        "srun: error: nid01934: tasks 2,4-5,7: Terminated",
        "WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 59461 closing signal SIGTERM",
        # The ChildFailedError line opens torchelastic's table; the table's root cause is the event.
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        # nccl-tests' follow-up to its failure line.
        " .. fengyun pid 3164639: Test failure common.cu:844",
        # Written by us: a quoted source line of a traceback is not the exception.
        "    except MemoryError:",
    ],
)
def test_second_round_context_lines_stay_quiet(line: str) -> None:
    assert detect(line, "/var/log/quiet.log") is None


def test_a_family_prefilter_grouped_by_first_character_matches_the_same_lines() -> None:
    import re
    from pathlib import Path

    from gridwatch.agent.detectors import kernel, trainer
    from gridwatch.agent.detectors.common import by_first_character

    flat = r"NCCL WARN|NVRM|n(?:an)?\b|\] \[ERROR\]|[Ll]ink|a?b|N"
    assert by_first_character(flat) == r"N(?:CCL WARN|VRM|)|n(?:an)?\b|\] \[ERROR\]|[Ll]ink|a?b"
    lines = [line for path in (Path(__file__).parent / "data" / "logcorpus").glob("*.jsonl") for line in path.read_text().splitlines()]
    lines += ["Link down", "an ordinary line", "ab", "b", "] [ERROR] x"]
    grouped = re.compile(by_first_character(flat))
    assert [bool(grouped.search(line)) for line in lines] == [bool(re.search(flat, line)) for line in lines]
    for family in (kernel, trainer):
        assert re.compile(family.PREFILTER)  # still a valid pattern after grouping
