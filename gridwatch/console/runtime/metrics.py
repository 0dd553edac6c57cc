"""The console's own /metrics: incidents open, actions by outcome, goodput and its losses, time to detect and recover.

Opt-in with ``metrics = "127.0.0.1:9400"`` in cluster.toml or ``--metrics ADDR``
on ``gridwatch console`` and ``gridwatch demo``. The families are built when
Prometheus scrapes, from the runtime's own state, in the runtime's event loop
(the incident store is SQLite, used from that thread only), and from a registry
of their own (no process-wide state), as the agent's exporter does. The socket
is bound when the runtime is built, so a taken port is one sentence at start.

The names, all ``gridwatch_console_``:

- ``incidents_open{severity}``: incidents not resolved (acknowledged and
  silenced ones included), every severity present, zero included.
- ``actions_total{action,outcome}``: playbook and operator steps sent to
  nodes; outcome ``ok``, ``failed`` or ``not_sent`` (a watch-only run).
- ``goodput_ratio{window}``: productive time over wall time; window ``run``,
  ``1m``, ``5m``, ``15m``. Left out while no trainer reports (N/A, not 0).
- ``time_seconds{use,window}`` and ``time_ratio{use,window}``: where the time
  went, ``use`` one of ``gridwatch.console.fleet.goodput.TimeUse`` (productive and each
  loss); the uses of a window add up to its length.
- ``time_to_detect_seconds`` and ``time_to_recover_seconds``: histograms, one
  observation per recovered incident.
- ``mttd_seconds``, ``mttr_seconds``, ``mtbf_seconds``: over the run.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from typing import TYPE_CHECKING

from loguru import logger
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gridwatch.console.fleet.goodput import TimeUse
from gridwatch.playbooks.incident_times import Phase
from gridwatch.wire.protocol import SEVERITIES, ActionResult
from gridwatch.wire.settings import ConfigError, split_hostport

if TYPE_CHECKING:
    from collections.abc import Iterator

    from prometheus_client.metrics_core import Metric

    from gridwatch.console.runtime.core import ConsoleRuntime
    from gridwatch.console.runtime.incidents import IncidentRow

PREFIX = "gridwatch_console_"
# Seconds: from a fast XID (a second or two) to a hang found by its collective timeout (tens of minutes).
TIME_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
_NOT_SENT = "not sent"  # how a watch-only runtime answers an acting step (gridwatch.console.runtime.core.act)
_MAX_REQUEST = 8192


def parse_metrics_addr(value: str, what: str = "metrics") -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); ValueError in one sentence naming ``what`` otherwise."""
    try:
        host, port = split_hostport(value.strip(), what)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return host, port


class ConsoleMetrics:
    """Counts what the runtime does and renders it when scraped; ``bind`` then ``start`` serve it over HTTP."""

    def __init__(self, runtime: ConsoleRuntime) -> None:
        self.runtime = runtime
        self.registry = CollectorRegistry(auto_describe=False)
        self.actions: Counter[tuple[str, str]] = Counter()
        self.detect = Histogram(f"{PREFIX}time_to_detect_seconds", "From the fault to the incident, per recovered "
                                "incident.", buckets=TIME_BUCKETS, registry=self.registry)
        self.recover = Histogram(f"{PREFIX}time_to_recover_seconds", "From the fault to the job training past it, "
                                 "per recovered incident.", buckets=TIME_BUCKETS, registry=self.registry)
        self.registry.register(_Collector(self))
        self._sock: socket.socket | None = None
        self.port = 0  # the bound port, once bound
        self._server: asyncio.Server | None = None
        runtime.hooks.action.append(self.on_action)
        runtime.hooks.recovered.append(self.on_recovered)

    # ---------------------------------------------------------------- hooks

    def on_action(self, node: str, action: str, result: ActionResult) -> None:
        outcome = "ok" if result.ok else ("not_sent" if str(result.message).startswith(_NOT_SENT) else "failed")
        self.actions[(action, outcome)] += 1

    def on_recovered(self, row: IncidentRow) -> None:
        if row.detect_s is not None:
            self.detect.observe(row.detect_s)
        if row.recover_s is not None:
            self.recover.observe(row.recover_s)

    def render(self) -> bytes:
        """The text a scrape of ``/metrics`` returns (call it from the runtime's event loop)."""
        return generate_latest(self.registry)

    # ---------------------------------------------------------------- serving

    def bind(self, host: str, port: int) -> int:
        """Take the listening socket now; returns the bound port. ValueError in one sentence when it is taken."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(16)
        except OSError as exc:
            sock.close()
            raise ValueError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
        sock.setblocking(False)
        self._sock = sock
        return int(sock.getsockname()[1])

    async def start(self) -> None:
        """Answer scrapes from the bound socket, in this event loop."""
        if self._sock is None or self._server is not None:
            return
        self._server = await asyncio.start_server(self._serve, sock=self._sock)
        host, port = self._sock.getsockname()[:2]
        logger.info("console metrics on http://{}:{}/metrics", host, port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        elif self._sock is not None:
            self._sock.close()
        self._sock = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            parts = head[:_MAX_REQUEST].split(b"\r\n", 1)[0].split()
            method, path = (parts[0], parts[1].split(b"?", 1)[0]) if len(parts) >= 2 else (b"", b"")
            if method not in (b"GET", b"HEAD"):
                status, body, kind = b"405 Method Not Allowed", b"only GET\n", b"text/plain"
            elif path in (b"/metrics", b"/"):
                status, body, kind = b"200 OK", self.render(), CONTENT_TYPE_LATEST.encode()
            else:
                status, body, kind = b"404 Not Found", b"see /metrics\n", b"text/plain"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + kind + b"\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
                         + (body if method != b"HEAD" else b""))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass  # a client that went away or sent no request: nothing to answer
        except Exception:  # noqa: BLE001 - one bad scrape never stops the console
            logger.exception("answering a metrics scrape failed")
        finally:
            writer.close()


def serve_metrics(runtime: ConsoleRuntime, addr: str) -> ConsoleMetrics:
    """``runtime`` serves its /metrics on ``addr`` (HOST:PORT) from its start to its stop.

    The socket is bound now: ValueError in one sentence when ``addr`` is not
    HOST:PORT or cannot be listened on.
    """
    host, port = parse_metrics_addr(addr)
    metrics = ConsoleMetrics(runtime)
    metrics.port = metrics.bind(host, port)
    runtime.hooks.starting.append(metrics.start)
    runtime.hooks.stopping.append(metrics.close)
    return metrics


class _Collector(Collector):
    """Reads the runtime at scrape time."""

    def __init__(self, owner: ConsoleMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        runtime = self.owner.runtime
        open_by = dict.fromkeys(SEVERITIES, 0)
        rows = runtime.incidents.incidents(limit=10_000) if runtime.incidents is not None else []
        for row in rows:
            if row.state != "resolved":
                open_by[row.severity] = open_by.get(row.severity, 0) + 1
        family = GaugeMetricFamily(f"{PREFIX}incidents_open", "Incidents not resolved, by severity.",
                                   labels=["severity"])
        for severity, count in open_by.items():
            family.add_metric([severity], count)
        yield family
        by_phase = dict.fromkeys(Phase, 0)
        for row in rows:
            by_phase[row.phase] += 1
        phases = GaugeMetricFamily(f"{PREFIX}incidents", "Incidents by phase (open, acting, recovered, resolved), "
                                   "of the newest 10,000.", labels=["phase"])
        for phase, count in by_phase.items():
            phases.add_metric([phase.value], count)
        yield phases

        actions = CounterMetricFamily(f"{PREFIX}actions", "Steps sent to nodes, by action and outcome.",
                                      labels=["action", "outcome"])
        for (action, outcome), count in sorted(self.owner.actions.items()):
            actions.add_metric([action, outcome], count)
        yield actions

        windows = runtime.goodput.windows()
        ratio = GaugeMetricFamily(f"{PREFIX}goodput_ratio", "Productive training time over wall time.",
                                  labels=["window"])
        seconds = GaugeMetricFamily(f"{PREFIX}time_seconds", "Seconds of the window spent on each use "
                                    "(productive, or a named loss).", labels=["use", "window"])
        share = GaugeMetricFamily(f"{PREFIX}time_ratio", "Share of the window spent on each use.",
                                  labels=["use", "window"])
        for name, breakdown in windows.items():
            if breakdown.goodput is None:
                continue  # no trainer yet: N/A, not zero
            ratio.add_metric([name], breakdown.goodput)
            for use in TimeUse:
                seconds.add_metric([use.value, name], breakdown.seconds[use])
                share.add_metric([use.value, name], breakdown.share(use))
        yield ratio
        yield seconds
        yield share

        rel = runtime.goodput.reliability()
        for name, value, text in (("mttd_seconds", rel.mttd_s, "Mean time to detect over the run."),
                                  ("mttr_seconds", rel.mttr_s, "Mean time to recover over the run."),
                                  ("mtbf_seconds", rel.mtbf_s, "Mean time between failures over the run.")):
            gauge = GaugeMetricFamily(f"{PREFIX}{name}", text)
            if value is not None:
                gauge.add_metric([], value)
            yield gauge
