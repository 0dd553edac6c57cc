"""NVIDIA's XID catalogue as data: what each code means and NVIDIA's resolution for it.

Part of the wire: the agent stamps each XID event with its resolution, and the
console's playbooks select on it (and on its blame), also for events from agents
older than the field. The data ships in the package (agents/data/xid_catalog.json).
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import msgspec

from agents.protocol import Severity


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
    """One XID of the shipped catalogue (agents/data/xid_catalog.json)."""

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


def xid_resolution_of(code: int) -> XidResolution:
    """NVIDIA's resolution for ``code``; UNKNOWN for a code the catalogue does not list."""
    entry = xid_catalog().get(code)
    return entry.resolution if entry is not None else XidResolution.UNKNOWN
