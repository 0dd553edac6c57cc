"""Judging: successive port readings into the wire's per-port samples and link, error and flap events.

:class:`IbJudge` turns two readings into events: any ``link_downed`` increment
or a port leaving ACTIVE is ``ib_link_down`` (fatal), a port back to ACTIVE is
``ib_link_up``, an error counter growing faster than the configured rate is
``ib_errors`` (degraded), and a port that was down for ``flap_down_s`` or more
and came back ``flap_count`` times within ``flap_window_s`` is ``ib_link_flap``
(gpud's rule, components/accelerator/nvidia/infiniband/store/scan_flaps.go).
"""

from __future__ import annotations

import enum
import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gridwatch.agent.sources.ib.ports import DATA_WORD_BYTES, ERROR_COUNTERS, FATAL_COUNTERS, IbPort
from gridwatch.wire.protocol import Event, IbPortSample, Severity, Text, clean_text

# The error counters in the order the wire lists them, each with the value it saturates at (None: 64-bit).
# Judged once per port per tick, so walked from here rather than by sorting every counter a port has.
_ERROR_ORDER: tuple[tuple[str, Text, int | None], ...] = tuple(
    (name, Text(name), None if width is None else (1 << width) - 1) for name, width in sorted(ERROR_COUNTERS.items())
)
_ERROR_NAMES = tuple(name for name, _, _ in _ERROR_ORDER)
_LINK_DOWNED = Text("link_downed")


@dataclass(frozen=True)
class IbThresholds:
    """How ports are judged; the agent's ``ib_*`` settings."""

    error_rate: float = 1.0  # errors a second on one counter: degraded
    flap_down_s: float = 25.0
    flap_count: int = 3
    flap_window_s: float = 43500.0  # gpud: 12 h 5 min


class FlapPhase(enum.Enum):
    """Where a port is in gpud's flap count."""

    UP = "up"
    DOWN = "down"  # seen down, not yet for flap_down_s
    DOWN_LONG = "down_long"  # down for flap_down_s or more: coming back counts


@dataclass
class _PortMemory:
    counters: dict[str, int]
    at: float
    active: bool | None
    phase: FlapPhase = FlapPhase.UP
    down_since: float = 0.0
    reverts: deque[float] = field(default_factory=deque)
    degraded: bool = False
    # The error counters as last judged (None: not read), and what they gave: a port's errors rarely move, so
    # a reading whose error counters are the same as the last one's is judged from these, not walked again.
    error_values: tuple[int | None, ...] = ()
    errors: dict[Text, int] = field(default_factory=dict)
    saturated: list[Text] = field(default_factory=list)


class IbJudge:
    """Turns successive readings into wire samples and events; time comes from ``clock`` (seconds)."""

    def __init__(self, thresholds: IbThresholds | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.thresholds = thresholds or IbThresholds()
        self.clock = clock
        self.wall = wall
        self._memory: dict[tuple[str, int], _PortMemory] = {}

    def judge(self, ports: list[IbPort]) -> tuple[list[IbPortSample], list[Event]]:
        now = self.clock()
        samples: list[IbPortSample] = []
        events: list[Event] = []
        for port in ports:
            sample, port_events = self._one(port, now)
            samples.append(sample)
            events.extend(port_events)
        listed = {(p.device, p.port) for p in ports}
        for device, number in [key for key in self._memory if key not in listed]:
            # The HCA left sysfs (fell off PCIe, driver unloaded): as fatal as a link down, said once.
            del self._memory[(device, number)]
            events.append(self._event(IbPort(device=device, port=number), "ib_link_down", Severity.CRITICAL,
                                      "port no longer listed in sysfs: the HCA is gone (PCIe, driver or firmware)"))
        return samples, events

    def _one(self, port: IbPort, now: float) -> tuple[IbPortSample, list[Event]]:
        key = (port.device, port.port)
        counters = {**port.hw_counters, **port.counters}
        sample = IbPortSample(
            device=port.device, port=port.port, state=_text(port.state), phys_state=_text(port.phys_state),
            rate_gbps=port.rate_gbps, link_layer=_text(port.link_layer),
        )
        values = tuple(map(counters.get, _ERROR_NAMES))
        mem = self._memory.get(key)
        unchanged = mem is not None and values == mem.error_values
        if unchanged and mem is not None:
            # Copies: a sample is the wire's, the memory the judge's.
            sample.errors, sample.saturated = dict(mem.errors), list(mem.saturated)
        else:
            sample.errors, sample.saturated = _errors(counters)
        events: list[Event] = []
        if mem is None:  # the first reading is the baseline: nothing to compare yet
            mem = self._memory[key] = _PortMemory(counters=counters, at=now, active=port.active)
            if port.active is False:
                mem.phase, mem.down_since = FlapPhase.DOWN, now
            mem.error_values, mem.errors, mem.saturated = values, dict(sample.errors), list(sample.saturated)
            return sample, events
        dt = now - mem.at
        before = mem.counters
        if dt > 0:
            for name, word_bps in (("port_rcv_data", "rx_bps"), ("port_xmit_data", "tx_bps")):
                grown = _grown(before, counters, name)
                if grown is not None:
                    setattr(sample, word_bps, grown * DATA_WORD_BYTES / dt)
        # Same error counters as last time (most ports, most ticks): no counter grew, as the walk would find.
        sample.deltas = {} if unchanged else _deltas(before, counters)
        if not unchanged:
            mem.error_values, mem.errors, mem.saturated = values, dict(sample.errors), list(sample.saturated)
        events += self._state_events(port, mem, sample, now)
        events += self._error_events(port, mem, sample, dt)
        mem.counters, mem.at = counters, now
        return sample, events

    def _state_events(self, port: IbPort, mem: _PortMemory, sample: IbPortSample, now: float) -> list[Event]:
        events: list[Event] = []
        downed = sample.deltas.get(_LINK_DOWNED, 0)
        active = port.active
        went_down = mem.active is True and active is False
        if went_down or downed:
            why = []
            if went_down:
                why.append(f"state {port.state} ({port.phys_state or 'N/A'})")
            if downed:
                why.append(f"link_downed +{downed}")
            events.append(self._event(port, "ib_link_down", Severity.CRITICAL,
                                      f"link down: {', '.join(why)}; collectives over it stall or fail",
                                      counter="link_downed" if downed else None, delta=downed or None))
        elif mem.active is False and active is True:
            events.append(self._event(port, "ib_link_up", Severity.INFO, f"link back to {port.state}"))
        if active is not None:
            mem.active = active
        flap = self._flap(mem, active, now)
        if flap is not None:
            events.append(self._event(port, "ib_link_flap", Severity.CRITICAL, flap))
        return events

    def _flap(self, mem: _PortMemory, active: bool | None, now: float) -> str | None:
        """gpud's rule, one reading at a time: down, still down ``flap_down_s`` later, then ACTIVE again."""
        t = self.thresholds
        while mem.reverts and now - mem.reverts[0] > t.flap_window_s:
            mem.reverts.popleft()
        if active is None:
            return None  # unreadable: neither up nor down
        if not active:
            if mem.phase is FlapPhase.UP:
                mem.phase, mem.down_since = FlapPhase.DOWN, now
            elif mem.phase is FlapPhase.DOWN and now - mem.down_since >= t.flap_down_s:
                mem.phase = FlapPhase.DOWN_LONG
            return None
        was, mem.phase = mem.phase, FlapPhase.UP
        if was is not FlapPhase.DOWN_LONG:
            return None  # a short dip is not a flap (gpud: the down must persist)
        mem.reverts.append(now)
        if len(mem.reverts) < t.flap_count:
            return None
        mem.reverts.clear()  # reported once; the next report needs as many flaps again
        return (f"link flapping: down {t.flap_down_s:g} s or more and back {t.flap_count} times within "
                f"{_span(t.flap_window_s)}; a cable, transceiver or switch port is failing")

    def _error_events(self, port: IbPort, mem: _PortMemory, sample: IbPortSample, dt: float) -> list[Event]:
        if dt <= 0:
            return []
        if not sample.deltas:  # nothing grew: not over any rate
            mem.degraded = False
            return []
        rates = {str(k): v / dt for k, v in sample.deltas.items() if str(k) not in FATAL_COUNTERS}
        worst = max(rates.items(), key=lambda kv: kv[1], default=None)
        over = worst is not None and worst[1] > self.thresholds.error_rate
        events: list[Event] = []
        if over and worst is not None and not mem.degraded:
            name, rate = worst
            others = ", ".join(f"{k} +{sample.deltas[Text(k)]}" for k in sorted(rates) if k != name)
            events.append(self._event(
                port, "ib_errors", Severity.WARNING,
                f"degraded: {name} +{sample.deltas[Text(name)]} ({rate:.1f}/s, over {self.thresholds.error_rate:g}/s)"
                + (f"; also {others}" if others else ""),
                counter=name, delta=sample.deltas[Text(name)], rate=f"{rate:.3g}",
            ))
        mem.degraded = over
        return events

    def _event(self, port: IbPort, kind: str, severity: Severity, message: str, **extra: object) -> Event:
        details = {"device": port.device, "port": str(port.port), "link_layer": port.link_layer,
                   "state": port.state, "phys_state": port.phys_state, **extra}
        return Event(
            kind=Text(kind), severity=Text(severity.value), source=Text("infiniband"), ts=self.wall(),
            message=Text(clean_text(f"{port.device} port {port.port}: {message}")),
            details={Text(k): Text(clean_text(str(v), 200)) for k, v in details.items() if v is not None},
        )


def _errors(counters: dict[str, int]) -> tuple[dict[Text, int], list[Text]]:
    """The error counters that are not zero, and those stuck at their ceiling (saturated), in the wire's order."""
    errors: dict[Text, int] = {}
    saturated: list[Text] = []
    for name, text, ceiling in _ERROR_ORDER:
        value = counters.get(name)
        if value is None:
            continue
        if value:
            errors[text] = value
        if ceiling is not None and value >= ceiling:
            saturated.append(text)
    return errors, saturated


def _deltas(before: dict[str, int], counters: dict[str, int]) -> dict[Text, int]:
    """How much each error counter read both times grew."""
    deltas: dict[Text, int] = {}
    for name, text, _ in _ERROR_ORDER:
        last = before.get(name)
        if last is None or counters.get(name, last) == last:
            continue  # not read both times, or unchanged: most counters, most ticks
        grown = _grown(before, counters, name)
        if grown is not None and grown > 0:
            deltas[text] = grown
    return deltas


def _grown(before: dict[str, int], after: dict[str, int], name: str) -> int | None:
    """Growth of one counter read both times (None if not); one that went backwards was cleared, so it grew by its value."""
    value, last = after.get(name), before.get(name)
    if value is None or last is None:
        return None
    # IBA counters saturate rather than wrap; one lower than before was reset (perfquery -R, driver reload).
    return value - last if value >= last else value


def _span(seconds: float) -> str:
    return f"{seconds / 3600:.4g} h" if seconds >= 3600 else f"{seconds:g} s"


def _text(value: str | None) -> Text | None:
    return None if value is None else _clean_short(value)


@functools.lru_cache(maxsize=256)
def _clean_short(value: str) -> Text:
    # States, physical states and link layers come from a handful of words: cleaned once each, not every tick.
    # A plain str (Text is one to the wire's encoder, which takes a str subclass through a hook, slower).
    return clean_text(value, 100)
