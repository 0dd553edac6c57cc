"""Detectors: one log line in, an Event (XID, NCCL, traceback, OOM, NaN loss) or None out."""

from __future__ import annotations

import re
from collections.abc import Callable

from agents.protocol import Event, Text
from agents.sources.xid import pci_key, xid_meaning, xid_severity

# Most lines match nothing; one alternation rejects them before any specific
# pattern runs, so a busy log costs one regex search per line.
_PREFILTER = re.compile(
    r"NVRM: (?:Xid|GPU at)|NCCL WARN|NCCL error|nccl[A-Z]\w*Error|Watchdog caught|NCCL.*(?:timed out|Timeout\(ms\))"
    r"|Traceback \(most recent|out of memory|OutOfMemoryError"
    r"|(?i:\bloss\b['\"]?\s*(?:[:=]|is)\s*['\"]?[+-]?(?:nan|inf))"
)

_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+)(?:, pid=([^,\s]+))?(?:, name=([^,]*))?")
_OFF_BUS = re.compile(r"NVRM: GPU at PCI:([0-9A-Fa-f:.]+): .*fallen off the bus", re.I)
_NCCL_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout|NCCL.*(?:timed out|Timeout\(ms\))")
_NCCL_ERROR = re.compile(
    r"NCCL WARN|NCCL error|ncclInternalError|ncclSystemError|ncclUnhandledCudaError|ncclRemoteError|ncclInvalidUsage"
)
_TRACEBACK = re.compile(r"Traceback \(most recent call last\):")
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory")
_NAN_LOSS = re.compile(r"\bloss\b['\"]?\s*(?:[:=]|is)\s*['\"]?([+-]?(?:nan|inf(?:inity)?))\b", re.I)
_RANK = re.compile(r"\[(?:Rank|rank) ?(\d+)\]|\brank[ =:](\d+)")

MESSAGE_CHARS = 300


def _event(kind: str, severity: str, line: str, source: str, ts: float, **details: str) -> Event:
    return Event(
        kind=Text(kind),
        severity=Text(severity),
        message=Text(line.strip()[:MESSAGE_CHARS]),
        source=Text(f"log:{source}"),
        ts=ts,
        details={k: Text(v) for k, v in details.items() if v},
    )


def _xid(line: str, source: str, ts: float) -> Event | None:
    match = _XID.search(line)
    if match is None:
        return None
    bus, code_text, pid, name = match.groups()
    code = int(code_text)
    event = _event(
        "xid",
        xid_severity(code),
        f"XID {code} ({xid_meaning(code)}): {line.strip()}",
        source,
        ts,
        pci_bus_id=pci_key(bus),
        pid=pid or "",
        process=(name or "").strip(),
    )
    event.code = code
    return event


def _off_bus(line: str, source: str, ts: float) -> Event | None:
    match = _OFF_BUS.search(line)
    if match is None:
        return None
    return _event("fell_off_bus", "critical", line, source, ts, pci_bus_id=pci_key(match.group(1)))


def _rank(line: str) -> str:
    match = _RANK.search(line)
    return (match.group(1) or match.group(2)) if match else ""


def _nccl_timeout(line: str, source: str, ts: float) -> Event | None:
    if _NCCL_TIMEOUT.search(line) is None:
        return None
    return _event("nccl_timeout", "error", line, source, ts, rank=_rank(line))


def _nccl_error(line: str, source: str, ts: float) -> Event | None:
    match = _NCCL_ERROR.search(line)
    if match is None:
        return None
    # A WARN is NCCL saying something went wrong and it may recover; the
    # named error results mean a collective has already failed.
    severity = "warning" if match.group(0) == "NCCL WARN" else "error"
    return _event("nccl_error", severity, line, source, ts, rank=_rank(line))


def _traceback(line: str, source: str, ts: float) -> Event | None:
    if _TRACEBACK.search(line) is None:
        return None
    return _event("traceback", "error", line, source, ts)


def _oom(line: str, source: str, ts: float) -> Event | None:
    if _OOM.search(line) is None:
        return None
    return _event("oom", "error", line, source, ts, rank=_rank(line))


def _nan_loss(line: str, source: str, ts: float) -> Event | None:
    match = _NAN_LOSS.search(line)
    if match is None:
        return None
    return _event("nan_loss", "error", line, source, ts, value=match.group(1).lower(), rank=_rank(line))


# Order matters: a line that is both (an OOM raised inside NCCL) is reported as
# the more specific, more actionable kind.
_DETECTORS: tuple[Callable[[str, str, float], Event | None], ...] = (
    _xid,
    _off_bus,
    _nccl_timeout,
    _oom,
    _nccl_error,
    _traceback,
    _nan_loss,
)


def detect(line: str, source: str = "", ts: float = 0.0) -> Event | None:
    """The event a log line reports, or ``None`` for an ordinary line.

    ``source`` is the log's path (the event's source becomes ``log:<path>``);
    ``ts`` is when the line was read. The event's ``seq`` and ``node`` are left
    for the sampler to fill in.
    """
    if _PREFILTER.search(line) is None:
        return None
    for detector in _DETECTORS:
        event = detector(line, source, ts)
        if event is not None:
            return event
    return None
