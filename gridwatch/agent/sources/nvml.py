"""GPUs read through NVML (``pynvml``): one handle per GPU, every field N/A-safe."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from loguru import logger

from gridwatch.agent.jobs import _job_key, _user
from gridwatch.agent.sources import FaultNotSupported, GpuSource
from gridwatch.agent.sources.gpm import GpmReader
from gridwatch.agent.sources.pci import pci_key
from gridwatch.wire.protocol import Event, GpuInfo, GpuSample, Text, clean_text
from gridwatch.wire.readings import GpuProcess
from gridwatch.wire.throttle import decode_throttle
from gridwatch.wire.xid import xid_meaning, xid_resolution, xid_severity

# NVML's "blank" values: the field exists but has no reading (nvitop's N/A).
_BLANK = {0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF, -1}
_MAX_EVENTS_PER_POLL = 256
# NVLink error counters take four calls per active link (72 per H100): read
# them every tenth tick. They only ever count up, so a late reading loses nothing.
NVLINK_EVERY = 10
_MIB = 1024 * 1024
# The processes on a GPU (nvitop's list). The driver call behind them is the one `procs` has always
# made every tick (the reset guard needs a current count), so listing them adds no driver call; what
# it adds is reading /proc/PID (status, cmdline, cgroup), and that is done once per process: its
# user, command and job are cached by PID for as long as NVML keeps listing it, and only its GPU
# memory is new each tick. A GPU listing more than this many is shown with its first ones.
MAX_PROCESSES = 32
_COMMAND_CHARS = 120
_CMDLINE_BYTES = 4096


class _Lost(Exception):
    """The GPU answered NVML_ERROR_GPU_IS_LOST: it has fallen off the bus."""


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> Any:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


class _Device:
    """One GPU: its handle, static facts, the fields it turned out not to support."""

    def __init__(self, index: int, handle: Any) -> None:
        self.index = index
        self.handle = handle
        self.unsupported: set[str] = set()
        self.nvlinks: list[int] = []
        self.lost = False
        self.ticks = 0
        self.nvlink_errors: int | None = None
        self.info = GpuInfo(index=index, uuid=Text(""), name=Text(""))
        self.gpm: GpmReader | None = None  # None: no GPM (before Hopper), profiling fields N/A
        self.owners: dict[int, tuple[Text, Text, Text] | None] = {}  # pid -> (user, command, job); None: gone


class NvmlSource(GpuSource):
    """Real GPUs through NVML; what the device cannot report is ``None``, never zero.

    Expects ``nvml.nvmlInit()`` to have succeeded (see :func:`open_gpu_source`).
    Handles, static facts, NVLink topology and the event set are set up once;
    a field that answers NotSupported is not asked again.
    """

    name = "nvml"
    blocking = True  # an NVML call can hang on a degrading GPU
    simulated = False

    def __init__(
        self, nvml: ModuleType, clock: Callable[[], float] = time.time, proc_root: str = "/proc"
    ) -> None:
        self._nv = nvml
        self._proc_root = proc_root
        self._clock = clock
        self._events: list[Event] = []
        self._driver = _driver_version(nvml)
        self._devices = [_Device(i, self._handle(i)) for i in range(nvml.nvmlDeviceGetCount())]
        self._by_handle = {_handle_key(d.handle): d for d in self._devices if d.handle is not None}
        for dev in self._devices:
            self._describe(dev)
        self._event_set = self._register_events()

    def _handle(self, index: int) -> Any:
        """``nvmlDeviceGetHandleByIndex``; ``None`` for a GPU already unreachable at start."""
        try:
            return self._nv.nvmlDeviceGetHandleByIndex(index)
        except self._nv.NVMLError as exc:
            logger.error("GPU {}: no NVML handle ({}); reporting it as lost", index, exc)
            return None

    # ------------------------------------------------------------------ reading

    def _call(self, dev: _Device, name: str, *args: Any) -> Any:
        """``nvml.<name>(handle, *args)``, or ``None`` when NVML cannot answer.

        NotSupported (and a function the driver lacks) is remembered so the
        next tick skips it; GPU_IS_LOST raises :class:`_Lost`.
        """
        if dev.handle is None:
            raise _Lost
        key = name if not args else f"{name}{args}"
        if key in dev.unsupported:
            return None
        nv = self._nv
        try:
            value = getattr(nv, name)(dev.handle, *args)
        except nv.NVMLError_GpuIsLost:
            raise _Lost from None
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound, AttributeError):
            dev.unsupported.add(key)
            return None
        except nv.NVMLError as exc:
            logger.debug("GPU {}: {} failed: {}", dev.index, name, exc)
            return None
        if isinstance(value, int) and value in _BLANK:
            return None
        return value

    def _describe(self, dev: _Device) -> None:
        """Static facts (``nvidia-smi -L``, ``nvidia-smi -q``): UUID, name, PCI bus id, serial, NVLinks."""
        try:
            pci = self._call(dev, "nvmlDeviceGetPciInfo")
            mem = self._call(dev, "nvmlDeviceGetMemoryInfo")
            dev.info = GpuInfo(
                index=dev.index,
                uuid=Text(_text(self._call(dev, "nvmlDeviceGetUUID") or "")),
                name=Text(_text(self._call(dev, "nvmlDeviceGetName") or "")),
                pci_bus_id=Text(pci_key(_text(pci.busId))) if pci is not None else None,
                memory_total_mb=mem.total / _MIB if mem is not None else None,
                serial=Text(_text(s)) if (s := self._call(dev, "nvmlDeviceGetSerial")) else None,
                driver=Text(self._driver) if self._driver else None,
            )
            # Links that are down or absent stay out of the per-tick error sum.
            for link in range(getattr(self._nv, "NVML_NVLINK_MAX_LINKS", 18)):
                state = self._call(dev, "nvmlDeviceGetNvLinkState", link)
                if state is None:
                    break
                if state:
                    dev.nvlinks.append(link)
            dev.unsupported = {k for k in dev.unsupported if not k.startswith("nvmlDeviceGetNvLinkState")}
            try:
                dev.gpm = GpmReader.open(self._nv, dev.handle, dev.nvlinks)
            except self._nv.NVMLError_GpuIsLost:
                raise _Lost from None
        except _Lost:
            self._mark_lost(dev)

    def info(self) -> list[GpuInfo]:
        """Static facts of each GPU, read once at start."""
        return [d.info for d in self._devices]

    def sample(self) -> list[GpuSample]:
        """One reading of every GPU (``nvidia-smi -q``); never raises."""
        out = []
        for dev in self._devices:
            try:
                out.append(self._read(dev))
                if dev.lost:
                    logger.warning("GPU {} answers again after being lost", dev.index)
                    dev.lost = False
            except _Lost:
                self._mark_lost(dev)
                out.append(GpuSample(index=dev.index, state=Text("lost")))
            except Exception as exc:  # a driver quirk must cost one reading, not the agent
                logger.opt(exception=exc).warning("GPU {}: reading failed: {}", dev.index, exc)
                out.append(GpuSample(index=dev.index))
        return out

    def _read(self, dev: _Device) -> GpuSample:
        nv, call = self._nv, self._call
        s = GpuSample(index=dev.index)
        # nvidia-smi: utilization.gpu, utilization.memory
        if (u := call(dev, "nvmlDeviceGetUtilizationRates")) is not None:
            s.util, s.mem_util = _num(u.gpu), _num(u.memory)
        # nvidia-smi: memory.used, memory.total (bytes -> MiB)
        # nvidia-smi: memory.reserved needs the v2 struct; drivers without it answer v1
        m = call(dev, "nvmlDeviceGetMemoryInfo", nv.nvmlMemory_v2) if hasattr(nv, "nvmlMemory_v2") else None
        if m is not None:
            s.mem_reserved_mb = _num(m.reserved, _MIB)
        else:
            m = call(dev, "nvmlDeviceGetMemoryInfo")
        if m is not None:
            s.mem_used_mb = _num(m.used, _MIB)
            s.mem_total_mb = _num(m.total, _MIB)
        # nvidia-smi: temperature.gpu
        s.temp_c = _num(call(dev, "nvmlDeviceGetTemperature", nv.NVML_TEMPERATURE_GPU))
        # nvidia-smi: power.draw (mW -> W); total energy (mJ -> J) since the driver loaded
        s.power_w = _num(call(dev, "nvmlDeviceGetPowerUsage"), 1000)
        s.energy_j = _num(call(dev, "nvmlDeviceGetTotalEnergyConsumption"), 1000)
        # nvidia-smi: clocks.sm, clocks.mem
        s.sm_clock_mhz = _num(call(dev, "nvmlDeviceGetClockInfo", nv.NVML_CLOCK_SM))
        s.mem_clock_mhz = _num(call(dev, "nvmlDeviceGetClockInfo", nv.NVML_CLOCK_MEM))
        # nvidia-smi dmon -s t: PCIe tx/rx KB/s over the last 20 ms; replay counter
        s.pcie_tx_kbs = _num(call(dev, "nvmlDeviceGetPcieThroughput", nv.NVML_PCIE_UTIL_TX_BYTES))
        s.pcie_rx_kbs = _num(call(dev, "nvmlDeviceGetPcieThroughput", nv.NVML_PCIE_UTIL_RX_BYTES))
        s.pcie_replay = call(dev, "nvmlDeviceGetPcieReplayCounter")
        # nvidia-smi -q -d ECC: volatile corrected / uncorrected totals
        s.ecc_sbe = call(
            dev, "nvmlDeviceGetTotalEccErrors", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC
        )
        s.ecc_dbe = call(
            dev, "nvmlDeviceGetTotalEccErrors", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
        )
        # nvidia-smi -q -d PAGE_RETIREMENT (pre-Ampere) or ROW_REMAPPER (Ampere and later)
        sbe_pages = call(dev, "nvmlDeviceGetRetiredPages", nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        dbe_pages = call(dev, "nvmlDeviceGetRetiredPages", nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        if sbe_pages is not None or dbe_pages is not None:
            s.retired_pages = len(sbe_pages or []) + len(dbe_pages or [])
        if (rows := call(dev, "nvmlDeviceGetRemappedRows")) is not None:
            s.remapped_rows_pending, s.remapped_rows_failed = bool(rows[2]), bool(rows[3])
            s.remapped_rows_correctable, s.remapped_rows_uncorrectable = int(rows[0]), int(rows[1])
        # nvidia-smi -q -d PERFORMANCE: clocks event (throttle) reasons
        mask = call(dev, "nvmlDeviceGetCurrentClocksEventReasons")
        if mask is None:
            mask = call(dev, "nvmlDeviceGetCurrentClocksThrottleReasons")
        if mask is not None:
            s.throttle = [Text(n) for n in decode_throttle(mask)]
        # nvidia-smi nvlink -e: replay, recovery and CRC errors over active links
        if dev.nvlinks and dev.ticks % NVLINK_EVERY == 0:
            total, seen = 0, False
            for link in dev.nvlinks:
                for counter in _nvlink_counters(nv):
                    value = call(dev, "nvmlDeviceGetNvLinkErrorCounter", link, counter)
                    if value is not None:
                        total, seen = total + value, True
            dev.nvlink_errors = total if seen else None
        s.nvlink_errors = dev.nvlink_errors
        dev.ticks += 1
        self._read_more(dev, s)
        # nvidia-smi --query-compute-apps=pid,used_memory (v3 where the bindings have it; NotSupported
        # or NoPermission on one GPU: its processes are not readable, the rest of the sample stands)
        name = "nvmlDeviceGetComputeRunningProcesses"
        v3 = name + "_v3"
        procs = call(dev, v3) if hasattr(nv, v3) and v3 not in dev.unsupported else None
        if procs is None and (not hasattr(nv, v3) or v3 in dev.unsupported):
            procs = call(dev, name)
        if procs is not None:
            s.procs = len(procs)
            s.processes = self._processes(dev, procs)
        return s

    def _processes(self, dev: _Device, procs: list[Any]) -> list[GpuProcess]:
        """Each listed process with its owner, command and job from /proc; one gone meanwhile is left out."""
        out: list[GpuProcess] = []
        seen: dict[int, tuple[Text, Text, Text] | None] = {}
        for p in procs:
            pid = getattr(p, "pid", None)
            if not isinstance(pid, int) or pid <= 0 or pid in seen:
                continue
            if len(out) >= MAX_PROCESSES:
                break
            owner = dev.owners[pid] if pid in dev.owners else _proc_owner(self._proc_root, pid)
            seen[pid] = owner
            if owner is None:
                continue
            used = getattr(p, "usedGpuMemory", None)
            user, command, job = owner
            out.append(GpuProcess(pid=pid, user=user, used_mb=_num(used, _MIB), command=command, job=job))
        dev.owners = seen
        return out

    def _read_more(self, dev: _Device, s: GpuSample) -> None:
        """The rest of dcgm-exporter's default fields, and the GPM profiling fields."""
        nv, call = self._nv, self._call
        # nvidia-smi: encoder.stats / utilization.encoder, utilization.decoder
        if (enc := call(dev, "nvmlDeviceGetEncoderUtilization")) is not None:
            s.enc_util = _num(enc[0])
        if (dec := call(dev, "nvmlDeviceGetDecoderUtilization")) is not None:
            s.dec_util = _num(dec[0])
        # nvidia-smi -q -d TEMPERATURE: memory (HBM) temperature; NVLink raw bytes (KiB) per active link
        wanted = [getattr(nv, "NVML_FI_DEV_MEMORY_TEMP", 82)]
        for link in dev.nvlinks:
            wanted += [(nv.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX, link), (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX, link)]
        if (values := call(dev, "nvmlDeviceGetFieldValues", wanted)) is not None:
            read = [_field_value(v) for v in values]
            s.mem_temp_c = read[0]
            links = [v for v in read[1:] if v is not None]
            s.nvlink_bytes = sum(links) * 1024 if links else None
        # dcgm reports 0 unless the GPU is a vGPU guest, where it says whether it holds a license
        mode = call(dev, "nvmlDeviceGetVirtualizationMode")
        if mode is not None:
            s.vgpu_license_status = 0
            if mode == getattr(nv, "NVML_GPU_VIRTUALIZATION_MODE_VGPU", 2):
                grid = call(dev, "nvmlDeviceGetGridLicensableFeatures")
                features = grid.gridLicensableFeatures[: grid.licensableFeaturesCount] if grid is not None else []
                s.vgpu_license_status = int(any(f.featureState for f in features))
        # nvidia-smi has no equivalent: dcgmi dmon -e 1001,1002,1003,1004,1005,1009,1010,1011,1012
        if dev.gpm is not None:
            try:
                gpm = dev.gpm.read()
            except nv.NVMLError_GpuIsLost:
                raise _Lost from None
            if gpm is not None:
                for attr, value in gpm.values.items():
                    setattr(s, attr, value)
                s.nvlink_link_tx_bps, s.nvlink_link_rx_bps = gpm.link_tx_bps, gpm.link_rx_bps

    def _mark_lost(self, dev: _Device) -> None:
        if dev.lost:
            return
        dev.lost = True
        logger.error("GPU {} has fallen off the bus (NVML_ERROR_GPU_IS_LOST)", dev.index)
        self._events.append(
            Event(
                kind=Text("fell_off_bus"),
                severity=Text("critical"),
                message=Text(f"GPU {dev.index}: GPU is lost (fell off the bus); every read fails"),
                gpu=dev.index,
                source=Text("nvml"),
                ts=self._clock(),
                details={"pci_bus_id": dev.info.pci_bus_id or Text(""), "uuid": dev.info.uuid},
            )
        )

    # ------------------------------------------------------------------ events

    def _register_events(self) -> Any:
        """``nvmlEventSetCreate`` + ``nvmlDeviceRegisterEvents`` for critical XIDs and ECC errors."""
        nv = self._nv
        wanted = (
            nv.nvmlEventTypeXidCriticalError
            | nv.nvmlEventTypeDoubleBitEccError
            | nv.nvmlEventTypeSingleBitEccError
        )
        try:
            event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            logger.warning("NVML events unavailable ({}); XIDs come from the kernel log only", exc)
            return None
        for dev in self._devices:
            if dev.handle is None:
                continue
            try:
                supported = nv.nvmlDeviceGetSupportedEventTypes(dev.handle)
                if supported & wanted:
                    nv.nvmlDeviceRegisterEvents(dev.handle, supported & wanted, event_set)
            except nv.NVMLError as exc:
                logger.warning("GPU {}: cannot register for NVML events: {}", dev.index, exc)
        return event_set

    def poll_events(self) -> list[Event]:
        """XIDs and ECC errors waiting in the event set (``nvmlEventSetWait_v2`` with timeout 0)."""
        out, self._events = self._events, []
        if self._event_set is None:
            return out
        nv = self._nv
        for _ in range(_MAX_EVENTS_PER_POLL):
            try:
                data = nv.nvmlEventSetWait_v2(self._event_set, 0)
            except nv.NVMLError_Timeout:
                break
            except nv.NVMLError as exc:
                logger.debug("nvmlEventSetWait_v2 failed: {}", exc)
                break
            out.append(self._event_from(data))
        return out

    def _event_from(self, data: Any) -> Event:
        nv = self._nv
        dev = self._by_handle.get(_handle_key(data.device))
        index = dev.index if dev is not None else None
        details = {"pci_bus_id": dev.info.pci_bus_id or Text(""), "uuid": dev.info.uuid} if dev else {}
        etype, xid = data.eventType, int(data.eventData)
        code: int | None = xid  # an ECC event has no code
        if etype & nv.nvmlEventTypeXidCriticalError:
            kind, severity, message = "xid", xid_severity(xid), f"XID {xid}: {xid_meaning(xid)}"
        elif etype & nv.nvmlEventTypeDoubleBitEccError:
            kind, severity, message, code = "ecc_dbe", "critical", "double-bit ECC error", None
        else:
            kind, severity, message, code = "ecc_sbe", "warning", "single-bit ECC error", None
        return Event(
            kind=Text(kind),
            severity=Text(severity),
            # An event from a handle no GPU of ours has: said of the node, never "GPU None".
            message=Text(f"GPU {index}: {message}" if index is not None else f"{message} on the node"),
            gpu=index,
            code=code,
            source=Text("nvml"),
            ts=self._clock(),
            details=details,
            resolution=Text(xid_resolution(code) if code is not None else ""),
        )

    # ------------------------------------------------------------------ the rest

    def inject(self, kind: str, gpu: int | None = None, code: int | None = None) -> str:
        raise FaultNotSupported("faults can only be injected into simulated GPUs (--simulate-gpus N)")

    def clear_faults(self) -> None:
        return None

    def close(self) -> None:
        nv = self._nv
        for dev in self._devices:
            if dev.gpm is not None:
                dev.gpm.close()
        try:
            if self._event_set is not None:
                nv.nvmlEventSetFree(self._event_set)
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            logger.debug("NVML shutdown: {}", exc)


def _proc_owner(root: str, pid: int) -> tuple[Text, Text, Text] | None:
    """A process's user, command line and Slurm job from /proc/PID; ``None`` when it has ended.

    Other users' text: cleaned and clipped. A field this agent may not read stays empty.
    """
    base = os.path.join(root, str(pid))
    try:
        with open(os.path.join(base, "status"), encoding="utf-8", errors="replace") as fh:
            status = fh.read(8192)
    except FileNotFoundError:
        return None
    except OSError:
        status = ""
    user = ""
    for line in status.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            if len(fields) > 1 and fields[1].isdigit():
                user = _user(int(fields[1]))
            break
    try:
        with open(os.path.join(base, "cmdline"), "rb") as fh:
            raw = fh.read(_CMDLINE_BYTES)
    except FileNotFoundError:
        return None
    except OSError:
        raw = b""
    command = " ".join(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part)
    try:
        with open(os.path.join(base, "cgroup"), encoding="utf-8", errors="replace") as fh:
            cgroup = fh.read(8192)
    except OSError:
        cgroup = ""
    key = _job_key(cgroup, None)
    job = key[1] if key is not None and key[0] == "slurm" else ""
    return Text(clean_text(user, 64)), Text(clean_text(command, _COMMAND_CHARS)), Text(clean_text(job, 32))


def _num(value: Any, scale: float = 1) -> float | None:
    if value is None or (isinstance(value, int) and value in _BLANK):
        return None
    return value / scale if scale != 1 else float(value)


def _field_value(value: Any) -> float | None:
    """One ``c_nvmlFieldValue_t`` as a number; ``None`` where its own return code is an error."""
    if value.nvmlReturn != 0:
        return None
    member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}.get(value.valueType)
    return None if member is None else _num(getattr(value.value, member))


def _driver_version(nv: ModuleType) -> str | None:
    """``nvmlSystemGetDriverVersion`` (the ``nvidia-smi`` header's "Driver Version")."""
    try:
        return _text(nv.nvmlSystemGetDriverVersion())
    except nv.NVMLError as exc:
        logger.debug("driver version unavailable: {}", exc)
        return None


def _nvlink_counters(nv: ModuleType) -> tuple[int, ...]:
    return (
        nv.NVML_NVLINK_ERROR_DL_REPLAY,
        nv.NVML_NVLINK_ERROR_DL_RECOVERY,
        nv.NVML_NVLINK_ERROR_DL_CRC_FLIT,
        nv.NVML_NVLINK_ERROR_DL_CRC_DATA,
    )


def open_gpu_source(simulate: int, seed: int = 0) -> tuple[GpuSource | None, list[str]]:
    """The node's GPU source and notes for the operator (each said once, here).

    ``simulate > 0`` gives that many simulated GPUs. Otherwise NVML: with no
    driver (or no ``pynvml``) the agent runs without GPUs and says so.
    """
    if simulate > 0:
        from gridwatch.agent.sources.simulated import SimulatedGpus

        note = f"simulated GPUs: {simulate} (seed {seed})"
        logger.info(note)
        return SimulatedGpus(simulate, seed), [note]
    try:
        import pynvml
    except ImportError:
        note = "nvidia-ml-py is not installed: running without GPUs"
        logger.warning(note)
        return None, [note]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        note = f"no NVIDIA driver: running without GPUs ({exc})"
        logger.warning(note)
        return None, [note]
    try:
        source = NvmlSource(pynvml)
    except pynvml.NVMLError as exc:
        note = f"NVIDIA driver present but GPUs unreadable: running without GPUs ({exc})"
        logger.error(note)
        return None, [note]
    if not source.info():
        source.close()
        note = "NVIDIA driver present but no GPUs found: running without GPUs"
        logger.warning(note)
        return None, [note]
    return source, [f"NVML: {len(source.info())} GPUs"]
