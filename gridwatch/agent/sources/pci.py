"""One spelling of a PCI bus id, so the kernel's and NVML's can be compared."""

from __future__ import annotations

import re

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
