"""Detectors for what training software writes: NCCL, CUDA out of memory, tracebacks, NaN loss."""

from __future__ import annotations

import re

from agents.detectors.common import Detector, make_event, rank_of
from agents.protocol import Event

# The words any line of this module's kinds contains; a line without them costs one search.
PREFILTER = (
    r"NCCL WARN|NCCL error|nccl[A-Z]\w*Error|Watchdog caught|NCCL.*(?:timed out|Timeout\(ms\))"
    r"|Traceback \(most recent|out of memory|OutOfMemoryError"
    r"|(?i:\bloss\b['\"]?\s*(?:[:=]|is)\s*['\"]?[+-]?(?:nan|inf))"
)

_NCCL_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout|NCCL.*(?:timed out|Timeout\(ms\))")
_NCCL_ERROR = re.compile(
    r"NCCL WARN|NCCL error|ncclInternalError|ncclSystemError|ncclUnhandledCudaError|ncclRemoteError|ncclInvalidUsage"
)
_TRACEBACK = re.compile(r"Traceback \(most recent call last\):")
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory")
_NAN_LOSS = re.compile(r"\bloss\b['\"]?\s*(?:[:=]|is)\s*['\"]?([+-]?(?:nan|inf(?:inity)?))\b", re.I)


def _nccl_timeout(line: str, source: str, ts: float) -> Event | None:
    if _NCCL_TIMEOUT.search(line) is None:
        return None
    return make_event("nccl_timeout", "error", line, source, ts, rank=rank_of(line))


def _nccl_error(line: str, source: str, ts: float) -> Event | None:
    match = _NCCL_ERROR.search(line)
    if match is None:
        return None
    # A WARN is NCCL saying something went wrong and it may recover; the
    # named error results mean a collective has already failed.
    severity = "warning" if match.group(0) == "NCCL WARN" else "error"
    return make_event("nccl_error", severity, line, source, ts, rank=rank_of(line))


def _traceback(line: str, source: str, ts: float) -> Event | None:
    if _TRACEBACK.search(line) is None:
        return None
    return make_event("traceback", "error", line, source, ts)


def _oom(line: str, source: str, ts: float) -> Event | None:
    if _OOM.search(line) is None:
        return None
    return make_event("oom", "error", line, source, ts, rank=rank_of(line))


def _nan_loss(line: str, source: str, ts: float) -> Event | None:
    match = _NAN_LOSS.search(line)
    if match is None:
        return None
    return make_event("nan_loss", "error", line, source, ts, value=match.group(1).lower(), rank=rank_of(line))


# Order matters: a line that is both (an OOM raised inside NCCL) is reported as
# the more specific, more actionable kind.
DETECTORS: tuple[Detector, ...] = (_nccl_timeout, _oom, _nccl_error, _traceback, _nan_loss)
