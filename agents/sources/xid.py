"""What an NVIDIA XID code means to an operator, and one spelling of a PCI bus id."""

from __future__ import annotations

import re

# Codes from NVIDIA's XID catalogue that an on-call operator must act on. Any
# other code is a warning: often an application fault (13, 31, 43), not the node.
_XID: dict[int, tuple[str, str]] = {
    13: ("warning", "graphics engine exception (often an application fault)"),
    31: ("warning", "GPU memory page fault (often an application fault)"),
    32: ("error", "invalid or corrupted push buffer stream"),
    38: ("error", "driver firmware error"),
    43: ("warning", "GPU stopped processing (application fault)"),
    45: ("info", "preemptive cleanup after an earlier error"),
    48: ("critical", "double-bit ECC error"),
    54: ("error", "auxiliary power is not connected"),
    56: ("error", "display engine error"),
    61: ("error", "internal micro-controller breakpoint"),
    62: ("error", "internal micro-controller halt"),
    63: ("error", "ECC page retirement or row remapping recorded"),
    64: ("critical", "ECC page retirement or row remapping failed"),
    68: ("error", "video processor exception"),
    69: ("error", "graphics engine class error"),
    74: ("critical", "NVLink error"),
    79: ("critical", "GPU has fallen off the bus"),
    92: ("error", "high single-bit ECC error rate"),
    94: ("error", "contained ECC error"),
    95: ("critical", "uncontained ECC error"),
    109: ("error", "context switch timeout"),
    119: ("critical", "GSP RPC timeout"),
    120: ("critical", "GSP error"),
    121: ("error", "C2C link error"),
    140: ("critical", "unrecovered ECC error"),
}


def xid_severity(code: int) -> str:
    """``info`` | ``warning`` | ``error`` | ``critical`` for an XID code."""
    return _XID.get(code, ("warning", ""))[0]


def xid_meaning(code: int) -> str:
    """A short description of an XID code, or ``unlisted XID`` for one we do not know."""
    return _XID.get(code, ("", "unlisted XID"))[1]


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
