"""A fake ``pynvml`` module: NVML's names, constants and errors over configurable devices."""

from __future__ import annotations

import sys
import threading
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# Constants, with pynvml's names and values (tests/test_sources_nvml.py checks both).
CONSTANTS: dict[str, int] = {
    "NVML_SUCCESS": 0,
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_INVALID_ARGUMENT": 2,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_NOT_FOUND": 6,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_TIMEOUT": 10,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_UNKNOWN": 999,
    "NVML_TEMPERATURE_GPU": 0,
    "NVML_CLOCK_GRAPHICS": 0,
    "NVML_CLOCK_SM": 1,
    "NVML_CLOCK_MEM": 2,
    "NVML_PCIE_UTIL_TX_BYTES": 0,
    "NVML_PCIE_UTIL_RX_BYTES": 1,
    "NVML_MEMORY_ERROR_TYPE_CORRECTED": 0,
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
    "NVML_VOLATILE_ECC": 0,
    "NVML_AGGREGATE_ECC": 1,
    "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS": 0,
    "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR": 1,
    "NVML_NVLINK_MAX_LINKS": 36,
    "NVML_NVLINK_ERROR_DL_REPLAY": 0,
    "NVML_NVLINK_ERROR_DL_RECOVERY": 1,
    "NVML_NVLINK_ERROR_DL_CRC_FLIT": 2,
    "NVML_NVLINK_ERROR_DL_CRC_DATA": 3,
    "nvmlEventTypeSingleBitEccError": 0x1,
    "nvmlEventTypeDoubleBitEccError": 0x2,
    "nvmlEventTypePState": 0x4,
    "nvmlEventTypeXidCriticalError": 0x8,
    "nvmlEventTypeClock": 0x10,
    "nvmlClocksEventReasonGpuIdle": 0x1,
    "nvmlClocksEventReasonSwPowerCap": 0x4,
    "nvmlClocksEventReasonHwSlowdown": 0x8,
    "nvmlClocksEventReasonSwThermalSlowdown": 0x20,
    "nvmlClocksEventReasonHwThermalSlowdown": 0x40,
    "nvmlClocksEventReasonHwPowerBrakeSlowdown": 0x80,
    "NVML_FI_DEV_MEMORY_TEMP": 82,
    "NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX": 140,
    "NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX": 141,
    "NVML_VALUE_TYPE_DOUBLE": 0,
    "NVML_VALUE_TYPE_UNSIGNED_INT": 1,
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": 3,
    "NVML_GPU_VIRTUALIZATION_MODE_NONE": 0,
    "NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH": 1,
    "NVML_GPU_VIRTUALIZATION_MODE_VGPU": 2,
    "nvmlMemory_v2": 0x02000028,
    "NVML_GPM_METRICS_GET_VERSION": 1,
    "NVML_GPM_SUPPORT_VERSION": 1,
    "NVML_GPM_METRIC_MAX": 477,
    "NVML_GPM_METRIC_GRAPHICS_UTIL": 1,
    "NVML_GPM_METRIC_SM_UTIL": 2,
    "NVML_GPM_METRIC_SM_OCCUPANCY": 3,
    "NVML_GPM_METRIC_ANY_TENSOR_UTIL": 5,
    "NVML_GPM_METRIC_DRAM_BW_UTIL": 10,
    "NVML_GPM_METRIC_PCIE_TX_PER_SEC": 20,
    "NVML_GPM_METRIC_PCIE_RX_PER_SEC": 21,
    "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC": 60,
    "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC": 61,
    # Per link, read then write (RX, TX), links 0-17 as on an H100.
    **{f"NVML_GPM_METRIC_NVLINK_L{n}_RX_PER_SEC": 62 + 2 * n for n in range(18)},
    **{f"NVML_GPM_METRIC_NVLINK_L{n}_TX_PER_SEC": 63 + 2 * n for n in range(18)},
}


def busy_gpm(links: int = 18) -> dict[int, float]:
    """What GPM reports for a training H100 over one interval (% and MiB/s; written by us)."""
    values = {1: 96.0, 2: 81.0, 3: 34.0, 5: 47.0, 10: 42.0, 20: 30.5, 21: 61.0, 60: 12_000.0 * links, 61: 11_000.0 * links}
    for n in range(links):
        values[62 + 2 * n], values[63 + 2 * n] = 12_000.0, 11_000.0
    return values
# Error codes that get their own NVMLError subclass, named as pynvml names them.
ERROR_CLASSES: dict[str, int] = {
    "NVMLError_Uninitialized": 1,
    "NVMLError_InvalidArgument": 2,
    "NVMLError_NotSupported": 3,
    "NVMLError_NoPermission": 4,
    "NVMLError_NotFound": 6,
    "NVMLError_DriverNotLoaded": 9,
    "NVMLError_Timeout": 10,
    "NVMLError_LibraryNotFound": 12,
    "NVMLError_FunctionNotFound": 13,
    "NVMLError_GpuIsLost": 15,
    "NVMLError_Unknown": 999,
}
BLANK_UINT = 0xFFFFFFFF


class NVMLError(Exception):
    """Like pynvml's: ``NVMLError(code)`` builds the subclass for that code."""

    _classes: dict[int, type[NVMLError]] = {}

    def __new__(cls, value: int = 999) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._classes.get(value, NVMLError)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int = 999) -> None:
        super().__init__(value)

    def __str__(self) -> str:
        return f"NVML error {self.value}"


def _error_class(name: str, code: int) -> type[NVMLError]:
    def new(cls: type, *args: Any) -> NVMLError:
        obj = Exception.__new__(cls)
        obj.value = code
        return obj

    cls = type(name, (NVMLError,), {"__new__": new, "__init__": lambda self, *a: Exception.__init__(self, code)})
    NVMLError._classes[code] = cls
    return cls


_ERRORS = {name: _error_class(name, code) for name, code in ERROR_CLASSES.items()}


@dataclass
class FakeGpu:
    """One fake GPU. ``unsupported`` holds NVML function names that answer NotSupported."""

    index: int
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""
    bus_id: str = ""
    serial: str = "1654922000000"
    util: int = 97
    mem_util: int = 41
    mem_total: int = 81559 * 1024 * 1024
    mem_used: int = 70000 * 1024 * 1024
    temp: int = 66
    power_mw: int = 612_345
    energy_mj: int = 123_456_789
    sm_clock: int = 1980
    mem_clock: int = 2619
    pcie_tx: int = 21_000
    pcie_rx: int = 52_000
    replay: int = 0
    ecc_sbe: int = 0
    ecc_dbe: int = 0
    retired_sbe: list[int] = field(default_factory=list)
    retired_dbe: list[int] = field(default_factory=list)
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)
    throttle: int = 0
    nvlinks: int = 18
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)
    procs: int = 1
    # (pid, used bytes or None) per compute process; empty: ``procs`` processes with pids 1000, 1001 ...
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)
    blank: set[str] = field(default_factory=set)  # functions returning NVML_VALUE_NOT_AVAILABLE
    denied: set[str] = field(default_factory=set)  # functions answering NVML_ERROR_NO_PERMISSION
    lost: bool = False
    supported_events: int = 0x1 | 0x2 | 0x8
    calls: dict[str, int] = field(default_factory=dict)
    mem_temp: int = 71
    mem_reserved: int = 502 * 1024 * 1024
    enc_util: int = 0
    dec_util: int = 0
    nvlink_raw_kib: tuple[int, int] = (1_000, 2_000)  # (tx, rx) KiB per link, since driver load
    virtualization_mode: int = 0
    # GPM: Hopper and later. ``gpm`` is what nvmlGpmMetricsGet reports for an interval, by metric
    # id (in %, or MiB/s); an id not in it answers NVML_ERROR_NOT_SUPPORTED in its own slot.
    gpm_supported: bool = True
    gpm: dict[int, float] = field(default_factory=busy_gpm)
    # Functions that block until their event is set (a degrading GPU that stops answering).
    blocking: dict[str, threading.Event] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.uuid = self.uuid or f"GPU-00000000-0000-0000-0000-{self.index:012d}"
        self.bus_id = self.bus_id or f"00000000:{0x18 + self.index * 0x10:02X}:00.0"


@dataclass
class FakeEvent:
    gpu: int
    event_type: int
    data: int


@dataclass
class FakeNvml:
    """The state behind the fake module; tests change it between ticks."""

    gpus: list[FakeGpu]
    driver: bool = True
    initialised: bool = False
    events: deque[FakeEvent] = field(default_factory=deque)
    registered: dict[int, int] = field(default_factory=dict)  # gpu index -> event mask
    shutdowns: int = 0
    gpm_samples: list[FakeGpmSample] = field(default_factory=list)
    gpm_clock: int = 0

    def queue_xid(self, gpu: int, code: int) -> None:
        self.events.append(FakeEvent(gpu, CONSTANTS["nvmlEventTypeXidCriticalError"], code))


class _Struct:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _field(field_id: int, scope: int, value_type: int, ret: int = 0, **value: Any) -> _Struct:
    """A ``c_nvmlFieldValue_t``: its own return code, a type tag and a union of value members."""
    return _Struct(fieldId=field_id, scopeId=scope, valueType=value_type, nvmlReturn=ret, value=_Struct(**value))


@dataclass
class FakeGpmSample:
    """``nvmlGpmSample_t``: opaque; filled by nvmlGpmSampleGet."""

    device: Any = None
    taken: int = 0  # order of nvmlGpmSampleGet calls; 0 = never filled
    values: dict[int, float] = field(default_factory=dict)
    freed: bool = False


class FakeGpmMetricsGet:
    """``c_nvmlGpmMetricsGet_t``: version, numMetrics, sample1, sample2, metrics[NVML_GPM_METRIC_MAX]."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0  # noqa: N815 - pynvml's name
        self.sample1 = FakeGpmSample()
        self.sample2 = FakeGpmSample()
        self.metrics = [_Struct(metricId=0, nvmlReturn=0, value=0.0) for _ in range(CONSTANTS["NVML_GPM_METRIC_MAX"])]


def build(state: FakeNvml) -> types.ModuleType:
    """A module object that answers like ``pynvml`` from ``state``."""
    mod = types.ModuleType("pynvml")
    mod.__dict__.update(CONSTANTS)
    mod.NVMLError = NVMLError
    mod.__dict__.update(_ERRORS)
    mod.NVML_VALUE_NOT_AVAILABLE_uint = BLANK_UINT
    mod.c_nvmlGpmMetricsGet_t = FakeGpmMetricsGet

    def err(name: str) -> NVMLError:
        return _ERRORS[name]()

    def check_init() -> None:
        if not state.initialised:
            raise err("NVMLError_Uninitialized")

    def gpu_call(fn_name: str, handle: FakeGpu, value: Any) -> Any:
        check_init()
        handle.calls[fn_name] = handle.calls.get(fn_name, 0) + 1
        if fn_name in handle.blocking:
            handle.blocking[fn_name].wait(timeout=30)
        if handle.lost:
            raise err("NVMLError_GpuIsLost")
        if fn_name in handle.unsupported:
            raise err("NVMLError_NotSupported")
        if fn_name in handle.denied:
            raise err("NVMLError_NoPermission")
        if fn_name in handle.blank:
            return BLANK_UINT
        return value() if callable(value) else value

    def nvmlInit() -> None:
        if not state.driver:
            raise err("NVMLError_LibraryNotFound")
        state.initialised = True

    def nvmlShutdown() -> None:
        check_init()
        state.initialised = False
        state.shutdowns += 1

    def nvmlDeviceGetCount() -> int:
        check_init()
        return len(state.gpus)

    def nvmlDeviceGetHandleByIndex(index: int) -> FakeGpu:
        check_init()
        if not 0 <= index < len(state.gpus):
            raise err("NVMLError_InvalidArgument")
        return state.gpus[index]

    def nvmlDeviceGetIndex(handle: FakeGpu) -> int:
        return gpu_call("nvmlDeviceGetIndex", handle, handle.index)

    def nvmlDeviceGetName(handle: FakeGpu) -> str:
        return gpu_call("nvmlDeviceGetName", handle, handle.name)

    def nvmlDeviceGetUUID(handle: FakeGpu) -> str:
        return gpu_call("nvmlDeviceGetUUID", handle, handle.uuid)

    def nvmlDeviceGetSerial(handle: FakeGpu) -> str:
        return gpu_call("nvmlDeviceGetSerial", handle, handle.serial)

    def nvmlDeviceGetPciInfo(handle: FakeGpu) -> _Struct:
        return gpu_call("nvmlDeviceGetPciInfo", handle, lambda: _Struct(busId=handle.bus_id.encode()))

    def nvmlDeviceGetUtilizationRates(handle: FakeGpu) -> _Struct:
        return gpu_call(
            "nvmlDeviceGetUtilizationRates", handle, lambda: _Struct(gpu=handle.util, memory=handle.mem_util)
        )

    def nvmlDeviceGetMemoryInfo(handle: FakeGpu, version: Any = None) -> _Struct:
        def info() -> _Struct:
            free = handle.mem_total - handle.mem_used
            if version is None:
                return _Struct(total=handle.mem_total, used=handle.mem_used, free=free)
            # v2 (nvmlDeviceGetMemoryInfo_v2): reserved is reported apart from used
            return _Struct(version=version, total=handle.mem_total, reserved=handle.mem_reserved, used=handle.mem_used,
                           free=free - handle.mem_reserved)

        return gpu_call("nvmlDeviceGetMemoryInfo", handle, info)

    def nvmlDeviceGetEncoderUtilization(handle: FakeGpu) -> list[int]:
        return gpu_call("nvmlDeviceGetEncoderUtilization", handle, lambda: [handle.enc_util, 167_000])

    def nvmlDeviceGetDecoderUtilization(handle: FakeGpu) -> list[int]:
        return gpu_call("nvmlDeviceGetDecoderUtilization", handle, lambda: [handle.dec_util, 167_000])

    def nvmlDeviceGetVirtualizationMode(handle: FakeGpu) -> int:
        return gpu_call("nvmlDeviceGetVirtualizationMode", handle, handle.virtualization_mode)

    def nvmlDeviceGetFieldValues(handle: FakeGpu, fieldIds: list[Any]) -> list[_Struct]:  # noqa: N803
        # As NVML: the call succeeds and each value carries its own return code.
        def values() -> list[_Struct]:
            out = []
            for wanted in fieldIds:
                field_id, scope = wanted if isinstance(wanted, tuple) else (wanted, 0)
                if field_id == CONSTANTS["NVML_FI_DEV_MEMORY_TEMP"]:
                    out.append(_field(field_id, scope, 1, uiVal=handle.mem_temp))
                elif field_id in (CONSTANTS["NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX"],
                                  CONSTANTS["NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX"]) and scope < handle.nvlinks:
                    tx = field_id == CONSTANTS["NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX"]
                    out.append(_field(field_id, scope, 3, ullVal=handle.nvlink_raw_kib[0 if tx else 1]))
                else:
                    out.append(_field(field_id, scope, 0, ret=CONSTANTS["NVML_ERROR_NOT_SUPPORTED"]))
            return out

        return gpu_call("nvmlDeviceGetFieldValues", handle, values)

    # GPM, laid out as pynvml lays it out: an opaque sample handle, a request struct the caller
    # fills (version, numMetrics, sample1, sample2, metrics[i].metricId) and NVML fills back.
    def nvmlGpmQueryDeviceSupport(device: FakeGpu) -> _Struct:
        return gpu_call(
            "nvmlGpmQueryDeviceSupport", device,
            lambda: _Struct(version=CONSTANTS["NVML_GPM_SUPPORT_VERSION"], isSupportedDevice=int(device.gpm_supported)),
        )

    def nvmlGpmSampleAlloc() -> FakeGpmSample:
        check_init()
        sample = FakeGpmSample()
        state.gpm_samples.append(sample)
        return sample

    def nvmlGpmSampleFree(gpmSample: FakeGpmSample) -> None:  # noqa: N803
        check_init()
        gpmSample.freed = True

    def nvmlGpmSampleGet(device: FakeGpu, gpmSample: FakeGpmSample) -> FakeGpmSample:  # noqa: N803
        def take() -> FakeGpmSample:
            state.gpm_clock += 1
            gpmSample.device, gpmSample.taken, gpmSample.values = device, state.gpm_clock, dict(device.gpm)
            return gpmSample

        return gpu_call("nvmlGpmSampleGet", device, take)

    def nvmlGpmMetricsGet(metricsGet: FakeGpmMetricsGet) -> FakeGpmMetricsGet:  # noqa: N803
        check_init()
        first, second = metricsGet.sample1, metricsGet.sample2
        if (
            metricsGet.version != CONSTANTS["NVML_GPM_METRICS_GET_VERSION"]
            or first.freed or second.freed or not first.taken or not second.taken
            or first.device is not second.device or second.taken <= first.taken
        ):
            raise err("NVMLError_InvalidArgument")
        for metric in metricsGet.metrics[: metricsGet.numMetrics]:
            if metric.metricId in second.values:
                metric.nvmlReturn, metric.value = 0, second.values[metric.metricId]
            else:
                metric.nvmlReturn, metric.value = CONSTANTS["NVML_ERROR_NOT_SUPPORTED"], 0.0
        return metricsGet

    def nvmlDeviceGetTemperature(handle: FakeGpu, sensor: int) -> int:
        return gpu_call("nvmlDeviceGetTemperature", handle, handle.temp)

    def nvmlDeviceGetPowerUsage(handle: FakeGpu) -> int:
        return gpu_call("nvmlDeviceGetPowerUsage", handle, handle.power_mw)

    def nvmlDeviceGetTotalEnergyConsumption(handle: FakeGpu) -> int:
        return gpu_call("nvmlDeviceGetTotalEnergyConsumption", handle, handle.energy_mj)

    def nvmlDeviceGetClockInfo(handle: FakeGpu, type: int) -> int:  # noqa: A002 - pynvml's name
        clocks = {CONSTANTS["NVML_CLOCK_SM"]: handle.sm_clock, CONSTANTS["NVML_CLOCK_MEM"]: handle.mem_clock}
        return gpu_call("nvmlDeviceGetClockInfo", handle, clocks.get(type, handle.sm_clock))

    def nvmlDeviceGetPcieThroughput(device: FakeGpu, counter: int) -> int:
        value = device.pcie_tx if counter == CONSTANTS["NVML_PCIE_UTIL_TX_BYTES"] else device.pcie_rx
        return gpu_call("nvmlDeviceGetPcieThroughput", device, value)

    def nvmlDeviceGetPcieReplayCounter(handle: FakeGpu) -> int:
        return gpu_call("nvmlDeviceGetPcieReplayCounter", handle, handle.replay)

    def nvmlDeviceGetTotalEccErrors(handle: FakeGpu, errorType: int, counterType: int) -> int:  # noqa: N803
        value = handle.ecc_sbe if errorType == CONSTANTS["NVML_MEMORY_ERROR_TYPE_CORRECTED"] else handle.ecc_dbe
        return gpu_call("nvmlDeviceGetTotalEccErrors", handle, value)

    def nvmlDeviceGetRetiredPages(device: FakeGpu, sourceFilter: int) -> list[int]:  # noqa: N803
        sbe = CONSTANTS["NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"]
        pages = device.retired_sbe if sourceFilter == sbe else device.retired_dbe
        return gpu_call("nvmlDeviceGetRetiredPages", device, list(pages))

    def nvmlDeviceGetRemappedRows(device: FakeGpu) -> tuple[int, int, int, int]:
        return gpu_call("nvmlDeviceGetRemappedRows", device, device.remapped)

    def nvmlDeviceGetCurrentClocksEventReasons(handle: FakeGpu) -> int:
        return gpu_call("nvmlDeviceGetCurrentClocksEventReasons", handle, handle.throttle)

    def nvmlDeviceGetCurrentClocksThrottleReasons(handle: FakeGpu) -> int:
        return gpu_call("nvmlDeviceGetCurrentClocksThrottleReasons", handle, handle.throttle)

    def nvmlDeviceGetNvLinkState(device: FakeGpu, link: int) -> int:
        def state_of_link() -> int:
            if device.nvlinks == 0:
                raise err("NVMLError_NotSupported")
            if link >= device.nvlinks:
                raise err("NVMLError_InvalidArgument")
            return 1

        return gpu_call("nvmlDeviceGetNvLinkState", device, state_of_link)

    def nvmlDeviceGetNvLinkErrorCounter(device: FakeGpu, link: int, counter: int) -> int:
        return gpu_call("nvmlDeviceGetNvLinkErrorCounter", device, device.nvlink_errors.get((link, counter), 0))

    def running(handle: FakeGpu) -> list[_Struct]:
        listed = handle.processes or [(1000 + i, 512 * 1024 * 1024) for i in range(handle.procs)]
        return [_Struct(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
                for pid, used in listed]

    def nvmlDeviceGetComputeRunningProcesses(handle: FakeGpu) -> list[_Struct]:
        return gpu_call("nvmlDeviceGetComputeRunningProcesses", handle, lambda: running(handle))

    def nvmlDeviceGetComputeRunningProcesses_v3(handle: FakeGpu) -> list[_Struct]:
        return gpu_call("nvmlDeviceGetComputeRunningProcesses_v3", handle, lambda: running(handle))

    def nvmlDeviceGetSupportedEventTypes(handle: FakeGpu) -> int:
        return gpu_call("nvmlDeviceGetSupportedEventTypes", handle, handle.supported_events)

    def nvmlEventSetCreate() -> object:
        check_init()
        return object()

    def nvmlDeviceRegisterEvents(handle: FakeGpu, eventTypes: int, eventSet: object) -> None:  # noqa: N803
        gpu_call("nvmlDeviceRegisterEvents", handle, None)
        state.registered[handle.index] = eventTypes

    def nvmlEventSetWait_v2(eventSet: object, timeoutms: int) -> _Struct:  # noqa: N803
        check_init()
        while state.events:
            ev = state.events.popleft()
            if state.registered.get(ev.gpu, 0) & ev.event_type:
                return _Struct(
                    device=state.gpus[ev.gpu], eventType=ev.event_type, eventData=ev.data, gpuInstanceId=0,
                    computeInstanceId=0,
                )
        raise err("NVMLError_Timeout")

    def nvmlEventSetFree(eventSet: object) -> None:
        check_init()

    def nvmlSystemGetDriverVersion() -> str:
        check_init()
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion() -> int:
        check_init()
        return 12040

    for name, fn in list(locals().items()):
        if name.startswith("nvml"):
            setattr(mod, name, fn)
    return mod


FUNCTIONS = [
    "nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetIndex",
    "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetSerial", "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetPcieThroughput", "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRetiredPages", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkErrorCounter",
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetSupportedEventTypes", "nvmlEventSetCreate",
    "nvmlDeviceRegisterEvents", "nvmlEventSetWait_v2", "nvmlEventSetFree", "nvmlSystemGetDriverVersion",
    "nvmlSystemGetCudaDriverVersion", "nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetDecoderUtilization",
    "nvmlDeviceGetVirtualizationMode", "nvmlDeviceGetFieldValues", "nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc",
    "nvmlGpmSampleFree", "nvmlGpmSampleGet", "nvmlGpmMetricsGet",
]


def install(monkeypatch: Any, gpus: int | list[FakeGpu] = 2, driver: bool = True) -> FakeNvml:
    """Put a fake ``pynvml`` in ``sys.modules`` for one test; returns its state to steer."""
    devices = [FakeGpu(i) for i in range(gpus)] if isinstance(gpus, int) else gpus
    state = FakeNvml(gpus=devices, driver=driver)
    monkeypatch.setitem(sys.modules, "pynvml", build(state))
    return state
