"""Detectors for what the kernel and the GPU driver write: XIDs, a GPU fallen off the bus."""

from __future__ import annotations

import re

from agents.detectors.common import Detector, make_event
from agents.protocol import Event
from agents.sources.xid import pci_key, xid_meaning, xid_severity

# The words any line of this module's kinds contains; a line without them costs one search.
PREFILTER = r"NVRM: (?:Xid|GPU at)"

_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+)(?:, pid=([^,\s]+))?(?:, name=([^,]*))?")
_OFF_BUS = re.compile(r"NVRM: GPU at PCI:([0-9A-Fa-f:.]+): .*fallen off the bus", re.I)


def _xid(line: str, source: str, ts: float) -> Event | None:
    match = _XID.search(line)
    if match is None:
        return None
    bus, code_text, pid, name = match.groups()
    code = int(code_text)
    event = make_event(
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
    return make_event("fell_off_bus", "critical", line, source, ts, pci_bus_id=pci_key(match.group(1)))


DETECTORS: tuple[Detector, ...] = (_xid, _off_bus)
