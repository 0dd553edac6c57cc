"""Detectors for what training software writes: NCCL, CUDA errors, out of memory, worker failures, tracebacks, NaN.

The kinds, and what each tells the operator:

- ``ecc_dbe`` (critical): CUDA reports an uncorrectable ECC error
  (``cudaErrorECCUncorrectable``, ``cuda runtime error (39)``,
  ``CUDA_ERROR_ECC_UNCORRECTABLE``). It is the GPU's memory that failed, not the
  program, so it is the same kind NVML reports for a double-bit error and the
  shipped ``gpu-hardware-event`` playbook takes the node out; ``details["error"]``
  says it came from CUDA.
- ``cuda_error`` (error): the program's CUDA context is dead (illegal memory
  access, unspecified launch failure, device-side assert, ...); usually a bug
  in a kernel or its inputs, as XID 13/31/43 are. ``details["error"]`` is the
  CUDA runtime's name for it.
- ``oom`` (error): CUDA or cuBLAS could not allocate (``CUBLAS_STATUS_ALLOC_FAILED``
  is cuBLAS running out of device memory for its workspace).
- ``nccl_timeout`` (error): a collective did not finish within the process
  group's timeout. Only PyTorch's watchdog says this; NCCL's own connect retries
  at start-up ("Connection timed out, retrying") and c10d's TCP store connect
  timeouts are not collectives and stay quiet (a start-up that finally fails is
  reported by the launcher as ``worker_failed``).
- ``nccl_error`` (warning for a ``NCCL WARN``, else error): NCCL or the watchdog
  reports a failed call. A line naming an NCCL error is an error even when it
  also prints the work's ``Timeout(ms)=``; the watchdog's "Exception (either an
  error or timeout)" line does not claim a timeout, so it is an error too.
- ``worker_failed`` (error): torchelastic saw a worker die (``failed (exitcode: -9)
  local_rank: 3``) or gave up (``ChildFailedError``), with the exit code, the
  signal behind a negative one, and the local rank.
- ``traceback`` (error): a Python traceback starts, plain or drawn by rich.
- ``nan_loss`` (error): a loss or gradient norm is NaN or infinite, as trainers
  print it (Megatron, Hugging Face, detectron2, DeepSpeed's loss scaler giving up).
"""

from __future__ import annotations

import re
import signal

from gridwatch.agent.detectors.common import Detector, make_event, rank_of
from gridwatch.wire.protocol import Event

# The words any line of this module's kinds contains; a line without them costs one search.
# Every branch starts with a literal character (no character classes, no \b, no
# (?i)): then the regex engine skips ahead by the set of first characters instead
# of trying every branch at every position, which is most of a log line's cost.
PREFILTER = (
    r"NCCL WARN|NCCL error|nccl[A-Z]\w*Error|Watchdog|watchdog|collective operation timeout|Timeout at NCCL work"
    r"|Traceback \(most|out of memory|OutOfMemoryError|_ALLOC_FAILED|ECC|illegal memory|illegal instruction"
    r"|launch failure|device-side assert|misaligned address|Assertion `|exitcode|ChildFailedError"
    r"|nan\b|NaN\b|Nan\b|NAN\b|inf\b|Inf\b|INF\b|infinity\b|Infinity\b|became infinite|scale already at minimum"
)

# ---------------------------------------------------------------- CUDA

# CUDA's uncorrectable ECC error in every spelling a program prints it.
_CUDA_ECC = re.compile(r"uncorrectable ECC error encountered|CUDA_ERROR_ECC_UNCORRECTABLE|cudaErrorECCUncorrectable")

# The CUDA runtime's message for each sticky error -> its name and what it means.
_CUDA_ERRORS: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"an illegal memory access was encountered|cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS"),
     "cudaErrorIllegalAddress", "a kernel touched memory it does not own; the process's CUDA context is lost"),
    (re.compile(r"unspecified launch failure|cudaErrorLaunchFailure|CUDA_ERROR_LAUNCH_FAILED"),
     "cudaErrorLaunchFailure", "a kernel crashed on the GPU; the process's CUDA context is lost"),
    (re.compile(r"device-side assert(?:ion)? triggered|cudaErrorAssert|\.cu:\d+: [^:]+: block: \[[\d,]+\], thread: \[[\d,]+\] Assertion `"),
     "cudaErrorAssert", "a kernel's own check failed (often an index out of range in the inputs)"),
    (re.compile(r"an illegal instruction was encountered|cudaErrorIllegalInstruction"),
     "cudaErrorIllegalInstruction", "a kernel executed an illegal instruction; the process's CUDA context is lost"),
    (re.compile(r"CUDA error: misaligned address|cudaErrorMisalignedAddress"),
     "cudaErrorMisalignedAddress", "a kernel made a misaligned memory access; the process's CUDA context is lost"),
    (re.compile(r"the launch timed out and was terminated|cudaErrorLaunchTimeout"),
     "cudaErrorLaunchTimeout", "a kernel ran past the device's watchdog and was killed"),
)
# The CUDA runtime's numeric code where the line prints one: "(39)", "(0 vs. 39)", "code #214", "error=4".
_CUDA_CODE = re.compile(r"runtime error \((\d+)\)|\(0 vs\. (\d+)\)|code #(\d+)|error=(\d+) :")


def _cuda_code(line: str) -> str:
    match = _CUDA_CODE.search(line)
    return next((g for g in match.groups() if g), "") if match else ""


def _cuda_ecc(line: str, source: str, ts: float) -> Event | None:
    if _CUDA_ECC.search(line) is None:
        return None
    return make_event(
        "ecc_dbe", "critical", line, source, ts,
        error="cudaErrorECCUncorrectable", cuda_code=_cuda_code(line), rank=rank_of(line),
        meaning="the GPU's memory has an uncorrectable error; the GPU cannot be trusted until it is reset or replaced",
    )


def _cuda_error(line: str, source: str, ts: float) -> Event | None:
    for pattern, name, meaning in _CUDA_ERRORS:
        if pattern.search(line):
            return make_event(
                "cuda_error", "error", line, source, ts,
                error=name, cuda_code=_cuda_code(line), rank=rank_of(line), meaning=meaning,
            )
    return None


# ---------------------------------------------------------------- out of memory

_OOM = re.compile(
    r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|(CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED)"
)
_OOM_TRIED = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")
_OOM_DEVICE = re.compile(r"\(GPU (\d+);|GPU (\d+) has a total capac")


def _oom(line: str, source: str, ts: float) -> Event | None:
    match = _OOM.search(line)
    if match is None:
        return None
    tried = _OOM_TRIED.search(line)
    device = _OOM_DEVICE.search(line)
    return make_event(
        "oom", "error", line, source, ts,
        rank=rank_of(line),
        error=match.group(1) or "",
        tried=tried.group(1) if tried else "",
        # The CUDA ordinal as the process sees it (after CUDA_VISIBLE_DEVICES), not the node's GPU index.
        cuda_device=next((g for g in device.groups() if g), "") if device else "",
    )


# ---------------------------------------------------------------- NCCL

# Only PyTorch's watchdog reports a collective that ran past its timeout.
_NCCL_TIMEOUT = re.compile(r"[Cc]aught collective operation timeout|Timeout at NCCL work: \d+")
_NCCL_WORK = re.compile(r"SeqNum=(\d+), OpType=(\w+)")
_NCCL_TIMEOUT_MS = re.compile(r"Timeout\(ms\)=(\d+)\) ran for (\d+) milliseconds")
_NCCL_ERROR = re.compile(
    r"NCCL WARN|NCCL error|nccl(?:Internal|System|UnhandledCuda|Remote|InvalidUsage|InvalidArgument)Error"
    r"|Exception \(either an error or timeout\) detected by watchdog"
)
_NCCL_ERROR_NAME = re.compile(r"(nccl[A-Z][a-zA-Z]*Error)")


def _nccl_timeout(line: str, source: str, ts: float) -> Event | None:
    if _NCCL_TIMEOUT.search(line) is None or _NCCL_ERROR_NAME.search(line):
        return None
    work = _NCCL_WORK.search(line)
    times = _NCCL_TIMEOUT_MS.search(line)
    return make_event(
        "nccl_timeout", "error", line, source, ts,
        rank=rank_of(line),
        seq=work.group(1) if work else "",
        op=work.group(2) if work else "",
        timeout_ms=times.group(1) if times else "",
        ran_ms=times.group(2) if times else "",
    )


def _nccl_error(line: str, source: str, ts: float) -> Event | None:
    match = _NCCL_ERROR.search(line)
    if match is None:
        return None
    # A WARN is NCCL saying something went wrong and it may recover; the
    # named error results mean a collective has already failed.
    severity = "warning" if match.group(0) == "NCCL WARN" else "error"
    name = _NCCL_ERROR_NAME.search(line)
    return make_event("nccl_error", severity, line, source, ts, rank=rank_of(line), error=name.group(1) if name else "")


# ---------------------------------------------------------------- torchelastic

_WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_CHILD_FAILED = re.compile(r"errors\.ChildFailedError:|^ChildFailedError:")

# What an exit by signal usually means for a training worker.
_SIGNAL_MEANING = {
    "SIGKILL": "killed (the kernel's OOM killer, the scheduler, or an operator)",
    "SIGABRT": "aborted (an uncaught C++ error, e.g. the NCCL watchdog taking the process down)",
    "SIGSEGV": "crashed (segmentation fault)",
    "SIGBUS": "crashed (bus error; often /dev/shm too small)",
    "SIGTERM": "told to stop (torchrun or the scheduler)",
}


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name if code < 0 else ""
    except ValueError:
        return ""


def _worker_failed(line: str, source: str, ts: float) -> Event | None:
    match = _WORKER_FAILED.search(line)
    if match is not None:
        code = int(match.group(1))
        sig = _signal_name(code)
        meaning = _SIGNAL_MEANING.get(sig, f"died by {sig}" if sig else "exited with an error (see its traceback)")
        return make_event(
            "worker_failed", "error", line, source, ts,
            exitcode=match.group(1), signal=sig, local_rank=match.group(2), pid=match.group(3),
            meaning=f"a training worker {meaning}",
        )
    if _CHILD_FAILED.search(line) is not None:
        return make_event(
            "worker_failed", "error", line, source, ts,
            meaning="torchrun stopped the job on this node: a worker failed and no restart is left",
        )
    return None


# ---------------------------------------------------------------- tracebacks

# Plain ("Traceback (most recent call last):") and rich's box ("╭── Traceback (most recent call last) ──╮").
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)(?::|\s*─)")


def _traceback(line: str, source: str, ts: float) -> Event | None:
    if _TRACEBACK.search(line) is None:
        return None
    return make_event("traceback", "error", line, source, ts, rank=rank_of(line))


# ---------------------------------------------------------------- non-finite values

# A non-finite value as a whole word (``nan-safe`` or ``infinite`` are not values) ...
_NONFINITE = re.compile(r"(?<![\w.-])[+-]?(?:[Nn]a[Nn]|NAN|[Ii]nf(?:inity)?|INF)(?![\w-])")
# ... printed after a loss or gradient-norm key (``loss``, ``lm loss``, ``train/loss``,
# ``loss_cls``, ``'grad_norm'``, ``grad norm``) and a separator, bare or as a scalar tensor.
# Anchored at the value and searched in the few characters before it, so a long
# line costs one scan for the value, not a backtracking search for the key.
_KEY_BEFORE = re.compile(r"(?:\blm )?(?:loss|grad[ _]norm)[\w./-]*['\"]?\s*(?:[:=]|\bis)\s*['\"]?(?:tensor\(\s*)?$", re.I)
_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./-")
_KEY_WINDOW = 100
_KEY_END = re.compile(r"['\"]?\s*(?:[:=]|\bis\b)", re.I)
# A scalar tensor printed bare: ``tensor(nan, device='cuda:0')``.
_NAN_TENSOR = re.compile(r"tensor\(\s*[+-]?(?:nan|inf),[^)]*device=")
_NAN_RAISED = re.compile(r"Loss became infinite or NaN")
_LOSS_SCALE_MIN = re.compile(r"loss scale already at minimum", re.I)


def _nonfinite_key(line: str) -> tuple[str, str] | None:
    """(key, value) of the first non-finite value a loss or grad-norm key names."""
    for value in _NONFINITE.finditer(line):
        window = line[max(0, value.start() - _KEY_WINDOW) : value.start()]
        key = _KEY_BEFORE.search(window)
        if key is None:
            continue
        # The key runs back from "loss"/"grad" over name characters ("train/loss", "val_loss").
        start = key.start()
        while start > 0 and window[start - 1] in _KEY_CHARS:
            start -= 1
        name = _KEY_END.split(window[start:], maxsplit=1)[0]
        return name.strip("-_./"), value.group(0).lower()
    return None


def _nan_loss(line: str, source: str, ts: float) -> Event | None:
    found = _nonfinite_key(line)
    if found is not None:
        metric, value = found
    elif (tensor := _NAN_TENSOR.search(line)) is not None:
        metric, value = "tensor", tensor.group(0)[len("tensor(") :].split(",")[0].strip().lower()
    elif _NAN_RAISED.search(line) is not None:
        metric, value = "loss", "nan or inf"
    elif _LOSS_SCALE_MIN.search(line) is not None:
        # fp16 gradients overflowed at every loss scale down to the minimum: the run stops.
        metric, value = "loss_scale", "overflow"
    else:
        return None
    return make_event("nan_loss", "error", line, source, ts, value=value, metric=metric, rank=rank_of(line))


# Order matters: the root cause first. A dead GPU's ECC error printed through an
# NCCL or CUDA message is the hardware's fault; a CUDA error the NCCL watchdog
# reports is the CUDA error; an OOM raised inside NCCL is the OOM.
DETECTORS: tuple[Detector, ...] = (
    _cuda_ecc, _cuda_error, _oom, _nccl_timeout, _nccl_error, _worker_failed, _traceback, _nan_loss,
)
