"""A fake ``pynvml`` module: NVML's names, constants and errors over configurable devices."""

from __future__ import annotations

import sys
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
}
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
    unsupported: set[str] = field(default_factory=set)
    blank: set[str] = field(default_factory=set)  # functions returning NVML_VALUE_NOT_AVAILABLE
    lost: bool = False
    supported_events: int = 0x1 | 0x2 | 0x8
    calls: dict[str, int] = field(default_factory=dict)

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

    def queue_xid(self, gpu: int, code: int) -> None:
        self.events.append(FakeEvent(gpu, CONSTANTS["nvmlEventTypeXidCriticalError"], code))


class _Struct:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def build(state: FakeNvml) -> types.ModuleType:
    """A module object that answers like ``pynvml`` from ``state``."""
    mod = types.ModuleType("pynvml")
    mod.__dict__.update(CONSTANTS)
    mod.NVMLError = NVMLError
    mod.__dict__.update(_ERRORS)
    mod.NVML_VALUE_NOT_AVAILABLE_uint = BLANK_UINT

    def err(name: str) -> NVMLError:
        return _ERRORS[name]()

    def check_init() -> None:
        if not state.initialised:
            raise err("NVMLError_Uninitialized")

    def gpu_call(fn_name: str, handle: FakeGpu, value: Any) -> Any:
        check_init()
        handle.calls[fn_name] = handle.calls.get(fn_name, 0) + 1
        if handle.lost:
            raise err("NVMLError_GpuIsLost")
        if fn_name in handle.unsupported:
            raise err("NVMLError_NotSupported")
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
        return gpu_call(
            "nvmlDeviceGetMemoryInfo",
            handle,
            lambda: _Struct(total=handle.mem_total, used=handle.mem_used, free=handle.mem_total - handle.mem_used),
        )

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

    def nvmlDeviceGetComputeRunningProcesses(handle: FakeGpu) -> list[_Struct]:
        return gpu_call(
            "nvmlDeviceGetComputeRunningProcesses", handle, [_Struct(pid=1000 + i) for i in range(handle.procs)]
        )

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
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetSupportedEventTypes", "nvmlEventSetCreate",
    "nvmlDeviceRegisterEvents", "nvmlEventSetWait_v2", "nvmlEventSetFree", "nvmlSystemGetDriverVersion",
    "nvmlSystemGetCudaDriverVersion",
]


def install(monkeypatch: Any, gpus: int | list[FakeGpu] = 2, driver: bool = True) -> FakeNvml:
    """Put a fake ``pynvml`` in ``sys.modules`` for one test; returns its state to steer."""
    devices = [FakeGpu(i) for i in range(gpus)] if isinstance(gpus, int) else gpus
    state = FakeNvml(gpus=devices, driver=driver)
    monkeypatch.setitem(sys.modules, "pynvml", build(state))
    return state
