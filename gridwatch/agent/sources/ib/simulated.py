"""Simulated HCA ports for sim mode: ConnectX-7 NDR ports in memory, with link faults to inject."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from loguru import logger

from gridwatch.agent.sources.ib.metrics import COUNTER_METRICS, HW_COUNTER_METRICS
from gridwatch.agent.sources.ib.ports import DATA_WORD_BYTES, ERROR_COUNTERS, IbPort, PortState, Unreadable

IB_FAULTS = ("ib-flap", "ib-down", "ib-errors")
SIM_HCAS = 8
_SIM_RATE_GBPS = 400.0


@dataclass
class _SimPort:
    device: str
    counters: dict[str, int]
    hw: dict[str, int]
    down: bool = False
    down_until: float | None = None  # a flapping port comes back then
    flaps_left: int = 0
    up_until: float | None = None  # ... and goes down again then
    errors_per_s: float = 0.0


class SimulatedHcas:
    """ConnectX-7 NDR ports (mlx5_0..) in sim mode: ACTIVE at 400 Gb/s, counters growing with traffic.

    Seeded and deterministic for a given clock. ``flap_down_s`` is how long one
    down of an injected flap lasts: a little longer than the judge's threshold,
    so that each one counts.
    """

    simulated = True

    def __init__(self, count: int = SIM_HCAS, seed: int = 0, clock: Callable[[], float] = time.monotonic,
                 flap_down_s: float = 25.0, flap_count: int = 3) -> None:
        self._rng = random.Random(seed)
        self._clock = clock
        self._last: float | None = None
        self.flap_down_s = flap_down_s
        self.flap_count = flap_count
        zero = dict.fromkeys(ERROR_COUNTERS, 0)
        self._ports = [
            _SimPort(
                device=f"mlx5_{i}",
                counters={**{k: v for k, v in zero.items() if k in COUNTER_METRICS},
                          "port_rcv_data": self._rng.randrange(1 << 40), "port_xmit_data": self._rng.randrange(1 << 40),
                          "port_rcv_packets": 0, "port_xmit_packets": 0, "port_xmit_wait": 0},
                hw={k: v for k, v in zero.items() if k in HW_COUNTER_METRICS},
            )
            for i in range(count)
        ]

    def read_ports(self) -> tuple[list[IbPort], list[Unreadable]]:
        now = self._clock()
        dt = 1.0 if self._last is None else max(now - self._last, 0.0)
        self._last = now
        return [self._read(p, now, dt) for p in self._ports], []

    def _read(self, p: _SimPort, now: float, dt: float) -> IbPort:
        self._advance_flap(p, now)
        noise = self._rng.random()  # drawn whatever the port's state: one fault leaves the others' numbers alone
        if not p.down:
            # A training job keeps an NDR rail well busy: 30-45 GB/s each way.
            words = int((30e9 + noise * 15e9) * dt / DATA_WORD_BYTES)
            p.counters["port_rcv_data"] += words
            p.counters["port_xmit_data"] += words
            p.counters["port_rcv_packets"] += words // 1024
            p.counters["port_xmit_packets"] += words // 1024
        if p.errors_per_s:
            grown = max(int(p.errors_per_s * dt), 1)
            p.counters["symbol_error"] = min(p.counters["symbol_error"] + grown, 0xFFFF)
            p.counters["port_rcv_errors"] = min(p.counters["port_rcv_errors"] + grown // 4, 0xFFFF)
        state, phys = ((PortState.DOWN, (2, "Polling")) if p.down else (PortState.ACTIVE, (5, "LinkUp")))
        return IbPort(
            device=p.device, port=1, state_id=int(state), state=state.name, phys_state_id=phys[0], phys_state=phys[1],
            rate_gbps=_SIM_RATE_GBPS, link_layer="InfiniBand", counters=dict(p.counters), hw_counters=dict(p.hw),
        )

    def _advance_flap(self, p: _SimPort, now: float) -> None:
        if p.down_until is not None and now >= p.down_until:
            p.down, p.down_until = False, None
            if p.flaps_left > 0:
                p.up_until = now + max(self.flap_down_s / 5, 0.05)
        elif p.up_until is not None and now >= p.up_until:
            p.up_until = None
            self._go_down(p, now)

    def _go_down(self, p: _SimPort, now: float) -> None:
        p.down = True
        p.counters["link_downed"] = min(p.counters["link_downed"] + 1, 0xFF)
        if p.flaps_left > 0:
            p.flaps_left -= 1
            # Just past the threshold, and at least two readings apart, so each down counts as gpud counts it.
            p.down_until = now + self.flap_down_s * 1.5

    def inject(self, kind: str, hca: int | None = None) -> str:
        """``ib-flap``: down and back ``flap_count`` times; ``ib-down``: down until cleared; ``ib-errors``: symbol errors.

        ``hca`` picks mlx5_<hca> (default 0). Raises ValueError for a bad kind or index.
        """
        kind = kind.strip().lower().replace("_", "-")
        index = 0 if hca is None else hca
        if kind not in IB_FAULTS:
            raise ValueError(f"unknown InfiniBand fault {kind!r}; choose one of {', '.join(IB_FAULTS)}")
        if not 0 <= index < len(self._ports):
            raise ValueError(f"no HCA {index} on this node (it has {len(self._ports)})")
        p = self._ports[index]
        now = self._clock()
        if kind == "ib-flap":
            p.flaps_left = self.flap_count
            p.up_until = None
            self._go_down(p, now)
            done = f"{p.device} port 1: link flapping ({self.flap_count} downs of {self.flap_down_s * 1.5:g} s)"
        elif kind == "ib-down":
            p.flaps_left, p.down_until, p.up_until = 0, None, None
            if not p.down:
                self._go_down(p, now)
            done = f"{p.device} port 1: link down until faults are cleared"
        else:
            p.errors_per_s = 200.0
            done = f"{p.device} port 1: symbol errors at 200/s (a bad cable)"
        logger.info("simulated fault injected: {}", done)
        return done

    def clear_faults(self) -> None:
        """Every port back up and clean; the counters keep what they counted, as on real hardware."""
        for p in self._ports:
            p.down, p.down_until, p.up_until, p.flaps_left, p.errors_per_s = False, None, None, 0, 0.0
