"""Detectors for what training software writes: NCCL, CUDA errors, out of memory, worker failures, crashes, tracebacks, NaN.

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
  is cuBLAS running out of device memory for its workspace; TensorFlow and XLA say
  ``CUDA_ERROR_OUT_OF_MEMORY``), or Python's ``MemoryError`` (numpy's
  ``_ArrayMemoryError``) ran the process out of host memory (``details["memory"]``
  is ``host``). PyTorch's message wrapped onto a line of its own ("Tried to
  allocate 20.00 MiB (GPU 0; ...") is the same OOM.
- ``nccl_timeout`` (error): a collective did not finish within the process
  group's timeout. Only PyTorch's watchdog says this; NCCL's own connect retries
  at start-up ("Connection timed out, retrying") and c10d's TCP store connect
  timeouts are not collectives and stay quiet (a start-up that finally fails is
  reported by the launcher as ``worker_failed``).
- ``nccl_error`` (warning for a ``NCCL WARN``, else error): NCCL or the watchdog
  reports a failed call. A line naming an NCCL error is an error even when it
  also prints the work's ``Timeout(ms)=``; the watchdog's "Exception (either an
  error or timeout)" line does not claim a timeout, so it is an error too. An
  InfiniBand completion error ("NET/IB : Got completion from peer ... status=12")
  carries the peer and the verbs status; on its own line (after "Last error:")
  the collective has failed, so it is an error. nccl-tests' "Test NCCL failure
  common.cu:N '...'" is the same failure in the benchmark.
- ProcessGroupNCCL's "Some NCCL operations have failed or timed out. Due to the
  asynchronous nature of CUDA kernels..." is not an event: PyTorch prints it from
  ``WorkNCCL::handleException`` only after the watchdog's own line named the
  timeout or the error (``nccl_timeout``/``nccl_error``, with the rank, op and
  sequence number), and just before the abort that reports it again; it names
  neither the op nor the peer, so an event of its own would count every NCCL
  failure twice and add nothing.
- ``worker_failed`` (error): torchelastic saw a worker die (``failed (exitcode: -9)
  local_rank: 3``), with the exit code, the signal behind a negative one, and the
  local rank; or it gave up: the ``ChildFailedError`` table's "Root Cause (first
  observed failure)" is one event, emitted at its last field, with the global
  rank, host, exit code and signal (the ``ChildFailedError:`` line that opens the
  table, the "Failures:" of other ranks and the table's border are not events).
  Slurm's ``srun: error: <host>: task N: Exited with exit code N`` (or a crash by
  signal) is the same for a job launched by srun. torchelastic's "Sending process
  N closing signal SIGTERM" and srun's "task N: Killed" / "Terminated" are the
  launcher stopping the other workers after a failure: context, not events.
- ``process_crash`` (error): a process aborted (``terminate called ...``) or
  crashed inside NCCL, CUDA or the NIC's libraries (the kernel's "segfault at
  ... in libnccl.so.2"). A C++ abort is a two-line report: "terminate called
  after throwing an instance of 'X'" then "  what():  <message>". Its event is
  the ``what()`` line: the kind its message names when it names one (an NCCL
  timeout, a CUDA error, an OOM), with ``details["exception"]`` set to X, else
  ``process_crash``. "terminate called without an active exception" has no
  ``what()`` and is its own event.
- ``traceback`` (error): a Python traceback starts, plain or drawn by rich.
- ``nan_loss`` (error): a loss or gradient norm is NaN or infinite, as trainers
  print it (Megatron, Hugging Face, detectron2, DeepSpeed's loss scaler giving up).
"""

from __future__ import annotations

import re
import signal

from gridwatch.agent.detectors.common import Detector, by_first_character, make_event, rank_of, remember
from gridwatch.wire.protocol import Event, Text

# The words any line of this module's kinds contains; a line without them costs one search.
# Every branch starts with a literal character (no character classes, no \b, no
# (?i)): then the regex engine skips ahead by the set of first characters instead
# of trying every branch at every position, which is most of a log line's cost.
# Grouped by first character (common.by_first_character), each position costs one branch, not all.
PREFILTER = by_first_character(
    r"NCCL WARN|NCCL error|nccl[A-Z]\w*Error|Watchdog|watchdog|collective operation timeout|Timeout at NCCL work"
    r"|Traceback \(most|out of memory|OutOfMemoryError|_ALLOC_FAILED|ECC|illegal memory|illegal instruction"
    r"|launch failure|device-side assert|misaligned address|Assertion `|exitcode|ChildFailedError"
    r"|nan\b|NaN\b|Nan\b|NAN\b|inf\b|Inf\b|INF\b|infinity\b|Infinity\b|became infinite|scale already at minimum"
    r"|terminate called|what\(\):|segfault at|Root Cause \(first|host      : |rank      : |traceback : |srun: error"
    r"|NET/IB : Got completion|NCCL failure|CUDA_ERROR_OUT_OF_MEMORY|MemoryError|Tried to allocate"
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
    r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory"
    r"|(CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|CUDA_ERROR_OUT_OF_MEMORY)"
)
_OOM_TRIED = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)|failed to allocate ([\d.]+[KMGT]?) \(\d+ bytes\)")
_OOM_DEVICE = re.compile(r"\(GPU (\d+);|GPU (\d+) has a total capac")
# PyTorch's CUDA OOM message wrapped onto a line of its own: it still names the GPU and its capacity.
_OOM_TAIL = re.compile(r"^\s*(?:\[[^\]]*\]:?\s*)*Tried to allocate [\d.]+ [KMGT]?i?B(?: \(GPU \d+;|\. GPU \d+ has a total capac)")
# Python's MemoryError as the exception line of a traceback (numpy's is _ArrayMemoryError): the
# name starts the line or follows a prefix's colon, so "except MemoryError:" in a quoted source
# line is not one.
_MEMORY_ERROR = re.compile(r"(?:^|: |\]: ?)\s*(?:[A-Za-z_]\w*\.)*(_?(?:Array)?MemoryError)(?::|\s*$)")
_HOST_TRIED = re.compile(r"Unable to allocate ([\d.]+ [KMGTPE]?i?B)")


def _oom(line: str, source: str, ts: float) -> Event | None:
    match = _OOM.search(line)
    if match is not None:
        error = match.group(1) or ""
    elif "Tried to allocate" in line and _OOM_TAIL.search(line) is not None:
        error = ""
    elif "MemoryError" in line and _MEMORY_ERROR.search(line) is not None:
        tried = _HOST_TRIED.search(line)
        return make_event(
            "oom", "error", line, source, ts,
            rank=rank_of(line), error="MemoryError", memory="host", tried=tried.group(1) if tried else "",
            meaning="the process ran out of host memory (dataloader workers, a dataset held in RAM, pinned buffers)",
        )
    else:
        return None
    tried = _OOM_TRIED.search(line)
    device = _OOM_DEVICE.search(line)
    return make_event(
        "oom", "error", line, source, ts,
        rank=rank_of(line),
        error=error,
        tried=next((g for g in tried.groups() if g), "") if tried else "",
        # The CUDA ordinal as the process sees it (after CUDA_VISIBLE_DEVICES), not the node's GPU index.
        cuda_device=next((g for g in device.groups() if g), "") if device else "",
    )


# ---------------------------------------------------------------- NCCL

# Only PyTorch's watchdog reports a collective that ran past its timeout.
_NCCL_TIMEOUT = re.compile(r"[Cc]aught collective operation timeout|Timeout at NCCL work: \d+")
_NCCL_WORK = re.compile(r"SeqNum=(\d+), OpType=(\w+)")
_NCCL_TIMEOUT_MS = re.compile(r"Timeout\(ms\)=(\d+)\) ran for (\d+) milliseconds")
# Not here: ProcessGroupNCCL's "Some NCCL operations have failed or timed out" is context of the
# watchdog's line before it, which already named the timeout or error (see the module docstring).
_NCCL_ERROR = re.compile(
    r"NCCL WARN|NCCL error|nccl(?:Internal|System|UnhandledCuda|Remote|InvalidUsage|InvalidArgument)Error"
    r"|Exception \(either an error or timeout\) detected by watchdog"
    # The IB transport's completion error on its own line (PyTorch's "Last error:" is the line before).
    r"|NET/IB : Got completion from peer"
    # nccl-tests: "Test NCCL failure common.cu:959 'internal error ...'" (older: "NCCL failure all_reduce.cu:95 '...'").
    r"|NCCL failure \S+:\d+ '"
)
_NCCL_ERROR_NAME = re.compile(r"(nccl[A-Z][a-zA-Z]*Error)")
_NCCL_TEST_ERROR = re.compile(r"NCCL failure \S+:\d+ '([^']*)'")
_IB_COMPLETION = re.compile(r"NET/IB : Got completion from peer (\S+) with (?:status=|error )(\d+)")
# ibv_wc_status values NCCL prints, and what each means for the job's link.
_IB_STATUS = {
    "4": "local protection error (a memory registration problem on this node)",
    "5": "work request flushed (the queue pair had already failed)",
    "12": "transport retry count exceeded (the peer or a link between stopped answering)",
    "13": "RNR retry count exceeded (the peer stopped posting receives)",
}


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
    name = _NCCL_ERROR_NAME.search(line) or _NCCL_TEST_ERROR.search(line)
    ib = _IB_COMPLETION.search(line) if "NET/IB" in line else None
    return make_event(
        "nccl_error", severity, line, source, ts,
        rank=rank_of(line), error=name.group(1) if name else "",
        peer=ib.group(1) if ib else "", ib_status=ib.group(2) if ib else "",
        meaning=_IB_STATUS.get(ib.group(2), "") if ib else "",
    )


# ---------------------------------------------------------------- torchelastic

_WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")

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
    return None


# torchelastic's ChildFailedError message (torch 1.10 and later) is a table, one field a line:
#     Root Cause (first observed failure):
#     [0]:
#       time      : 2025-05-21_15:43:03
#       host      : node-3
#       rank      : 0 (local_rank: 0)
#       exitcode  : -9 (pid: 14750)
#       error_file: <N/A>
#       traceback : Signal 9 (SIGKILL) received by PID 14750
# The "ChildFailedError:" line above it, the "Failures:" section of other ranks before it and
# the borders are not events: the root cause is, once, at its traceback field (the last one).
_ROOT_CAUSE = "Root Cause (first observed failure)"
_ROOT_FIELD = re.compile(r"(?:^|\s)(host|rank|exitcode|traceback) +: ?(.*)$")
_ROOT_RANK = re.compile(r"(-?\d+) \(local_rank: (\d+)\)")
_ROOT_EXIT = re.compile(r"(-?\d+) \(pid: (\d+)\)(?: \((SIG[A-Z0-9]+)\))?")
_ROOT_CAUSES: dict[str, dict[str, str]] = {}  # per log, the fields of a table being read


def _root_cause(line: str, source: str, ts: float) -> Event | None:
    if _ROOT_CAUSE in line:
        remember(_ROOT_CAUSES, source, {})
        return None
    fields = _ROOT_CAUSES.get(source)
    if fields is None:
        return None
    match = _ROOT_FIELD.search(line)
    if match is None:
        return None
    fields[match.group(1)] = match.group(2).strip()
    if match.group(1) != "traceback":
        return None
    del _ROOT_CAUSES[source]
    rank = _ROOT_RANK.match(fields.get("rank", ""))
    exited = _ROOT_EXIT.match(fields.get("exitcode", ""))
    code = exited.group(1) if exited else ""
    sig = (exited.group(3) or _signal_name(int(code))) if exited else ""
    host = fields.get("host", "")
    how = _SIGNAL_MEANING.get(sig, f"died by {sig}" if sig else f"exited with code {code}" if code else "failed")
    who = f"rank {rank.group(1)}" if rank else "a worker"
    return make_event(
        "worker_failed", "error",
        f"torchrun's root cause: {who}{f' on {host}' if host else ''}, exitcode {code or '?'}: {fields['traceback']}",
        source, ts,
        rank=rank.group(1) if rank else "", local_rank=rank.group(2) if rank else "", host=host,
        exitcode=code, signal=sig, pid=exited.group(2) if exited else "",
        meaning=f"torchrun stopped the job on this node (no restart left): the first worker to fail, {who}, {how}",
    )


# Slurm's srun for each task that failed; "Killed" and "Terminated" are srun or slurmstepd
# stopping the remaining tasks after the first failure (or at a time limit), not a failure of theirs.
_SRUN = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (?:Exited with exit code (\d+)|(Segmentation fault|Aborted|Bus error))")
_SRUN_SIGNAL = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS"}


def _srun(line: str, source: str, ts: float) -> Event | None:
    if "srun: error" not in line:
        return None
    match = _SRUN.search(line)
    if match is None:
        return None
    host, task, code, crash = match.groups()
    sig = _SRUN_SIGNAL.get(crash or "", "")
    how = _SIGNAL_MEANING.get(sig, "") or f"exited with code {code}"
    return make_event(
        "worker_failed", "error", line, source, ts,
        host=host, task=task, exitcode=code or "", signal=sig,
        meaning=f"srun's task {task} on {host} {how}",
    )


# ---------------------------------------------------------------- crashes

# The kernel's line for a process that crashed inside a GPU or NIC library:
# "pt_main_thread[2536443]: segfault at 7f79... ip ... sp ... error 4 in libnccl.so.2[7f7c...+d3d3000]".
_SEGFAULT = re.compile(
    r"(?:(\S+)\[(\d+)\]: )?segfault at \S+ ip \S+ sp \S+ error \d+(?: cpu \d+)? in "
    r"(lib(?:nccl|cuda|cudart|cublas|cudnn|nvidia-|torch_cuda|c10_cuda|nvrtc|cufft|curand|cusparse|cusolver|nvJitLink"
    r"|nvshmem|mlx5|ibverbs|rdmacm)[\w.+-]*?)(?:\[|\s|$)"
)


def _segfault(line: str, source: str, ts: float) -> Event | None:
    if "segfault at" not in line:
        return None
    match = _SEGFAULT.search(line)
    if match is None:
        return None
    process, pid, library = match.groups()
    return make_event(
        "process_crash", "error", line, source, ts,
        process=process or "", pid=pid or "", library=library, reason="segfault",
        meaning=f"the process crashed (segmentation fault) inside {library}",
    )


# std::terminate's report: "terminate called after throwing an instance of 'X'" then "  what():  ...".
_TERMINATE = re.compile(r"terminate called (?:after throwing an instance of '([^']+)'|(without an active exception))")
_ABORTING: dict[str, str] = {}  # per log, the exception whose what() line comes next


def _abort(line: str, source: str, ts: float) -> Event | None:
    if "terminate called" in line:
        match = _TERMINATE.search(line)
        if match is None:
            return None  # "terminate called recursively": the same abort, seen from another thread
        if match.group(2):
            _ABORTING.pop(source, None)
            return make_event(
                "process_crash", "error", line, source, ts, rank=rank_of(line), reason="abort",
                meaning="the process aborted: a C++ thread object was destroyed while its thread still ran",
            )
        exception = match.group(1)
        if "what():" not in line:
            remember(_ABORTING, source, exception)
            return None
    elif "what():" in line:
        opened = _ABORTING.pop(source, None)
        if opened is None:
            return None  # no abort open in this log: the line is judged as any other
        exception = opened
    else:
        return None
    # The what() line says why: the kind it names is the event, with the exception that carried it.
    for cause in _CAUSES:
        event = cause(line, source, ts)
        if event is not None:
            event.details["exception"] = Text(exception)
            return event
    return make_event(
        "process_crash", "error", line, source, ts, rank=rank_of(line), reason="abort", exception=exception,
        meaning=f"the process aborted on an uncaught C++ exception ({exception})",
    )


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


# What an abort's what() line may name, in the order below.
_CAUSES: tuple[Detector, ...] = (_cuda_ecc, _cuda_error, _oom, _nccl_timeout, _nccl_error)

# Order matters: the root cause first. A dead GPU's ECC error printed through an
# NCCL or CUDA message is the hardware's fault; a CUDA error the NCCL watchdog
# reports is the CUDA error; an OOM raised inside NCCL is the OOM. The two readers
# of multi-line reports (an abort and its what(), torchelastic's table) come before
# them, so a line inside a report is read as part of it.
DETECTORS: tuple[Detector, ...] = (
    _abort, _root_cause, *_CAUSES, _worker_failed, _srun, _segfault, _traceback, _nan_loss,
)
