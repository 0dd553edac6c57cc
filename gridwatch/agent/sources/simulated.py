"""Simulated GPUs: H100-class readings under a training load, seeded, with injectable faults."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from loguru import logger

from gridwatch.agent.sources import GpuSource
from gridwatch.wire.protocol import Event, GpuInfo, GpuSample, Text
from gridwatch.wire.xid import xid_meaning, xid_resolution, xid_severity

MODEL = "NVIDIA H100 80GB HBM3"
MEMORY_TOTAL_MB = 81559.0
MEMORY_RESERVED_MB = 502.0  # what the driver keeps back on an 80 GB H100 (approximate, written by us)
NVLINKS = 18  # NVLink 4 links of an H100 SXM
# Bus ids of the eight GPUs of a common HGX H100 board, so simulated nodes look familiar.
_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
FAULT_KINDS = ("xid", "ecc-dbe", "thermal", "fell-off-bus", "hang")
# Ticks a hung GPU looks busy before the hang is reported, as a watchdog would.
HANG_TICKS = 3


@dataclass
class _Gpu:
    index: int
    info: GpuInfo
    energy_j: float
    ecc_dbe: int = 0
    remap_pending: bool = False
    thermal: bool = False
    lost: bool = False
    hang_ticks: int | None = None  # ticks since a hang was injected
    hang_power: float = 0.0
    dip: int = 0  # ticks left in a utilization dip (data loader, eval, checkpoint)
    nvlink_bytes: float = 0.0  # NVLink tx+rx since start, as DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL counts
    events: list[Event] = field(default_factory=list)


class SimulatedGpus(GpuSource):
    """Stands in for NVML where there is no GPU; same interface, same N/A rules.

    Readings come from ``random.Random(seed)``: the same seed gives the same
    numbers, tick by tick. ``clock`` (seconds) stamps events and integrates
    energy; by default each sample counts as one second.
    """

    name = "simulated_gpus"
    blocking = False  # numbers from memory: a thread would cost more than the read
    simulated = True

    def __init__(self, count: int, seed: int = 0, clock: Callable[[], float] | None = None) -> None:
        if count < 0:
            raise ValueError(f"cannot simulate {count} GPUs")
        self._rng = random.Random(seed)
        self._clock = clock
        self._ticks = 0
        self._last: float | None = None
        self._gpus = [self._make(i) for i in range(count)]

    def _make(self, index: int) -> _Gpu:
        rng = self._rng
        bus = _BUSES[index % len(_BUSES)] + (index // len(_BUSES)) * 0x100
        info = GpuInfo(
            index=index,
            uuid=Text(f"GPU-{uuid.UUID(int=rng.getrandbits(128), version=4)}"),
            name=Text(MODEL),
            pci_bus_id=Text(f"{bus >> 8:04x}:{bus & 0xFF:02x}:00.0"),
            memory_total_mb=MEMORY_TOTAL_MB,
            serial=Text(f"{1650000000000 + rng.randrange(10**9)}"),
        )
        return _Gpu(index=index, info=info, energy_j=rng.uniform(1e7, 5e7))

    def _now(self) -> float:
        return self._clock() if self._clock is not None else time.time()

    def info(self) -> list[GpuInfo]:
        """Static facts of each simulated GPU (``nvidia-smi -L``)."""
        return [g.info for g in self._gpus]

    def sample(self) -> list[GpuSample]:
        """One reading of every GPU; a lost GPU reads N/A throughout."""
        if self._clock is None:
            dt = 1.0
        else:
            now = self._clock()
            dt = 1.0 if self._last is None else max(now - self._last, 0.0)
            self._last = now
        self._ticks += 1
        return [self._read(g, dt) for g in self._gpus]

    def _read(self, g: _Gpu, dt: float) -> GpuSample:
        rng = self._rng
        # Draw the same numbers whatever the GPU's state, so a fault on one GPU
        # does not change what the others read for a given seed.
        noise = [rng.random() for _ in range(6)]
        if g.lost:
            return GpuSample(index=g.index, state=Text("lost"))
        if g.dip == 0 and noise[0] < 0.03:
            g.dip = 1 + int(noise[1] * 3)
        if g.hang_ticks is not None:
            util, power = 100.0, g.hang_power
            g.hang_ticks += 1
            if g.hang_ticks == HANG_TICKS:
                g.events.append(
                    self._event(g, "gpu_hang", "error", "utilization stuck at 100% with flat power: kernel hang")
                )
        elif g.dip > 0:
            g.dip -= 1
            util = 40.0 + noise[2] * 30.0
            power = 250.0 + util * 3.0
        else:
            util = round(93.0 + noise[2] * 7.0)
            power = 560.0 + noise[3] * 130.0
        temp = 44.0 + power / 700.0 * 28.0 + noise[4] * 3.0
        sm_clock, throttle = 1980.0, []
        if g.thermal:
            temp = 91.0 + noise[4] * 4.0
            sm_clock = 1095.0 + round(noise[5] * 10) * 15.0
            power *= 0.7
            throttle = [Text("hw_thermal"), Text("sw_thermal")]
        g.energy_j += power * dt
        mem_used = 70_000.0 + noise[5] * 2_000.0
        # Profiling (GPM) fields follow the load, from the same draws: a hung GPU spins in a
        # collective (SMs busy, tensor pipes and NVLink idle); a throttled one moves less data.
        hung = g.hang_ticks is not None
        sm_active = round(util / 100.0 * (0.80 + noise[1] * 0.08), 3)
        link_bps = 0.0 if hung else round(util / 100.0 * sm_clock / 1980.0 * (14e9 + noise[3] * 4e9), -3)
        links: list[float | None] = [link_bps] * NVLINKS
        g.nvlink_bytes += 2 * link_bps * NVLINKS * dt
        return GpuSample(
            index=g.index,
            util=float(util),
            mem_util=round(util * 0.45 + noise[1] * 5.0, 1),
            mem_used_mb=round(mem_used, 1),
            mem_total_mb=MEMORY_TOTAL_MB,
            temp_c=round(temp, 1),
            power_w=round(power, 1),
            energy_j=round(g.energy_j, 1),
            sm_clock_mhz=sm_clock,
            mem_clock_mhz=2619.0,
            pcie_tx_kbs=round(20_000.0 + noise[3] * 30_000.0),
            pcie_rx_kbs=round(40_000.0 + noise[2] * 60_000.0),
            pcie_replay=0,
            ecc_sbe=0,
            ecc_dbe=g.ecc_dbe,
            retired_pages=None,  # Hopper remaps rows instead of retiring pages
            remapped_rows_pending=g.remap_pending,
            remapped_rows_failed=False,
            throttle=throttle,
            nvlink_errors=0,
            procs=1,
            mem_temp_c=round(temp + 2.0 + noise[5] * 2.0, 1),
            enc_util=0.0,
            dec_util=0.0,
            mem_reserved_mb=MEMORY_RESERVED_MB,
            remapped_rows_correctable=0,
            remapped_rows_uncorrectable=0,
            nvlink_bytes=round(g.nvlink_bytes),
            vgpu_license_status=0,
            gr_engine_active=round(util / 100.0, 3),
            sm_active=sm_active,
            sm_occupancy=round(sm_active * (0.40 + noise[4] * 0.1), 3),
            tensor_active=0.0 if hung else round(sm_active * (0.55 + noise[2] * 0.1), 3),
            dram_active=round(util * 0.45 / 100.0 + noise[1] * 0.05, 3),
            pcie_tx_bps=round(20_000.0 + noise[3] * 30_000.0) * 1000.0,
            pcie_rx_bps=round(40_000.0 + noise[2] * 60_000.0) * 1000.0,
            nvlink_tx_bps=link_bps * NVLINKS,
            nvlink_rx_bps=link_bps * NVLINKS,
            nvlink_link_tx_bps=list(links),
            nvlink_link_rx_bps=list(links),
            state=Text("hung" if g.hang_ticks is not None and g.hang_ticks >= HANG_TICKS else "ok"),
        )

    def _event(self, g: _Gpu, kind: str, severity: str, message: str, code: int | None = None) -> Event:
        return Event(
            kind=Text(kind),
            severity=Text(severity),
            message=Text(f"GPU {g.index}: {message}"),
            gpu=g.index,
            code=code,
            source=Text("sim"),
            ts=self._now(),
            details={"pci_bus_id": g.info.pci_bus_id or Text(""), "uuid": g.info.uuid},
            resolution=Text(xid_resolution(code) if kind == "xid" and code is not None else ""),
        )

    def poll_events(self) -> list[Event]:
        """Events raised by injected faults since the last call."""
        out: list[Event] = []
        for g in self._gpus:
            out.extend(g.events)
            g.events.clear()
        return out

    def inject(self, kind: str, gpu: int | None = None, code: int | None = None) -> str:
        """Inject a fault into one GPU (0 unless ``gpu`` says otherwise); returns what was done.

        Kinds: ``xid`` (needs ``code``; 79 also loses the GPU), ``ecc-dbe``,
        ``thermal``, ``fell-off-bus``, ``hang``.
        """
        kind = kind.strip().lower().replace("_", "-")
        index = 0 if gpu is None else gpu
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; choose one of {', '.join(FAULT_KINDS)}")
        if not 0 <= index < len(self._gpus):
            raise ValueError(f"no GPU {index} on this node (it has {len(self._gpus)})")
        g = self._gpus[index]
        if kind == "xid":
            if code is None:
                raise ValueError("an xid fault needs a code, e.g. code=79")
            if code == 79:
                return self._fall_off_bus(g)
            g.events.append(self._event(g, "xid", xid_severity(code), f"XID {code}: {xid_meaning(code)}", code))
            done = f"GPU {index}: XID {code} ({xid_meaning(code)})"
        elif kind == "ecc-dbe":
            g.ecc_dbe += 1
            g.remap_pending = True
            g.events.append(self._event(g, "ecc_dbe", "critical", f"double-bit ECC error (volatile count {g.ecc_dbe})"))
            done = f"GPU {index}: double-bit ECC error"
        elif kind == "thermal":
            g.thermal = True
            g.events.append(self._event(g, "thermal", "error", "over 90 C, clocks throttled (hw_thermal, sw_thermal)"))
            done = f"GPU {index}: thermal throttling"
        elif kind == "fell-off-bus":
            return self._fall_off_bus(g)
        else:
            g.hang_ticks = 0
            g.hang_power = 655.0
            done = f"GPU {index}: hang (reported after {HANG_TICKS} ticks)"
        logger.info("simulated fault injected: {}", done)
        return done

    def _fall_off_bus(self, g: _Gpu) -> str:
        if not g.lost:
            g.lost = True
            g.events.append(self._event(g, "xid", "critical", f"XID 79: {xid_meaning(79)}", 79))
            g.events.append(self._event(g, "fell_off_bus", "critical", "GPU has fallen off the bus; every read fails"))
        done = f"GPU {g.index}: fell off the bus (XID 79)"
        logger.info("simulated fault injected: {}", done)
        return done

    def clear_faults(self) -> None:
        """Every GPU back to healthy, as after a reset; counters start again from zero."""
        for g in self._gpus:
            g.ecc_dbe, g.remap_pending, g.thermal, g.lost, g.hang_ticks = 0, False, False, False, None
            g.events.clear()

    def reset(self, index: int) -> str:
        """``nvidia-smi --gpu-reset -i INDEX`` on a simulated GPU: its faults are gone, its counters start again."""
        if not 0 <= index < len(self._gpus):
            raise ValueError(f"no GPU {index} on this node (it has {len(self._gpus)})")
        g = self._gpus[index]
        g.ecc_dbe, g.remap_pending, g.thermal, g.lost, g.hang_ticks = 0, False, False, False, None
        g.events.clear()
        logger.info("simulated GPU {} reset", index)
        return f"GPU {index} reset"

    def close(self) -> None:
        return None
