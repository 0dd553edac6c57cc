"""What a console keeps in its log store, and when: the lines behind events, the lines streamed, an incident's window.

:func:`keep_logs` attaches a :class:`gridwatch.console.runtime.logstore.LogStore` to a
runtime through its hooks (nothing in the runtime's frame path changes):

- every Event frame, as the line the Logs view shows for it (its severity kept);
- every LogLine frame (agents send them only to consoles subscribed to a node's logs);
- when an incident opens, the raw lines of its nodes (the node acted on and the nodes
  blamed) from 5 minutes before it, asked of their agents at once, as the plan starts;
  and, 5 minutes after it, the lines since.

With several consoles only the leader writes. Retention runs in the store's writer
thread once a minute; the open incidents' windows (from the incident store, read
here on the event loop) are never removed. :func:`search_logs` asks the store,
then the live agents, and merges the lines by time, each marked with where it came from.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from loguru import logger
from prometheus_client.registry import Collector

from gridwatch.console.fleet.node import event_text
from gridwatch.console.runtime.logstore import Evidence, LogRow, LogStore
from gridwatch.playbooks.store import OPEN_STATES
from gridwatch.wire.protocol import Event, LogLine

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from gridwatch.console.fleet.logquery import LogQuery
    from gridwatch.console.runtime.core import ConsoleRuntime
    from gridwatch.playbooks.plans import Plan

EVIDENCE_BEFORE_S = 300.0  # an incident's window: its nodes' lines from this long before it ...
EVIDENCE_AFTER_S = 300.0  # ... to this long after
PRUNE_EVERY_S = 60.0
WINDOW_NODES_MAX = 16  # nodes asked for an incident's window at most
WINDOW_LIMIT = 5000  # lines an agent answers one search with at most (gridwatch.agent.agent.search)
WINDOW_PATTERN = "."  # every line that has a character

_FEEDS: weakref.WeakKeyDictionary[ConsoleRuntime, LogFeed] = weakref.WeakKeyDictionary()


class LogFeed:
    """Feeds one runtime's frames and incidents into ``store``, and prunes it; see the module's docstring."""

    def __init__(self, runtime: ConsoleRuntime, store: LogStore, *, prune_every: float = PRUNE_EVERY_S,
                 before_s: float = EVIDENCE_BEFORE_S, after_s: float = EVIDENCE_AFTER_S, windows: bool = True) -> None:
        self.runtime = runtime
        self.store = store
        self.prune_every = prune_every
        self.before_s = before_s
        self.after_s = after_s
        self.windows = windows  # ask the agents for an incident's window when it opens
        self.captured: set[str] = set()  # incidents whose window was asked for
        self.windows_asked = 0  # searches sent for incidents' windows
        self._pruner: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ hooks (on the event loop, cheap)

    def on_frame(self, link: Any, frame: Any) -> None:
        kind = type(frame)
        if kind is not Event and kind is not LogLine:
            return
        try:
            if not self.leading:
                return
            node = str(frame.node) or str(getattr(link, "name", "") or "")
            if kind is Event:
                self.store.add(node, frame.ts or self.runtime.store.clock.now(), str(frame.source) or "event",
                               event_text(frame), str(frame.severity), "event")
            else:
                self.store.add(node, frame.line_ts or frame.ts, str(frame.source), str(frame.line))
        except Exception:  # noqa: BLE001 - the log store never stops the frames' path
            logger.exception("keeping a line in the log store failed")

    def on_plan(self, plan: Plan) -> None:
        incident = plan.incident
        if not self.windows or incident.id in self.captured or self.runtime.fleet is None or not self.leading:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # a runtime driven without a loop (a test's synthetic frames) asks no agent
        self.captured.add(incident.id)
        nodes = list(dict.fromkeys([incident.node, *incident.blamed]))[:WINDOW_NODES_MAX]
        self.runtime.spawn(self.capture(nodes, incident.opened_at))

    async def capture(self, nodes: list[str], at: float) -> None:
        """Ask ``nodes``' agents for their lines from ``before_s`` before ``at``, then, once ``after_s`` has passed, the rest."""
        fleet = self.runtime.fleet
        if fleet is None:
            return
        clock = self.runtime.store.clock
        try:
            await self._ask(nodes, at - self.before_s, at + self.after_s)
            wait = at + self.after_s - clock.now()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._ask(nodes, at, at + self.after_s)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - evidence is best effort; the plan goes on
            logger.exception("asking {} for the lines around an incident failed", ", ".join(nodes))

    async def _ask(self, nodes: list[str], since: float, until: float) -> None:
        fleet = self.runtime.fleet
        if fleet is None:
            return
        self.windows_asked += 1
        lines = await fleet.search(WINDOW_PATTERN, nodes, since, until, limit=WINDOW_LIMIT)
        self.store.write([LogRow(node=str(line.node), ts=line.line_ts or line.ts, source=str(line.source),
                                 line=str(line.line)) for line in lines], dedupe=True)

    @property
    def leading(self) -> bool:
        """With several consoles, only the one that leads keeps the logs."""
        election = self.runtime.election
        return election is None or election.leading

    # ------------------------------------------------------------ retention

    def evidence(self) -> list[Evidence]:
        """The windows pruning keeps: each open incident's nodes, from before its fault to after its detection."""
        plan_store = self.runtime.plan_store
        if plan_store is None or not hasattr(plan_store, "incidents"):
            return []
        out: list[Evidence] = []
        for rec in plan_store.incidents(states=OPEN_STATES, limit=10_000):
            start = min(rec.fault_at or rec.detected_at, rec.detected_at)
            for node in dict.fromkeys([rec.node, *rec.blamed]):
                out.append(Evidence(node, start - self.before_s, rec.detected_at + self.after_s))
        return out

    def prune_now(self) -> None:
        """Ask the store's writer to apply retention, keeping the open incidents' windows."""
        try:
            keep = self.evidence()
        except Exception:  # noqa: BLE001 - without the incidents nothing is pruned this round
            logger.exception("cannot read the open incidents: the log store is not pruned this round")
            return
        self.store.prune(keep, self.runtime.store.clock.now())

    async def start(self) -> None:
        if self.prune_every > 0 and self._pruner is None:
            self._pruner = asyncio.get_running_loop().create_task(self._prune_forever())

    async def _prune_forever(self) -> None:
        while True:
            self.prune_now()
            await asyncio.sleep(self.prune_every)

    async def stop(self) -> None:
        if self._pruner is not None:
            self._pruner.cancel()
            await asyncio.gather(self._pruner, return_exceptions=True)
            self._pruner = None
        await asyncio.to_thread(self.store.close)


def keep_logs(runtime: ConsoleRuntime, store: LogStore, registry: CollectorRegistry | None = None,
              **options: Any) -> LogFeed:
    """``runtime`` keeps its lines in ``store`` from now on (``options``: :class:`LogFeed`'s); counted in ``registry``."""
    feed = LogFeed(runtime, store, **options)
    runtime.hooks.frame.append(feed.on_frame)
    runtime.hooks.plan.append(feed.on_plan)
    runtime.hooks.starting.append(feed.start)
    runtime.hooks.stopping.append(feed.stop)
    if registry is not None:
        registry.register(LogStoreCollector(store))
    _FEEDS[runtime] = feed
    return feed


def log_feed_of(runtime: ConsoleRuntime) -> LogFeed | None:
    """The feed :func:`keep_logs` attached to ``runtime``, if any."""
    return _FEEDS.get(runtime)


def log_store_of(runtime: ConsoleRuntime) -> LogStore | None:
    """The log store ``runtime`` keeps, if any."""
    feed = _FEEDS.get(runtime)
    return feed.store if feed is not None else None


async def search_logs(runtime: ConsoleRuntime, query: LogQuery, now: float | None = None, limit: int = 2000,
                      on_progress: Callable[[int, int], None] | None = None,
                      agents_pattern: str | None = None) -> list[LogRow]:
    """The store first, then the live agents (for a query with a pattern, or ``agents_pattern`` when it has
    none, and no severity: raw lines carry none), merged by time, newest ``limit`` kept; each row's ``where``
    says which. A line both hold is the store's."""
    now = runtime.store.clock.now() if now is None else now
    since, until = query.window(now)
    store = log_store_of(runtime)
    rows: list[LogRow] = []
    if store is not None:
        rows = await asyncio.to_thread(store.query, query.nodes, since, until, query.min_severity,
                                       query.regex or None, limit)
    pattern = query.regex if query.pattern is not None else agents_pattern
    if pattern is not None and query.min_severity is None and runtime.fleet is not None:
        seen = {(r.node, r.ts, r.line) for r in rows}
        for line in await runtime.search(pattern, query.nodes, since, until, on_progress=on_progress):
            row = LogRow(node=str(line.node), ts=line.line_ts or line.ts, source=str(line.source), line=str(line.line),
                         where="agent")
            if (row.node, row.ts, row.line) not in seen:
                rows.append(row)
    rows.sort(key=lambda r: r.ts)
    return rows[-limit:] if limit else rows


class LogStoreCollector(Collector):
    """The log store's counters for the console's /metrics (``gridwatch_console_log_*``), read at scrape time."""

    def __init__(self, store: LogStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self.store.counters
        prefix = "gridwatch_console_log_"
        for name, value, text in (
            ("lines_written", c.written, "Lines written to the log store."),
            ("lines_dropped", c.dropped, "Lines dropped because the log store's write queue was full."),
            ("lines_failed", c.failed, "Lines the log store's disk refused."),
        ):
            family = CounterMetricFamily(f"{prefix}{name}", text)
            family.add_metric([], value)
            yield family
        pruned = CounterMetricFamily(f"{prefix}lines_pruned", "Lines the log store's retention removed, by reason "
                                     "(age: older than retention; size: over store_max).", labels=["reason"])
        pruned.add_metric(["age"], c.pruned_age)
        pruned.add_metric(["size"], c.pruned_size)
        yield pruned
        size = GaugeMetricFamily(f"{prefix}store_bytes", "Bytes the log store holds, as of its last write or prune.")
        size.add_metric([], self.store.bytes)
        yield size
