"""NVIDIA's XID catalogue as data, and the one lookup of what a code means to an operator.

The catalogue ships as package data (``gridwatch/wire/data/xid_catalog.json``): every
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

from enum import StrEnum
from pathlib import Path

import msgspec
from loguru import logger

from gridwatch.wire.protocol import Severity


class XidResolution(StrEnum):
    """What to do about an XID, as NVIDIA's XID catalogue names it (its "immediate action" bucket)."""

    IGNORE = "IGNORE"
    RESTART_APP = "RESTART_APP"
    RESET_GPU = "RESET_GPU"
    RESTART_BM = "RESTART_BM"  # reboot the node (restart bare metal)
    RESTART_VM = "RESTART_VM"
    CONTACT_SUPPORT = "CONTACT_SUPPORT"
    CHECK_MECHANICALS = "CHECK_MECHANICALS"  # power cables, seating, cooling
    CHECK_UVM = "CHECK_UVM"
    UPDATE_SWFW = "UPDATE_SWFW"  # driver or firmware
    WORKFLOW_XID_45 = "WORKFLOW_XID_45"  # follows another XID: act on that one
    WORKFLOW_XID_48 = "WORKFLOW_XID_48"  # double-bit ECC: drain, then reset or reboot
    WORKFLOW_NVLINK_ERR = "WORKFLOW_NVLINK_ERR"  # check the NVLink (nvidia-smi nvlink -e)
    WORKFLOW_NVLINK5_ERR = "WORKFLOW_NVLINK5_ERR"
    XID_154_EVAL = "XID_154_EVAL"  # the driver names the recovery action in the message
    UNKNOWN = "UNKNOWN"  # a code the catalogue does not list


class XidBlame(StrEnum):
    """What an XID points at: the program, the GPU or its links, the software stack, or nothing to fix."""

    APPLICATION = "application"
    HARDWARE = "hardware"
    SOFTWARE = "software"
    NONE = "none"


class XidEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One XID of the shipped catalogue (gridwatch/wire/data/xid_catalog.json)."""

    code: int
    name: str  # NVIDIA's mnemonic: GSP_RPC_TIMEOUT
    description: str
    resolution: XidResolution
    fatal: bool
    severity: Severity
    blame: XidBlame
    source: str  # where the entry comes from (URL)


class _XidCatalogFile(msgspec.Struct):
    entries: list[XidEntry]


_XID_CATALOG: dict[int, XidEntry] | None = None


def xid_catalog() -> dict[int, XidEntry]:
    """Every XID NVIDIA publishes, by code, read once from the package's data.

    On the wire, because both ends decide from it: the agent stamps each
    XID event with its resolution, the console's playbooks select on it (and on
    its blame) also for events from agents older than the field.
    """
    global _XID_CATALOG
    if _XID_CATALOG is None:
        data = (Path(__file__).resolve().parent / "data" / "xid_catalog.json").read_bytes()
        _XID_CATALOG = {e.code: e for e in msgspec.json.decode(data, type=_XidCatalogFile).entries}
    return _XID_CATALOG


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
