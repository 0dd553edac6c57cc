"""The real port reader: HCA ports under ``/sys/class/infiniband``.

The reader walks ``/sys/class/infiniband/<device>/ports/<port>/`` as
``ibstat`` and node_exporter's infiniband collector do: ``state``
(``4: ACTIVE``), ``phys_state`` (``5: LinkUp``), ``rate`` (``400 Gb/sec (4X
NDR)``), ``link_layer`` (InfiniBand, or Ethernet for RoCE) and every file
under ``counters/`` and ``hw_counters/``. A file that vanishes or holds garbage
is N/A in the reading and an ``ib_unreadable`` event; a file that blocks
holds up this source alone (the guard reports it hung, the sample goes out).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import TypeVar

from gridwatch.agent.sources.ib.ports import IbPort, Unreadable
from gridwatch.wire.protocol import clean_text

SYSFS_ROOT = "/sys/class/infiniband"
_T = TypeVar("_T")
# A sysfs attribute is one short line; more than this is not one.
_MAX_FILE_BYTES = 4096

_ID_NAME = re.compile(r"^\s*(\d+)\s*:\s*(\S.*?)\s*$")  # "4: ACTIVE", "5: LinkUp"
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([GMT]?)b/sec\b")  # "400 Gb/sec (4X NDR)", "2.5 Gb/sec (1X SDR)"
_RATE_UNIT = {"": 1e-9, "M": 1e-3, "G": 1.0, "T": 1e3}


def parse_id_name(text: str) -> tuple[int, str] | None:
    """``"4: ACTIVE"`` -> ``(4, "ACTIVE")``; None for anything else."""
    m = _ID_NAME.match(text)
    return (int(m.group(1)), m.group(2)) if m else None


def parse_rate(text: str) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` -> 400.0 (Gb/s); None for anything else."""
    m = _RATE.match(text)
    return float(m.group(1)) * _RATE_UNIT[m.group(2)] if m else None


def _read_text(path: str) -> str:
    """One sysfs attribute; raises OSError, or ValueError for what is not one short line of text.

    Plain ``os`` calls on string paths: a node with eight HCAs has some 450 of these files a tick.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, _MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_FILE_BYTES:
        raise ValueError(f"more than {_MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("not text") from None
    if "\x00" in text:
        raise ValueError("not text")
    return text.strip()


class SysfsPorts:
    """HCA ports under a sysfs root (``/sys/class/infiniband``; a test passes a tree laid out the same)."""

    simulated = False

    def __init__(self, root: str = SYSFS_ROOT) -> None:
        self.root = str(root)

    def devices(self) -> list[str]:
        """HCA names now (``ibstat -l``); none when the class directory is absent."""
        try:
            return sorted(os.listdir(self.root))
        except OSError:
            return []

    def read_ports(self) -> tuple[list[IbPort], list[Unreadable]]:
        ports: list[IbPort] = []
        bad: list[Unreadable] = []
        for device in self.devices():
            ports_dir = f"{self.root}/{device}/ports"
            try:
                numbers = sorted(int(name) for name in os.listdir(ports_dir) if name.isdigit())
            except OSError as exc:
                bad.append(Unreadable(ports_dir, _os_why(exc)))
                continue
            for number in numbers:
                ports.append(self._port(device, number, f"{ports_dir}/{number}", bad))
        return ports, bad

    def _port(self, device: str, number: int, where: str, bad: list[Unreadable]) -> IbPort:
        port = IbPort(device=device, port=number)
        state = self._attr(f"{where}/state", bad, parse_id_name)
        if state is not None:
            port.state_id, port.state = state
        phys = self._attr(f"{where}/phys_state", bad, parse_id_name)
        if phys is not None:
            port.phys_state_id, port.phys_state = phys
        port.rate_gbps = self._attr(f"{where}/rate", bad, parse_rate)
        port.link_layer = self._attr(f"{where}/link_layer", bad, lambda t: t if t.isprintable() and t else None)
        port.counters = self._counters(f"{where}/counters", bad)
        port.hw_counters = self._counters(f"{where}/hw_counters", bad)
        return port

    @staticmethod
    def _attr(path: str, bad: list[Unreadable], parse: Callable[[str], _T | None]) -> _T | None:
        try:
            text = _read_text(path)
        except FileNotFoundError:
            bad.append(Unreadable(path, "vanished"))
            return None
        except OSError as exc:
            bad.append(Unreadable(path, _os_why(exc)))
            return None
        except ValueError as exc:
            bad.append(Unreadable(path, str(exc)))
            return None
        value = parse(text)
        if value is None:
            bad.append(Unreadable(path, f"garbage {clean_text(text, 40)!r}"))
        return value

    @staticmethod
    def _counters(where: str, bad: list[Unreadable]) -> dict[str, int]:
        out: dict[str, int] = {}
        try:
            names = sorted(entry.name for entry in os.scandir(where) if entry.is_file())
        except FileNotFoundError:
            return out  # mlx4 has no hw_counters; older kernels neither
        except OSError as exc:
            bad.append(Unreadable(where, _os_why(exc)))
            return out
        for name in names:
            path = f"{where}/{name}"
            try:
                text = _read_text(path)
            except FileNotFoundError:
                bad.append(Unreadable(path, "vanished"))
                continue
            except PermissionError:
                continue  # some hw_counters are root-only on some kernels: N/A, as node_exporter skips them
            except OSError as exc:
                if exc.errno in (95, 22):  # EOPNOTSUPP, EINVAL: the device does not keep this counter
                    continue
                bad.append(Unreadable(path, _os_why(exc)))
                continue
            except ValueError as exc:
                bad.append(Unreadable(path, str(exc)))
                continue
            if text.startswith("N/A"):  # "N/A (no PMA)": iWARP and some RoCE devices keep no PortCounters
                continue
            if not text.isdigit():
                bad.append(Unreadable(path, f"garbage {clean_text(text, 40)!r}"))
                continue
            out[name] = int(text)
        return out


def _os_why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__
