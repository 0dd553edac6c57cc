"""Events and log lines across nodes: filter locally, or search the agents and merge by time."""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Input, Static

from console.fleet.state import LogEntry, LogQuery, QueryError, parse_log_query
from console.tui.screens.base import ViewScreen
from console.tui.screens.node import SEVERITY_STYLES, clock_time
from console.tui.widgets import Column, PlainStatic, TextTable
from console.tui.widgets.text_table import Cell

LOG_COLUMNS = [
    Column("time", "TIME", 8),
    Column("node", "NODE", 16),
    Column("sev", "SEV", 8),
    Column("source", "SOURCE", 18),
    Column("text", "TEXT", 160),
]
_LOG_LINE = Style(dim=True)
# A query naming this many nodes or fewer streams their raw log lines while the view is open.
STREAM_NODES_MAX = 16


def entry_cells(entry: LogEntry) -> list[Cell]:
    return [
        (clock_time(entry.ts), None),
        (entry.node, None),
        (entry.severity or "log", SEVERITY_STYLES.get(entry.severity, _LOG_LINE)),
        (entry.source, None),
        (entry.text, None if entry.is_event else _LOG_LINE),
    ]


class LogsScreen(ViewScreen):
    """A query line (``node:SET sev:LEVEL since:10m until:1m REGEX``) over a merged table."""

    VIEW_NAME = "logs"
    BINDINGS = [
        Binding("slash", "edit_query", "Query"),
        Binding("ctrl+s", "search_agents", "Search agents"),
        Binding("ctrl+l", "live", "Back to live", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.query_text = ""
        self.log_query = LogQuery()
        self.query_error = ""
        self.search_results: list[LogEntry] | None = None
        self.progress = ""
        self.streaming: list[str] = []

    def compose_view(self) -> ComposeResult:
        yield Input(placeholder="node:node[01-04] sev:error since:10m until:1m REGEX   (enter: filter, "
                                "ctrl+s: search the agents)", id="logs-query")
        yield PlainStatic(id="logs-info")
        yield TextTable(LOG_COLUMNS, id="logs-table")

    def prepare(self) -> None:
        self.query_one("#logs-table", TextTable).focus()

    def refresh_view(self) -> None:
        entries = self.search_results if self.search_results is not None else self.store.log_entries(self.log_query)
        table = self.query_one("#logs-table", TextTable)
        follow = table.cursor >= len(table.rows) - 1
        table.set_rows([entry_cells(e) for e in entries], [str(i) for i in range(len(entries))])
        if follow and entries:
            table.cursor = len(entries) - 1
        info = Text()
        if self.query_error:
            info.append(self.query_error, style="bold red")
        elif self.search_results is not None:
            info.append(f"search {self.log_query.regex!r}: {len(entries)} lines from the agents  ", style="bold")
            info.append(self.progress)
            info.append("  (ctrl+l: back to live)", style="dim")
        else:
            info.append(f"live: {len(entries)} events and streamed lines", style="bold")
            if self.progress:
                info.append("  " + self.progress)
        self.query_one("#logs-info", Static).update(info, layout=False)
        self.set_title(("gridwatch", "bold"), "  logs", f"  {self.query_text}" if self.query_text else "")

    def _parse(self) -> bool:
        text = self.query_one("#logs-query", Input).value
        try:
            self.log_query = parse_log_query(text)
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
        if not self._parse():
            return
        if self.log_query.pattern is None:
            self.query_error = "a search needs a regular expression to send to the agents"
            self.refresh_view()
            return
        self.progress = "asking the agents…"
        self.search_results = []
        self.refresh_view()
        self.run_worker(self._search(), exclusive=True, group="log-search")

    async def _search(self) -> None:
        query = self.log_query
        now = self.store.clock.now()
        since = now - query.since_s if query.since_s is not None else None
        until = now - query.until_s if query.until_s is not None else None

        def progress(answered: int, total: int) -> None:
            self.progress = f"{answered}/{total} agents answered"
            self.refresh_view()

        try:
            lines = await self.runtime.search(query.regex, query.nodes, since, until, on_progress=progress)
        except Exception as exc:  # noqa: BLE001 - the operator sees why; the screen keeps going
            self.query_error = f"search failed: {type(exc).__name__}: {exc}"
            self.search_results = None
            self.refresh_view()
            return
        results = [LogEntry(line.line_ts or line.ts, str(line.node), "", str(line.source), str(line.line), False)
                   for line in lines]
        results.sort(key=lambda e: e.ts)
        self.search_results = results
        if not self.progress.endswith("answered"):
            self.progress = "done"
        self.refresh_view()
