"""What an NVIDIA XID code means to an operator, from NVIDIA's catalogue, and one spelling of a PCI bus id.

The catalogue ships as package data (``agents/data/xid_catalog.json``): every
code NVIDIA publishes, with its mnemonic, description, NVIDIA's resolution
("immediate action": restart the application, reset the GPU, reboot, ...) and
where the entry comes from. Two fields are ours, derived from NVIDIA's:

- ``severity``: ``info`` for what NVIDIA says to ignore or that follows another
  XID; ``critical`` for a fatal XID whose fix is a reset, a reboot or the
  double-bit-ECC / NVLink workflows; ``error`` for another fatal one or a
  memory error; ``warning`` for the rest (an application to restart).
- ``blame``: ``application`` when NVIDIA's fix is to restart the application,
  ``hardware`` for a reset, a reboot, a mechanical check, NVIDIA support or the
  ECC / NVLink workflows, ``software`` for a driver, VM or UVM fix, ``none``
  otherwise. XIDs 63, 92 and 94 (ECC row remapping, single-bit rate, contained
  ECC) are memory errors NVIDIA buckets as ignore or restart the application:
  they count as hardware.

A code the catalogue does not list still works: a warning, "unlisted XID",
resolution UNKNOWN.
"""

from __future__ import annotations

import re

from loguru import logger

from agents.protocol import Severity
from agents.xidcatalog import XidBlame, XidEntry, XidResolution, xid_catalog

CATALOG_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
_warned: set[int] = set()


def xid_entry(code: int) -> XidEntry:
    """The catalogue's entry for ``code``; an unlisted code gets a warning entry with resolution UNKNOWN."""
    entry = xid_catalog().get(code)
    if entry is not None:
        return entry
    if code not in _warned and len(_warned) < 1000:
        _warned.add(code)
        logger.warning("XID {} is not in NVIDIA's catalogue as shipped; treated as a warning", code)
    return XidEntry(code=code, name=f"XID_{code}", description="unlisted XID", resolution=XidResolution.UNKNOWN,
                    fatal=False, severity=Severity.WARNING, blame=XidBlame.NONE, source=CATALOG_URL)


def xid_resolution(code: int) -> XidResolution:
    """NVIDIA's resolution for an XID code (UNKNOWN for an unlisted one)."""
    return xid_entry(code).resolution


def xid_severity(code: int) -> str:
    """``info`` | ``warning`` | ``error`` | ``critical`` for an XID code."""
    return str(xid_entry(code).severity)


def xid_meaning(code: int) -> str:
    """A short description of an XID code, or ``unlisted XID`` for one we do not know."""
    return xid_entry(code).description


_PCI = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?$")


def pci_key(bus_id: str) -> str:
    """One spelling of a PCI address, so the kernel's and NVML's can be compared.

    The kernel writes ``0000:3b:00``, NVML ``00000000:3B:00.0``; both become
    ``0000:3b:00.0``. A string that is not a PCI address comes back unchanged.
    """
    match = _PCI.match(bus_id.strip().removeprefix("PCI:"))
    if match is None:
        return bus_id
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function or '0'}"
