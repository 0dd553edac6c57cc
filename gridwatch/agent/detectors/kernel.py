"""Detectors for what the kernel, the GPU driver and the host write: XIDs, GSP, NVSwitch, NICs, PCIe, memory, disks.

Each event carries what an operator needs to act: the PCI id, the device or
port, the code, and in ``details["action"]`` what to do about it. The line
shapes are the drivers' own (``NVRM:``, ``nvidia-nvswitch``, ``mlx5_core``,
``pcieport``, ``EDAC``, ...), as ``/dev/kmsg``, ``dmesg``, ``kern.log`` and
the journal show them, with or without a timestamp or syslog prefix.
"""

from __future__ import annotations

import re

from gridwatch.agent.detectors.common import Detector, make_event
from gridwatch.agent.sources.pci import pci_key
from gridwatch.wire.protocol import Event, Text
from gridwatch.wire.xid import xid_meaning, xid_resolution, xid_severity

# The words any line of this module's kinds contains; a line without them costs one search.
# Every branch starts with a plain character, never a class ("Link|link", not "[Ll]ink"): the
# regex engine then skips to the positions where a branch can begin (measured 6x faster a line).
PREFILTER = (
    r"NVRM|SXid|nvswitch|NVSwitch|fabricmanager|fabric manager|\] \[ERROR\]|peermem|nv_peer_mem"
    r"|Link (?:is )?[Dd]own|link (?:is )?[Dd]own|link status definitely down|NETDEV WATCHDOG|Port module event"
    r"|AER|PCIe Bus Error|EDAC|blocked for more than|soft lockup|hard LOCKUP"
    r"|Out of memory|out of memory|oom-kill:|Killed process|Kernel [Pp]anic"
    r"|I/O error|EXT4-fs error|XFS \(|BTRFS|nvme|read-only|failing array|beyond end of device"
)

# A PCI address as the kernel and the driver print it: 0000:3b:00.0, 0000:3b:00, 00000000:86:00.0.
_PCI_ANY = re.compile(r"\b((?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)\b")


def _pci(text: str) -> str:
    """The first PCI address in ``text``, in :func:`pci_key`'s spelling, or ``""``."""
    for match in _PCI_ANY.finditer(text):
        candidate = match.group(1)
        # "10:23:45" in a syslog timestamp is not a PCI address: a real one has a domain or a function.
        if candidate.count(":") == 2 or "." in candidate:
            return pci_key(candidate)
    return ""


# ----------------------------------------------------------------- GPU driver

_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)((?:\s+GPU-C?I:\s*\d+)*)\): (\d+)(?:, pid=([^,\s]+))?(?:, name=([^,]*))?"
)
_GPU_INSTANCE = re.compile(r"GPU-I:\s*(\d+)")
_COMPUTE_INSTANCE = re.compile(r"GPU-CI:\s*(\d+)")


def _xid(line: str, source: str, ts: float) -> Event | None:
    match = _XID.search(line)
    if match is None:
        return None
    bus, mig, code_text, pid, name = match.groups()
    code = int(code_text)
    gi = _GPU_INSTANCE.search(mig or "")
    ci = _COMPUTE_INSTANCE.search(mig or "")
    event = make_event(
        "xid",
        xid_severity(code),
        f"XID {code} ({xid_meaning(code)}): {line.strip()}",
        source,
        ts,
        pci_bus_id=pci_key(bus),
        pid=pid or "",
        process=(name or "").strip(),
        gpu_instance=str(int(gi.group(1))) if gi else "",
        compute_instance=str(int(ci.group(1))) if ci else "",
    )
    event.code = code
    event.resolution = Text(xid_resolution(code))  # set here: the event was built before it had its code
    return event


# "GPU at PCI:0000:9a:00: GPU-... has fallen off the bus.", "GPU 0000:91:00.0: GPU has fallen off the bus.",
# and at probe time "The NVIDIA GPU 0000:b3:00.0 ... has fallen off the bus and is not responding to commands"
# (which dmesg splits over three NVRM lines; /dev/kmsg keeps them in one record).
_OFF_BUS = re.compile(r"NVRM: .*fallen off the bus", re.I)


def _off_bus(line: str, source: str, ts: float) -> Event | None:
    if _OFF_BUS.search(line) is None:
        return None
    return make_event(
        "fell_off_bus",
        "critical",
        f"GPU fell off the bus (the driver lost it on PCIe; reset or reboot, then inspect power and seating): {line.strip()}",
        source,
        ts,
        pci_bus_id=_pci(line.split("NVRM:", 1)[1]),
        action="reboot the node; if it returns, inspect the GPU's power, cooling and seating",
    )


_GSP = re.compile(
    r"NVRM: .*(?:Timeout (?:waiting for RPC from GSP|after \d+s of waiting for RPC response)"
    r"|_kgspLogXid119|GSP RM heartbeat timed out|_kgspIsHeartbeatTimedOut|Heartbeat timed out"
    r"|Rate limiting GSP RPC error prints|GSP RPC timeout|kgspHealthCheck.*fail)",
)
_DRIVER_GPU = re.compile(r"\bGPU(\d+)\b")


def _gsp(line: str, source: str, ts: float) -> Event | None:
    if _GSP.search(line) is None:
        return None
    gpu = _DRIVER_GPU.search(line)
    return make_event(
        "gsp_error",
        "critical",
        f"GSP firmware stopped answering the driver (as XID 119): {line.strip()}",
        source,
        ts,
        pci_bus_id=_pci(line.split("NVRM:", 1)[1]),
        driver_gpu=gpu.group(1) if gpu else "",
        action="reset the GPU (nvidia-smi -r) once it is idle; reboot if the reset fails",
    )


_INIT = re.compile(
    r"NVRM: .*(?:RmInitAdapter failed|rm_init_adapter failed|RmInitAdapter: Cannot initialize GSP"
    r"|The NVIDIA probe routine failed|failed to wait for GFW boot|failed to wait for GFW_BOOT"
    r"|GPU .* RmInitAdapter)"
    r"|nvidia \S+: probe of \S+ failed with error"
)
_INIT_CODE = re.compile(r"\((0x[0-9a-fA-F]+:0x[0-9a-fA-F]+:\d+)\)")


def _init_failure(line: str, source: str, ts: float) -> Event | None:
    if _INIT.search(line) is None:
        return None
    code = _INIT_CODE.search(line)
    return make_event(
        "gpu_init_failure",
        "critical",
        f"the driver could not initialise a GPU: {line.strip()}",
        source,
        ts,
        pci_bus_id=_pci(line.split("NVRM:", 1)[-1]),
        init_code=code.group(1) if code else "",
        action="keep the node out of the job; check driver/firmware versions and reboot, then inspect the GPU",
    )


_PEERMEM = re.compile(
    r"(?:nvidia[-_]peermem|nv_peer_mem)\b.*(?:\bERROR\b|\berror\b|\bfailed\b|Unknown symbol|disagrees about version)"
)


def _peermem(line: str, source: str, ts: float) -> Event | None:
    if _PEERMEM.search(line) is None or "module verification failed" in line:
        return None
    return make_event(
        "peermem_error",
        "error",
        f"nvidia-peermem (GPUDirect RDMA) failed; RDMA to GPU memory is broken or degraded: {line.strip()}",
        source,
        ts,
        action="check that nvidia-peermem matches the running driver and MOFED; reload it or reboot the node",
    )


# ------------------------------------------------------------ NVSwitch, fabric

_SXID = re.compile(r"(nvidia-nvswitch\d*)?:? ?SXid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+)(?:, (Fatal|Non-fatal))?", re.I)
_FM_SXID = re.compile(
    r"detected NVSwitch (fatal|non-fatal) error (\d+) on fid \d+ on NVSwitch pci bus id ([0-9A-Fa-f:.]+)"
    r"(?: physical id (\d+))?(?: port (\d+))?"
)
_LINK = re.compile(r"\bLink (\d+)\b")


def _sxid(line: str, source: str, ts: float) -> Event | None:
    if "SXid" not in line and "NVSwitch" not in line:
        return None
    match = _SXID.search(line)
    if match is not None:
        switch, bus, code_text, fatality = match.groups()
        link = _LINK.search(line)
        port = link.group(1) if link else ""
    else:
        fm = _FM_SXID.search(line)
        if fm is None:
            return None
        fatality, code_text, bus, _, port = fm.groups()
        switch = ""
    code = int(code_text)
    severity = {"fatal": "critical", "non-fatal": "warning"}.get((fatality or "").lower(), "error")
    event = make_event(
        "nvswitch_sxid",
        severity,
        f"NVSwitch SXid {code} ({(fatality or 'unclassified').lower()}): {line.strip()}",
        source,
        ts,
        pci_bus_id=pci_key(bus),
        nvswitch=switch or "",
        port=port or "",
        action=(
            "NVLink traffic through this switch is stalled: drain the node and reset the GPUs and NVSwitches"
            if severity == "critical"
            else "watch the count; a repeating non-fatal SXid needs the NVSwitch tray inspected"
        ),
    )
    event.code = code
    return event


# Fabric Manager writes "[Mon DD YYYY HH:MM:SS] [ERROR] [tid N] ..." in its own log, and
# "nv-fabricmanager[pid]: ..." or "nvidia-fabricmanager-start.sh[pid]: ..." in the journal.
_FM_LOG_ERROR = re.compile(r"\[[A-Z][a-z]{2} \d{1,2} \d{4} \d\d:\d\d:\d\d\] \[ERROR\]")
_FM_UNIT = re.compile(r"nv(?:idia)?-fabricmanager(?:-start\.sh|\.service)?(?:\[\d+\])?:")
_FM_TROUBLE = re.compile(
    r"NV_WARN_NOTHING_TO_DO|don't match with any supported system topology|failed to find the GPU handle"
    r"|\bfailed\b|\berror\b|\babort|Failed with result|exited, code=exited, status=[1-9]",
    re.I,
)


def _fabric_manager(line: str, source: str, ts: float) -> Event | None:
    if _FM_LOG_ERROR.search(line) is None:
        if _FM_UNIT.search(line) is None and "NV_WARN_NOTHING_TO_DO" not in line and "NVSwitches don't match" not in line:
            return None
        if _FM_TROUBLE.search(line) is None:
            return None
    # Without NVSwitches there is nothing for Fabric Manager to do: a wrong install, not a broken fabric.
    severity = "warning" if "NV_WARN_NOTHING_TO_DO" in line else "error"
    return make_event(
        "fabric_manager",
        severity,
        f"NVIDIA Fabric Manager reported an error; NVLink across NVSwitches may be down: {line.strip()}",
        source,
        ts,
        pci_bus_id=_pci(line),
        action="check nvidia-fabricmanager (systemctl status, /var/log/fabricmanager.log); jobs using NVLink will fail until it runs",
    )


# ----------------------------------------------------------------- NICs, PCIe

_NIC_DOWN = re.compile(r"(?:(\S+):? (?:NIC )?[Ll]ink (?:is )?[Dd]own\b)|link status definitely down for interface (\S+)")
_WATCHDOG = re.compile(r"NETDEV WATCHDOG: (?:(\S+) \(([^)]+)\): )?(?:CPU: \d+: )?transmit queue (\d+) timed out")
_MODULE = re.compile(r"Port module event(?:\[(error|warning)\])?: module (\d+), (.*)")
_WATCHDOG_DEV = re.compile(r"(\S+): NETDEV WATCHDOG")


def _nic(line: str, source: str, ts: float) -> Event | None:
    if "ink" not in line and "NETDEV WATCHDOG" not in line and "Port module event" not in line:
        return None  # most lines: skip the patterns that scan every position
    device = reason = ""
    severity = "error"
    watchdog = _WATCHDOG.search(line)
    if watchdog is not None:
        device = watchdog.group(1) or ""
        if not device:
            prior = _WATCHDOG_DEV.search(line)
            device = prior.group(1) if prior else ""
        reason = f"transmit queue {watchdog.group(3)} timed out"
    elif (module := _MODULE.search(line)) is not None:
        status = module.group(3).strip().rstrip(".")
        if module.group(1) is None:
            return None  # "Cable plugged", "Cable unplugged": a port's notices at boot, not a fault

        severity = "warning" if module.group(1) == "warning" else "error"
        device, reason = f"module {module.group(2)}", status
    elif (down := _NIC_DOWN.search(line)) is not None:
        if "pciehp" in line or "SATA link" in line or "NCCL" in line:
            return None  # a PCIe hot-plug slot, a SATA port, or NCCL's own report (the trainer detectors' line)
        device, reason = (down.group(1) or down.group(2) or "").rstrip(":"), "link down"
    else:
        return None
    return make_event(
        "nic_link_down",
        severity,
        f"network link lost ({reason}); collectives over it stall or fail: {line.strip()}",
        source,
        ts,
        device=device,
        pci_bus_id=_pci(line),
        reason=reason,
        action="check the cable, transceiver and switch port; drain the node if the link does not come back",
    )


_AER_FATAL = re.compile(r"Uncorrect(?:ed|able) \(Fatal\)")
_AER_NONFATAL = re.compile(r"Uncorrect(?:ed|able) \(Non-Fatal\)")
_AER_CORRECTED = re.compile(r"AER: (?:Multiple )?Correct(?:ed|able) error|severity=Correct(?:ed|able)")
_AER_FAILED = re.compile(r"AER: (?:can't recover|device recovery failed)")
_AER_ANY = re.compile(r"AER: |PCIe Bus Error: ")
_AER_SOURCE = re.compile(r"(?:received|from):? (?:id=)?([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])")


def _aer(line: str, source: str, ts: float) -> Event | None:
    if _AER_ANY.search(line) is None:
        return None
    if _AER_FATAL.search(line):
        severity, what = "critical", "uncorrected fatal PCIe error; the device is likely lost until reset"
    elif _AER_NONFATAL.search(line):
        severity, what = "error", "uncorrected non-fatal PCIe error; a transaction was lost"
    elif _AER_FAILED.search(line):
        severity, what = "error", "PCIe error recovery failed"
    elif _AER_CORRECTED.search(line):
        # Corrected errors are fixed by the link itself; only a rate of them means a bad slot or riser.
        severity, what = "info", "corrected PCIe error"
    else:
        return None
    origin = _AER_SOURCE.search(line)
    return make_event(
        "pcie_aer",
        severity,
        f"{what}: {line.strip()}",
        source,
        ts,
        pci_bus_id=pci_key(origin.group(1)) if origin else _pci(line),
        action=(
            "watch the rate; many corrected errors mean a bad slot, riser or cable"
            if severity == "info"
            else "drain the node and reseat or replace the device behind this PCIe port"
        ),
    )


# ------------------------------------------------------------- host memory, CPU

_EDAC = re.compile(r"EDAC (?:\S+ )?(MC\d+): (\d+) (CE|UE) (.*)")
_DIMM = re.compile(r"\bon (\S+)")


def _edac(line: str, source: str, ts: float) -> Event | None:
    match = _EDAC.search(line)
    if match is None:
        return None
    mc, count, kind, rest = match.groups()
    where = _DIMM.search(rest)
    uncorrected = kind == "UE"
    return make_event(
        "edac_memory",
        "critical" if uncorrected else "warning",
        f"host memory {'uncorrected' if uncorrected else 'corrected'} ECC error: {line.strip()}",
        source,
        ts,
        memory_controller=mc,
        count=count,
        location=where.group(1) if where else "",
        action=(
            "data in host memory was lost: drain the node and replace the DIMM"
            if uncorrected
            else "schedule the DIMM for replacement if corrected errors keep coming"
        ),
    )


_HUNG = re.compile(r"(?:INFO: )?task (\S+?):(\d+) blocked for more than (\d+) seconds")


def _hung_task(line: str, source: str, ts: float) -> Event | None:
    if "blocked for more than" not in line:
        return None
    match = _HUNG.search(line)
    if match is None:
        return None
    process, pid, seconds = match.groups()
    return make_event(
        "hung_task",
        "error",
        f"a task is stuck in the kernel (uninterruptible) for {seconds}s: {line.strip()}",
        source,
        ts,
        process=process,
        pid=pid,
        seconds=seconds,
        action="look at what it waits on (storage, NFS, a GPU driver call); a hung trainer rank stalls the job",
    )


_SOFT_LOCKUP = re.compile(r"soft lockup - CPU#(\d+) stuck for (\d+)s! \[(.+):(\d+)\]")
_HARD_LOCKUP = re.compile(r"Watchdog detected hard LOCKUP on cpu (\d+)")


def _lockup(line: str, source: str, ts: float) -> Event | None:
    soft = _SOFT_LOCKUP.search(line)
    if soft is not None:
        cpu, seconds, process, pid = soft.groups()
        details = {"cpu": cpu, "seconds": seconds, "process": process, "pid": pid, "lockup": "soft"}
    elif (hard := _HARD_LOCKUP.search(line)) is not None:
        details = {"cpu": hard.group(1), "lockup": "hard"}
    else:
        return None
    return make_event(
        "soft_lockup",
        "error",
        f"a CPU is stuck in the kernel: {line.strip()}",
        source,
        ts,
        action="the node is unhealthy: drain it and collect a crash dump if it repeats",
        **details,
    )


_OOM = re.compile(r"(Memory cgroup )?[Oo]ut of memory: Kill(?:ed)? process (\d+) \((.+?)\)")
_OOM_KILL = re.compile(r"oom-kill:constraint=(\w+),.*?task=([^,]*),pid=(\d+)")
_OOM_LEGACY = re.compile(r"^(?:.*\] )?Killed process (\d+) \((.+?)\) total-vm:")


def _oom_killer(line: str, source: str, ts: float) -> Event | None:
    if "emory" not in line and "oom-kill:" not in line and "Killed process" not in line:
        return None
    constraint = ""
    if (oom := _OOM.search(line)) is not None:
        memcg, pid, process = oom.groups()
        constraint = "CONSTRAINT_MEMCG" if memcg else ""
    elif (kill := _OOM_KILL.search(line)) is not None:
        constraint, process, pid = kill.groups()
    elif (legacy := _OOM_LEGACY.search(line)) is not None:
        pid, process = legacy.groups()
    else:
        return None
    # A container over its own limit is that job's problem; the whole node out of memory is everyone's.
    limited = constraint == "CONSTRAINT_MEMCG"
    return make_event(
        "oom_killer",
        "warning" if limited else "error",
        f"the kernel's OOM killer killed {process} (pid {pid}): {line.strip()}",
        source,
        ts,
        pid=pid,
        process=process,
        constraint=constraint,
        action="a killed trainer rank ends the job: lower host memory use (dataloader workers, pinned memory) or raise the limit",
    )


_PANIC = re.compile(r"Kernel [Pp]anic - not syncing: ?(.*)")


def _panic(line: str, source: str, ts: float) -> Event | None:
    match = _PANIC.search(line)
    if match is None:
        return None
    return make_event(
        "kernel_panic",
        "critical",
        f"the kernel panicked: {line.strip()}",
        source,
        ts,
        reason=match.group(1).strip().rstrip("]-").strip()[:200],
        action="the node went down: keep it out until the panic's cause (in the reason) is understood",
    )


# ------------------------------------------------------------------- disks

_DISK_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"md/raid\S*: Disk failure on (\S+?) detected, failing array"), "critical"),
    (re.compile(r"(?:blk_update_request: )?(?:critical )?(?:I/O|medium|target|critical target) error, dev (\S+?), sector (\d+)"), "error"),
    (re.compile(r"Buffer I/O error on dev(?:ice)? (\S+?), logical block (\d+)"), "error"),
    (re.compile(r"EXT4-fs error \(device (\S+?)\)"), "error"),
    (re.compile(r"(?:EXT[234]-fs|XFS|BTRFS)(?: warning)? ?\(?(?:device )?(\S*?)\)?:? .*I/O error"), "error"),
    (re.compile(r"(?:EXT[234]-fs|XFS|BTRFS)[^:]*?\(?(\S*?)\)?: Remounting filesystem read-only"), "error"),
    (re.compile(r"^(?:.*\s)?Remounting filesystem read-only"), "error"),
    (re.compile(r"BTRFS (?:error|critical) \(device (\S+?)\)"), "error"),
    (re.compile(r"XFS \((\S+?)\): (?:Corruption|metadata I/O error|log I/O error|Filesystem has been shut down)"), "error"),
    (re.compile(r"nvme (nvme\d+): I/O .*timeout, (?:reset controller|aborting|completion polled)"), "error"),
    (re.compile(r"nvme (nvme\d+): (?:Disabling device after reset failure|controller is down; will reset|Device not ready; aborting)"), "critical"),
    (re.compile(r"block (nvme\S+?): no available path - failing I/O"), "error"),
    (re.compile(r"attempt to access beyond end of device"), "warning"),
)
_SECTOR = re.compile(r"sector (\d+)")


_DISK_WORDS = re.compile(r"I/O|error|read-only|failing|nvme|beyond end")


def _disk(line: str, source: str, ts: float) -> Event | None:
    if _DISK_WORDS.search(line) is None:
        return None
    for pattern, severity in _DISK_PATTERNS:
        match = pattern.search(line)
        if match is None:
            continue
        device = match.group(1) if match.groups() else ""
        sector = _SECTOR.search(line)
        return make_event(
            "disk_io_error",
            severity,
            f"a disk or filesystem failed I/O; checkpoints and data on it are at risk: {line.strip()}",
            source,
            ts,
            device=device or "",
            sector=sector.group(1) if sector else "",
            action="check the device (smartctl, nvme smart-log); stop writing checkpoints there and drain if it is the node's scratch",
        )
    return None


# Order matters: an Xid line that says "fallen off the bus" is the XID; a panic that
# mentions out of memory is the panic; GSP and init lines are checked before the
# generic fell-off-the-bus line.
DETECTORS: tuple[Detector, ...] = (
    _xid,
    _sxid,
    _gsp,
    _init_failure,
    _off_bus,
    _fabric_manager,
    _peermem,
    _panic,
    _hung_task,
    _lockup,
    _oom_killer,
    _edac,
    _aer,
    _nic,
    _disk,
)
