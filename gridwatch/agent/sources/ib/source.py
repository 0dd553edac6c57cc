"""The HCA ports as one agent source (read, judged, kept for /metrics), and :func:`open_ib_source` that picks its reader."""

from __future__ import annotations

from dataclasses import dataclass, field

from loguru import logger

from gridwatch.agent.sources import FaultNotSupported, Reading
from gridwatch.agent.sources.ib.judge import IbJudge, IbThresholds
from gridwatch.agent.sources.ib.ports import IbPort, PortReader, Unreadable
from gridwatch.agent.sources.ib.simulated import SIM_HCAS, SimulatedHcas
from gridwatch.agent.sources.ib.sysfs import SysfsPorts
from gridwatch.wire.protocol import Event, IbPortSample, Severity, Text, clean_text


@dataclass
class IbReading(Reading):
    """A reading of the HCA ports: the wire's per-port samples beside the events."""

    ib: list[IbPortSample] = field(default_factory=list)


class IbSource:
    """HCA ports as one agent source: read, judged, and kept whole for /metrics.

    Blocking: a sysfs read can hang in the driver (a wedged firmware command),
    so the agent reads it in its own thread under the source deadline.
    Simulated ports are numbers in memory: read inline, as a thread would cost more than the read.
    """

    name = "infiniband"
    blocking = True

    def __init__(self, reader: PortReader, judge: IbJudge | None = None) -> None:
        self.reader = reader
        self.judge = judge or IbJudge()
        self.simulated = reader.simulated
        self.blocking = not reader.simulated
        self.last: list[IbPort] = []  # swapped whole each read: /metrics reads it from its own thread
        self._unreadable: set[str] = set()  # files reported unreadable, until they read again

    def read(self) -> IbReading:
        ports, bad = self.reader.read_ports()
        samples, events = self.judge.judge(ports)
        events += self._unreadable_events(bad)
        self.last = ports
        return IbReading(events=events, ib=samples)

    def _unreadable_events(self, bad: list[Unreadable]) -> list[Event]:
        now_bad = {b.path: b.why for b in bad}
        fresh = [Unreadable(p, w) for p, w in now_bad.items() if p not in self._unreadable]
        self._unreadable = set(now_bad)
        events = []
        for b in fresh:  # once per streak: a file that stays bad is N/A, not news every second
            logger.warning("InfiniBand: {} unreadable ({}); that value is N/A", b.path, b.why)
            events.append(Event(
                kind=Text("ib_unreadable"), severity=Text(Severity.WARNING.value), source=Text("infiniband"),
                ts=self.judge.wall(),
                message=Text(clean_text(f"{b.path}: {b.why}; that value is N/A until it reads again")),
                details={Text("path"): Text(clean_text(b.path, 300)), Text("why"): Text(clean_text(b.why, 200))},
            ))
        return events

    def inject(self, kind: str, hca: int | None = None) -> str:
        """Inject a link fault (simulated HCAs only); see :meth:`SimulatedHcas.inject`."""
        if not isinstance(self.reader, SimulatedHcas):
            raise FaultNotSupported("faults can only be injected into simulated HCAs; this node has real ones")
        return self.reader.inject(kind, hca)

    def clear_faults(self) -> None:
        if isinstance(self.reader, SimulatedHcas):
            self.reader.clear_faults()

    def close(self) -> None:
        return None


def open_ib_source(root: str, simulate: int, seed: int = 0, thresholds: IbThresholds | None = None) -> IbSource | None:
    """The node's HCA ports: simulated ones (``simulate`` > 0, one per simulated GPU up to 8), else sysfs.

    None on a node with no ``root`` or no device in it: nothing to read.
    """
    t = thresholds or IbThresholds()
    if simulate > 0:
        sim = SimulatedHcas(min(simulate, SIM_HCAS), seed, flap_down_s=t.flap_down_s, flap_count=t.flap_count)
        return IbSource(sim, IbJudge(t))
    reader = SysfsPorts(root)
    if not reader.devices():
        logger.debug("no InfiniBand / RoCE devices under {}", root)
        return None
    return IbSource(reader, IbJudge(t))

