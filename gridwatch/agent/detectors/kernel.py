"""Detectors for what the kernel, the GPU driver and the host write: XIDs, GSP, NVLink, NVSwitch, NICs, PCIe, machine checks, memory, disks.

Each event carries what an operator needs to act: the PCI id, the device or
port, the code, and in ``details["action"]`` what to do about it. The line
shapes are the drivers' own (``NVRM:``, ``nvidia-nvswitch``, ``mlx5_core``,
``pcieport``, ``EDAC``, ...), as ``/dev/kmsg``, ``dmesg``, ``kern.log`` and
the journal show them, with or without a timestamp or syslog prefix. A few
lines come from root's own tools beside the kernel (``nvidia-smi`` naming a GPU
the driver lost, ``systemd-networkd`` losing a port's carrier): they are read
from the journal's named units, never from an application's log.
"""

from __future__ import annotations

import re

from gridwatch.agent.detectors.common import Detector, by_first_character, make_event, remember
from gridwatch.agent.sources.pci import pci_key
from gridwatch.wire.protocol import Event, Text
from gridwatch.wire.xid import xid_meaning, xid_resolution, xid_severity

# The words any line of this module's kinds contains; a line without them costs one search.
# Every branch starts with a plain character, never a class ("Link|link", not "[Ll]ink"): the
# regex engine then skips to the positions where a branch can begin (measured 6x faster a line).
# Grouped by first character (common.by_first_character), each position costs one branch, not all.
PREFILTER = by_first_character(
    r"NVRM|SXid|nvswitch|NVSwitch|fabricmanager|fabric manager|\] \[ERROR\]|peermem|nv_peer_mem"
    r"|Link (?:is )?[Dd]own|link (?:is )?[Dd]own|link status definitely down|NETDEV WATCHDOG|Port module event"
    r"|AER|PCIe Bus Error|EDAC|blocked for more than|soft lockup|hard LOCKUP"
    r"|Out of memory|out of memory|oom-kill:|Killed process|Kernel [Pp]anic"
    r"|I/O error|EXT4-fs error|XFS \(|BTRFS|nvme|read-only|failing array|beyond end of device"
    r"|GSP task watchdog|Unable to determine the device handle|Hardware Error|Machine check events|Lost carrier"
    r"|oom_reaper|Will cause a leak|health compromised|Detected insufficient power"
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


# The GPU's firmware (GSP) stopped answering, crashed, or told the driver that an engine it runs
# is gone; or the driver gave up on the GPU until it is reset. Each is one line of the driver's
# report (the RPC history, register dumps and "Note: please also check logs above" around it are
# not), and whatever the reason the GPU must be reset before it can be trusted again.
_GSP = re.compile(
    r"Timeout (?:waiting for RPC from GSP|after \d+s of waiting for RPC response)|rpcRecvPoll timedout"
    r"|GSP RPC timeout|\*{8,} GSP Timeout \*{8,}|GSP RM heartbeat timed out|_kgspIsHeartbeatTimedOut|Heartbeat timed out"
    r"|Rate limiting GSP RPC error prints|GPU marked for reset|NV_ERR_RESET_REQUIRED|NV_ERR_GPU_IN_FULLCHIP_RESET"
    r"|GSP-CrashCat Report|LibOS Task Watchdog Report|kgspHealthCheck.*fail|PMU has halted|Memory Subsystem Error detected"
)
# The watchdog's line of a GSP crash report, which the journal can show without the NVRM prefix.
_GSP_WATCHDOG = "GSP task watchdog timeout @ pc:"
_DRIVER_GPU = re.compile(r"\bGPU(\d+)\b")


def _gsp_reason(said: str) -> str:
    """What the driver's line means, for the operator (the most specific of what it says)."""
    if "eartbeat" in said:
        return "the GSP firmware's heartbeat stopped"
    if "Rate limiting" in said:
        return "GSP RPCs keep failing; the driver says the GPU likely needs a reset"
    if "CrashCat" in said or "atchdog" in said or "kgspHealthCheck" in said:
        return "the GSP firmware crashed"
    if "PMU" in said:
        return "the GPU's power management unit (PMU) halted"
    if "Memory Subsystem" in said:
        return "the GPU's memory subsystem stopped responding"
    if "reset" in said or "RESET" in said:
        return "the driver holds the GPU for a reset"
    return "a GSP RPC timed out"


def _gsp(line: str, source: str, ts: float) -> Event | None:
    driver = line.find("NVRM: ")
    # Searched from the driver's prefix on: a plain alternation, not "NVRM: .*(...)", which backtracks.
    if (driver < 0 or _GSP.search(line, driver) is None) and _GSP_WATCHDOG not in line:
        return None
    reason = _gsp_reason(line)
    gpu = _DRIVER_GPU.search(line)
    return make_event(
        "gsp_error",
        "critical",
        f"GPU firmware fault ({reason}): {line.strip()}",
        source,
        ts,
        pci_bus_id=_pci(line.split("NVRM:", 1)[-1]),
        driver_gpu=gpu.group(1) if gpu else "",
        reason=reason,
        action="reset the GPU (nvidia-smi -r) once it is idle; reboot if the reset fails",
    )


# nvidia-smi (NVML) cannot get a handle for a GPU the driver lost ("Unknown Error", or "GPU is
# lost" when NVML knows it): the same loss as a GPU off the bus. The line is root's tool's, so it
# is trusted only from a named journal unit or a root-only log, never from a job's own output.
_NVML_LOST = re.compile(
    r"Unable to determine the device handle for (?:GPU ?)?([0-9A-Fa-f]{3,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?): "
    r"(Unknown Error|GPU is lost)"
)


def _nvml_lost(line: str, source: str, ts: float) -> Event | None:
    if "Unable to determine the device handle" not in line:
        return None
    match = _NVML_LOST.search(line)
    if match is None:
        return None
    bus, error = match.groups()
    return make_event(
        "fell_off_bus",
        "critical",
        f"NVML cannot reach a GPU the driver has lost ({error}): {line.strip()}",
        source,
        ts,
        pci_bus_id=pci_key(bus),
        error=error,
        action="reboot the node; if it returns, inspect the GPU's power, cooling and seating",
    )


# ------------------------------------------------------------------- NVLink

# The driver's NVLink code (its knvlink* functions) reports links that failed to train or a
# peer's link mask it could not read, with no XID: those links are down, and collectives
# over NVLink hang or fall back to PCIe until the GPUs are reset (gpud treats the post-RX
# link-mask failure as needing a reboot). Two of its LEVEL_ERROR prints are not faults:
# "Need to shutdown all links unilaterally" on every ordinary unload or reset where a peer
# went first, and a fabric base address being assigned.
_KNVLINK = re.compile(r"NVRM: (?:GPU(\d+) )?(knvlink\w+): (.*)")
_KNVLINK_FAULT = re.compile(r"[Ff]ail|Timedout|timed out|Unable to|[Ee]rror")
_KNVLINK_BENIGN = ("shutdown all links unilaterally", "is assigned to GPU")
_PEER = re.compile(r"\bpeer ?(\d+)")


def _nvlink(line: str, source: str, ts: float) -> Event | None:
    if "knvlink" not in line:
        return None
    match = _KNVLINK.search(line)
    if match is None:
        return None
    gpu, function, said = match.groups()
    if _KNVLINK_FAULT.search(said) is None or any(benign in said for benign in _KNVLINK_BENIGN):
        return None
    peer = _PEER.search(said)
    return make_event(
        "nvlink_error",
        "critical",
        f"NVLink links failed in the driver (training or link mask); collectives over NVLink hang or slow down: {line.strip()}",
        source,
        ts,
        pci_bus_id=_pci(said),
        driver_gpu=gpu or "",
        function=function,
        peer=peer.group(1) if peer else "",
        action="drain the node and reset its GPUs (or reboot); check Fabric Manager and the NVLink status (nvidia-smi nvlink -s)",
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
# systemd-networkd's "<port>: Lost carrier" for a training port (InfiniBand, Ethernet, a bond of
# them); a wireless card, a container's veth or a bridge losing its carrier is not the job's link.
_CARRIER = re.compile(r"(?:^|[\s:])((?:ib|en|eth|bond|team)[\w.@-]*): Lost carrier\b")


def _nic(line: str, source: str, ts: float) -> Event | None:
    if "ink" not in line and "NETDEV WATCHDOG" not in line and "Port module event" not in line and "Lost carrier" not in line:
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
    elif "Lost carrier" in line:
        carrier = _CARRIER.search(line)
        if carrier is None:
            return None
        device, reason = carrier.group(1), "lost carrier"
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


# The ConnectX (mlx5) driver's reports that the adapter itself is failing, not one link: its
# firmware stopped completing commands or answering the health poll, or its slot cannot give
# it the power it needs. RDMA through it (NCCL over InfiniBand or RoCE) fails or degrades until
# the adapter is reset or replaced. "PCIe slot power capability was not advertised" is a notice
# many servers print at boot, and "No done completion" the line before a command's timeout.
_MLX5_FAULTS: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"timeout\. Will cause a leak of a command resource"), "error", "the adapter's firmware did not complete a command"),
    (re.compile(r"health compromised - reached miss count"), "critical", "the adapter's firmware stopped answering its health poll"),
    (re.compile(r"Detected insufficient power on the PCIe slot \((\d+W)\)"), "warning", "the adapter's PCIe slot gives it too little power"),
)


def _mlx5(line: str, source: str, ts: float) -> Event | None:
    if "mlx5" not in line:
        return None
    for pattern, severity, what in _MLX5_FAULTS:
        if pattern.search(line) is None:
            continue
        return make_event(
            "nic_error",
            severity,
            f"network adapter fault ({what}); RDMA through it fails or slows: {line.strip()}",
            source,
            ts,
            pci_bus_id=_pci(line),
            reason=what,
            action=(
                "check the slot's power budget and the riser; the adapter may throttle or drop off"
                if severity == "warning"
                else "drain the node, then reset the adapter (mlxfwreset) or reboot; replace it if the fault returns"
            ),
        )
    return None


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


# Machine checks: the CPU, its caches, memory or PCIe reporting a hardware error. One report is
# many "[Hardware Error]" lines; its event is the line that says how bad it was, the others
# (section type, addresses, status words, "It has been corrected...") are its detail:
# - APEI/GHES (firmware first): "event severity: fatal|recoverable|corrected|informational".
#   After a reboot, BERT replays the previous boot's fatal error the same way.
# - The kernel's own MCE handler: "Machine Check Exception" is an uncorrected error being
#   raised (a panic follows); "Machine check events logged" says mcelog or rasdaemon holds the
#   details (it does not say how bad, hence a warning). The per-bank "CPU n: Machine Check:
#   ... Bank n: <status>" lines and AMD's decoded "[Hardware Error]: Corrected error, no action
#   required." lines are the detail of that summary.
_APEI = re.compile(r"\[Hardware Error\]: +event severity: (fatal|recoverable|corrected|informational)")
_MCE_EXCEPTION = re.compile(r"CPU (\d+): Machine Check Exception: \d+ Bank (\d+): ([0-9a-fA-F]+)")
_APEI_SEVERITY = {"fatal": "critical", "recoverable": "error", "corrected": "info", "informational": "info"}
_MCE_ACTION = {
    "critical": "an uncorrected hardware error: drain the node and have the CPU, DIMMs or device inspected (rasdaemon, mcelog, the BMC's event log)",
    "error": "an uncorrected error the platform contained: drain the node at the next checkpoint and find the part in rasdaemon or the BMC's event log",
    "warning": "read mcelog or rasdaemon (ras-mc-ctl --errors) for which part; machine checks that repeat need the hardware inspected",
    "info": "corrected by the hardware; only a rate of them needs the DIMM or CPU replaced",
}


def _machine_check(line: str, source: str, ts: float) -> Event | None:
    if "Hardware Error" not in line and "Machine check events" not in line:
        return None
    details: dict[str, str] = {}
    if (apei := _APEI.search(line)) is not None:
        severity = _APEI_SEVERITY[apei.group(1)]
        details["error_severity"] = apei.group(1)
    elif (exc := _MCE_EXCEPTION.search(line)) is not None:
        severity = "critical"
        details.update(cpu=exc.group(1), bank=exc.group(2), status=exc.group(3), error_severity="uncorrected")
    elif "Machine check events logged" in line:
        severity = "warning"
    else:
        return None
    return make_event(
        "machine_check",
        severity,
        f"the host reported a hardware error (machine check): {line.strip()}",
        source,
        ts,
        action=_MCE_ACTION[severity],
        **details,
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


# "Out of memory: Killed process 123 (python)", and RHEL's "Out of memory: Killed process 123, UID 48, (httpd)".
_OOM = re.compile(r"(Memory cgroup )?[Oo]ut of memory: Kill(?:ed)? process (\d+)(?:, UID \d+,)? \((.+?)\)")
# The reaper freeing a killed task's memory: the same kill when the kill's own line came first.
_OOM_REAPER = re.compile(r"oom_reaper: reaped process (\d+) \((.+?)\)")
_OOM_KILLED: dict[str, str] = {}  # per log, the pid of the last kill reported
_OOM_KILL = re.compile(r"oom-kill:constraint=(\w+),.*?task=([^,]*),pid=(\d+)")
_OOM_LEGACY = re.compile(r"^(?:.*\] )?Killed process (\d+) \((.+?)\) total-vm:")


def _oom_killer(line: str, source: str, ts: float) -> Event | None:
    if "emory" not in line and "oom-kill:" not in line and "Killed process" not in line and "oom_reaper" not in line:
        return None
    constraint = ""
    if (reaped := _OOM_REAPER.search(line)) is not None:
        pid, process = reaped.groups()
        if _OOM_KILLED.get(source) == pid:
            return None  # the kill was reported by the line before: one kill, one event
    elif (oom := _OOM.search(line)) is not None:
        memcg, pid, process = oom.groups()
        constraint = "CONSTRAINT_MEMCG" if memcg else ""
    elif (kill := _OOM_KILL.search(line)) is not None:
        constraint, process, pid = kill.groups()
    elif (legacy := _OOM_LEGACY.search(line)) is not None:
        pid, process = legacy.groups()
    else:
        return None
    remember(_OOM_KILLED, source, pid)
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


# Order matters: an Xid line that says "fallen off the bus" (or names an NVLink) is the XID;
# a panic that mentions out of memory or a machine check is the panic; GSP and init lines
# are checked before the generic fell-off-the-bus line; a ConnectX adapter's own fault is
# checked before the link detector reads its line.
DETECTORS: tuple[Detector, ...] = (
    _xid,
    _sxid,
    _gsp,
    _init_failure,
    _off_bus,
    _nvml_lost,
    _nvlink,
    _fabric_manager,
    _peermem,
    _panic,
    _hung_task,
    _lockup,
    _oom_killer,
    _edac,
    _machine_check,
    _aer,
    _mlx5,
    _nic,
    _disk,
)
