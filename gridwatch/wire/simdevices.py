"""The simulated devices' faults that a node's agent shares with the trainer beside it (sim and demo only).

A real fault reaches the training process through the hardware: a GPU that
fell off the bus makes the next CUDA call hang and then fail. Simulated GPUs
have no hardware in between, so the agent writes the node's faults to one
private file (``<dir>/<node>.json``, 0600 in a 0700 directory named by
:data:`SIM_DEVICES_ENV`) and the trainer's simulated-device hook reads it
before each step. A missing, foreign or unreadable file means "healthy". The
agent also appends the lines the NVIDIA driver would print to the node's
simulated kernel log (``<dir>/<node>.kern.log``), which the node's agent
follows like a real one.

Both ends import this module: it imports nothing of ours but the wire.
"""

from __future__ import annotations

import enum
import os
import stat
import time
from pathlib import Path

import msgspec

# Set only where devices are simulated (the demo sets it for its agents and its trainer);
# a real node never has it, so its trainer never looks for simulated faults.
SIM_DEVICES_ENV = "GRIDWATCH_SIM_DEVICES"
MAX_STATE_BYTES = 1 << 16
MAX_FAULTS = 64


class DeviceFault(enum.Enum):
    """What a simulated fault does to the training process beside it."""

    LOST = "lost"  # fell off the bus (XID 79): the next collective hangs, then a CUDA error
    ECC_DBE = "ecc-dbe"  # uncorrectable ECC (XID 48): the process dies; new ones too until a reset
    APP_CRASH = "app-crash"  # XID 13 / 31: this process dies; the node is healthy
    THERMAL = "thermal"  # clocks throttled: every step takes longer
    HANG = "hang"  # a kernel that never finishes: stuck in the next collective
    LINK_FLAP = "ib-flap"  # an InfiniBand link flaps: collectives slow, then fail
    SPIN = "spin"  # the training thread loops in Python before its next collective (no GPU fault: the peers wait)


def fault_for(kind: str, code: int | None = None) -> DeviceFault | None:
    """The effect of an injected fault (``inject_fault``'s kind and code); None for one that has none here."""
    kind = kind.strip().lower().replace("_", "-")
    if kind == "xid":
        return {79: DeviceFault.LOST, 48: DeviceFault.ECC_DBE, 13: DeviceFault.APP_CRASH,
                31: DeviceFault.APP_CRASH}.get(code if code is not None else -1)
    return {"fell-off-bus": DeviceFault.LOST, "ecc-dbe": DeviceFault.ECC_DBE, "thermal": DeviceFault.THERMAL,
            "hang": DeviceFault.HANG, "ib-flap": DeviceFault.LINK_FLAP, "spin": DeviceFault.SPIN}.get(kind)


class FaultRecord(msgspec.Struct, frozen=True, kw_only=True):
    fault: DeviceFault
    at: float  # when it was injected (time.time())
    gpu: int = 0
    code: int | None = None
    seq: int = 0  # grows with every fault on the node, so a trainer can tell a new one from one it saw


class DeviceState(msgspec.Struct, kw_only=True):
    node: str
    faults: list[FaultRecord] = []

    def has(self, fault: DeviceFault) -> FaultRecord | None:
        for record in self.faults:
            if record.fault is fault:
                return record
        return None


def sim_dir() -> Path | None:
    value = os.environ.get(SIM_DEVICES_ENV, "")
    return Path(value) if value else None


def state_path(directory: Path, node: str) -> Path:
    return directory / f"{_safe(node)}.json"


def kernel_log_path(directory: Path, node: str) -> Path:
    return directory / f"{_safe(node)}.kern.log"


def _safe(node: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in node)[:100] or "node"


def _private_dir(directory: Path) -> bool:
    """True if ``directory`` is this user's and closed to everyone else (never followed through a link)."""
    try:
        st = directory.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def read_state(path: Path, node: str) -> DeviceState:
    """The node's faults; a missing, foreign, oversized or garbled file reads as healthy."""
    healthy = DeviceState(node=node)
    if not _private_dir(path.parent):
        return healthy
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return healthy
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return healthy
        data = os.read(fd, MAX_STATE_BYTES + 1)
    except OSError:
        return healthy
    finally:
        os.close(fd)
    if len(data) > MAX_STATE_BYTES:
        return healthy
    try:
        state = msgspec.json.decode(data, type=DeviceState)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return healthy
    return state if state.node == node else healthy


def write_state(path: Path, state: DeviceState) -> None:
    """Replace the node's file at once (0600, written beside it then renamed); refuses a directory not private."""
    if not _private_dir(path.parent):
        raise PermissionError(f"{path.parent} is not a private directory of this user (0700); not writing faults there")
    state.faults = state.faults[-MAX_FAULTS:]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, msgspec.json.encode(state))
    finally:
        os.close(fd)
    os.replace(tmp, path)


def append_kernel_lines(path: Path, lines: list[str], host: str, now: float | None = None) -> None:
    """Append ``lines`` as syslog's kern.log writes them (``Mon DD HH:MM:SS host kernel: ...``), 0600."""
    if not lines or not _private_dir(path.parent):
        return
    stamp = time.strftime("%b %d %H:%M:%S", time.localtime(time.time() if now is None else now))
    text = "".join(f"{stamp} {host} kernel: {line}\n" for line in lines)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def driver_lines(fault: DeviceFault, code: int | None, pci_bus_id: str, pid: int | None) -> list[str]:
    """What the NVIDIA driver prints for this fault, in the formats of real kernel logs.

    Formats (values ours): XID 79 "NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus"
    (NVIDIA/NVSentinel issue 155) with pid/name as in "Xid (PCI:0000:9b:00): 94, pid=1234,
    name=python3, ..." (leptonai/gpud PR 1174); XID 13 "Graphics SM Warp Exception on (GPC 7, TPC 7,
    SM 0): ..." and "Graphics Exception: ESR ..." (leptonai/gpud PR 46); XID 31 "Ch 00000003, engmask
    00000101, intr 10000000" (Bumblebee-Project/Bumblebee issue 677). XID 48's text is the name
    NVIDIA's XID catalogue gives it ("DBE (Double Bit Error) ECC Error"): written by us.
    """
    pci = _xid_pci(pci_bus_id)
    who = f"pid={pid}, name=python3" if pid else "pid='<unknown>', name=<unknown>"
    if fault is DeviceFault.LOST:
        return [f"NVRM: Xid (PCI:{pci}): 79, {who}, GPU has fallen off the bus.",
                f"NVRM: GPU {pci_bus_id}: GPU has fallen off the bus."]
    if fault is DeviceFault.ECC_DBE:
        return [f"NVRM: Xid (PCI:{pci}): 48, {who}, DBE (Double Bit Error) ECC Error"]
    if fault is DeviceFault.APP_CRASH:
        c = code if code is not None else 13
        if c == 31:
            return [f"NVRM: Xid (PCI:{pci}): 31, {who}, Ch 00000003, engmask 00000101, intr 10000000"]
        return [f"NVRM: Xid (PCI:{pci}): 13, {who}, Graphics SM Warp Exception on (GPC 2, TPC 1, SM 0): "
                "Out Of Range Address",
                f"NVRM: Xid (PCI:{pci}): 13, {who}, Graphics Exception: ESR 0x514730=0x201000e 0x514734=0x24 "
                "0x514728=0x1f81fb60 0x51472c=0x1174"]
    return []


def _xid_pci(pci_bus_id: str) -> str:
    """``0000:18:00.0`` -> ``0000:18:00``, the form the driver's Xid lines use."""
    return pci_bus_id.rsplit(".", 1)[0] if "." in pci_bus_id else pci_bus_id
