"""Events and log lines across nodes: filter locally, or search the agents and merge by time."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime, tzinfo

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Input, Static

from gridwatch.console.fleet.logquery import LogEntry, LogQuery, QueryError, parse_log_query
from gridwatch.console.fleet.logtime import console_zone, format_time, zone_label
from gridwatch.console.tui.screens.base import ViewScreen
from gridwatch.console.tui.screens.node import SEVERITY_STYLES
from gridwatch.console.tui.widgets import Column, PlainStatic, TextTable
from gridwatch.console.tui.widgets.text_table import Cell

LOG_COLUMNS = [
    Column("time", "TIME", 8),
    Column("node", "NODE", 16),
    Column("sev", "SEV", 8),
    Column("source", "SOURCE", 18),
    Column("text", "TEXT", 160, grow=True),
]
_LOG_LINE = Style(dim=True)
# A query naming this many nodes or fewer streams their raw log lines while the view is open.
STREAM_NODES_MAX = 16
# Lines that name the blamed rank, and lines of the blamed node: a style, never markup (node text stays plain).
RANK_LINE = Style(color="black", bgcolor="yellow", bold=True)
BLAMED_NODE_LINE = Style(color="yellow")
# "[Rank 2]", "rank=2", "rank 2", "rank: 2"; not "local_rank=2" (a rank within one node).
_RANK = re.compile(r"\brank\s*[=:#]?\s*(\d+)\b", re.IGNORECASE)


def ranks_named(text: str) -> set[int]:
    """The ranks a line or an incident's summary names."""
    return {int(m.group(1)) for m in _RANK.finditer(text)}


@dataclass(frozen=True, slots=True)
class Highlight:
    """Which lines to mark: those naming one of ``ranks``, and those of the ``nodes`` blamed."""

    ranks: frozenset[int] = frozenset()
    nodes: frozenset[str] = frozenset()

    def style(self, entry: LogEntry) -> Style | None:
        if self.ranks and ranks_named(entry.text) & self.ranks:
            return RANK_LINE
        if entry.node in self.nodes:
            return BLAMED_NODE_LINE
        return None


@dataclass(frozen=True, slots=True)
class LogWindow:
    """What the logs view opens on from an incident: its nodes, a time range around it, what to mark."""

    label: str  # e.g. "incident xid-hardware:node-3:1700000000"
    nodes: list[str]
    since: float
    until: float
    highlight: Highlight = field(default_factory=Highlight)

    def query(self, zone: tzinfo) -> str:
        """The query line that shows the same range (whole seconds, widened outwards)."""
        return (f"node:{','.join(self.nodes)} since:{format_time(math.floor(self.since), zone)} "
                f"until:{format_time(math.ceil(self.until), zone)}")


def entry_cells(entry: LogEntry, zone: tzinfo | None = None, mark: Style | None = None) -> list[Cell]:
    text_style = mark or (None if entry.is_event else _LOG_LINE)
    return [
        (datetime.fromtimestamp(entry.ts, zone).strftime("%H:%M:%S") if entry.ts else "--:--:--", mark),
        (entry.node, mark),
        (entry.severity or "log", SEVERITY_STYLES.get(entry.severity, _LOG_LINE)),
        (entry.source, mark),
        (entry.text, text_style),
    ]


class LogsScreen(ViewScreen):
    """A query line (``node:SET sev:LEVEL since:10m until:1m REGEX``) over a merged table.

    ``since``/``until`` take absolute times too (``since:03:10 until:03:15``,
    ``since:2026-12-01T03:10``), in the console's zone, which the view names.
    Opened on a :class:`LogWindow` (from an incident), it searches the agents
    for every line of those nodes in that range at once and marks the blamed ones.
    """

    VIEW_NAME = "logs"
    AT_CADENCE = False  # log lines come as they come, not at the summaries' cadence
    BINDINGS = [
        Binding("slash", "edit_query", "Query"),
        Binding("ctrl+s", "search_agents", "Search store+agents"),
        Binding("ctrl+l", "live", "Back to live", show=False),
    ]

    def __init__(self, window: LogWindow | None = None) -> None:
        super().__init__()
        self.window = window
        self.zone = console_zone()
        self.query_text = ""
        self.log_query = LogQuery()
        self.query_error = ""
        self.search_results: list[LogEntry] | None = None
        self.progress = ""
        self.streaming: list[str] = []

    @property
    def zone_text(self) -> str:
        return f"times in {zone_label(self.zone, self.store.clock.now())}"

    def compose_view(self) -> ComposeResult:
        yield Input(placeholder="node:node[01-04] sev:error since:10m|03:10|2026-12-01T03:10 until:1m REGEX   "
                                f"({self.zone_text}; enter: filter, ctrl+s: search the store and the agents)", id="logs-query")
        yield PlainStatic(id="logs-info")
        yield TextTable(LOG_COLUMNS, id="logs-table")

    def prepare(self) -> None:
        self.query_one("#logs-table", TextTable).focus()
        if self.window is not None:
            self.query_one("#logs-query", Input).value = self.window.query(self.zone)
            if self._parse():
                self._start_search(every_line=True)  # every line of those nodes in the range, not only matches

    def refresh_view(self) -> None:
        entries = self.search_results if self.search_results is not None else self.store.log_entries(self.log_query)
        table = self.query_one("#logs-table", TextTable)
        follow = table.cursor >= len(table.rows) - 1
        highlight = self.window.highlight if self.window is not None else None
        table.set_rows([entry_cells(e, self.zone, highlight.style(e) if highlight else None) for e in entries],
                       [str(i) for i in range(len(entries))])
        if follow and entries:
            table.cursor = len(entries) - 1
        info = Text()
        if self.query_error:
            info.append(self.query_error, style="bold red")
        elif self.search_results is not None and self.window is not None:
            info.append(f"{self.window.label}: {len(entries)} lines and events of {', '.join(self.window.nodes)}  ",
                        style="bold")
            info.append(self.progress)
            if self.window.highlight.ranks:
                ranks = ", ".join(str(r) for r in sorted(self.window.highlight.ranks))
                info.append(f"  marked: rank {ranks}", style=RANK_LINE)
            if self.window.highlight.nodes:
                info.append(f"  {', '.join(sorted(self.window.highlight.nodes))}", style=BLAMED_NODE_LINE)
            info.append("  (ctrl+l: live)", style="dim")
        elif self.search_results is not None:
            kept = sum(1 for e in entries if e.source.startswith("store: "))
            info.append(f"search {self.log_query.regex!r}: {len(entries)} lines, {kept} from the console's store, "
                        f"{len(entries) - kept} from the agents  ", style="bold")
            info.append(self.progress)
            info.append("  (ctrl+l: back to live)", style="dim")
        else:
            info.append(f"live: {len(entries)} events and streamed lines", style="bold")
            if self.progress:
                info.append("  " + self.progress)
        info.append(f"  ({self.zone_text})", style="dim")
        self.query_one("#logs-info", Static).update(info, layout=False)
        self.set_title(("gridwatch", "bold"), "  logs", f"  {self.query_text}" if self.query_text else "")

    def _parse(self) -> bool:
        text = self.query_one("#logs-query", Input).value
        try:
            self.log_query = parse_log_query(text, self.store.clock.now(), self.zone)
        except QueryError as exc:
            self.query_error = str(exc)
            self.refresh_view()
            return False
        self.query_text = text
        self.query_error = ""
        self._stream(self.log_query.nodes if self.log_query.nodes and len(self.log_query.nodes) <= STREAM_NODES_MAX
                     else [])
        return True

    def _stream(self, nodes: list[str]) -> None:
        """Stream raw lines of a small node set; logs stay on the nodes otherwise (search them)."""
        for node in set(self.streaming) - set(nodes):
            self.runtime.subscribe_logs(node, False)
        for node in set(nodes) - set(self.streaming):
            self.runtime.subscribe_logs(node, True)
        self.streaming = list(nodes)

    def on_unmount(self) -> None:
        self._stream([])

    def action_edit_query(self) -> None:
        self.query_one("#logs-query", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if self._parse():
            self.search_results = None
            self.query_one("#logs-table", TextTable).focus()
        self.refresh_view()

    def action_live(self) -> None:
        self.search_results = None
        self.progress = ""
        self.refresh_view()

    def action_search_agents(self) -> None:
        from gridwatch.console.runtime.logfeed import log_store_of

        if not self._parse():
            return
        if self.log_query.pattern is None and log_store_of(self.runtime) is None:
            self.query_error = "a search needs a regular expression to send to the agents"
            self.refresh_view()
            return
        self._start_search()

    def _start_search(self, every_line: bool = False) -> None:
        self.progress = "reading the log store, then asking the agents…"
        self.search_results = []
        self.refresh_view()
        self.run_worker(self._search(every_line), exclusive=True, group="log-search")

    async def _search(self, every_line: bool = False) -> None:
        query = self.log_query
        since, until = query.window(self.store.clock.now())

        def progress(answered: int, total: int) -> None:
            self.progress = f"{answered}/{total} agents answered"
            self.refresh_view()

        from gridwatch.console.runtime.logfeed import log_store_of, search_logs

        try:
            # The console's store first (it keeps lines of nodes that are gone), then the live agents;
            # each line marked with where it came from.
            rows = await search_logs(self.runtime, query, now=self.store.clock.now(), on_progress=progress,
                                     agents_pattern="" if every_line else None)
        except Exception as exc:  # noqa: BLE001 - the operator sees why; the screen keeps going
            self.query_error = f"search failed: {type(exc).__name__}: {exc}"
            self.search_results = None
            self.refresh_view()
            return
        # Where each line came from leads its source, so a narrow column still shows it.
        results = [LogEntry(row.ts, row.node, row.severity, f"{row.where}: {row.source}", row.line,
                            row.kind == "event") for row in rows]
        if self.window is not None and log_store_of(self.runtime) is None:
            # The incident's own events (the XID, the watchdog) sit among the lines around them.
            results.extend(e for e in self.store.log_entries(query) if e.is_event)
        results.sort(key=lambda e: e.ts)
        self.search_results = results
        if not self.progress.endswith("answered"):
            self.progress = "done"
        self.refresh_view()
