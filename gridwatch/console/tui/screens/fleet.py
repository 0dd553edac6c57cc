"""The home view: the GPU heatmap beside the node table, sortable and filterable."""

from __future__ import annotations

from rich.cells import cell_len
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Input, Static

from gridwatch.console.fleet.metrics import Metric
from gridwatch.console.fleet.node import NodeStatus
from gridwatch.console.fleet.prometheus import Panel
from gridwatch.console.fleet.rows import ON_TIME_INTERVALS, SORT_KEYS, VALUE_ORDER_EVERY_S, NodeRow, seen_age
from gridwatch.console.tui.screens.base import ViewScreen
from gridwatch.console.tui.screens.node import HOT_C
from gridwatch.console.tui.widgets import Column, GpuHeatmap, PlainStatic, TextTable, format_age, format_rate
from gridwatch.console.tui.widgets.heatmap import HEALTH_STEPS, LEGEND, cell_style
from gridwatch.console.tui.widgets.text_table import Cell

# What says why a node is bad (state, flags, how long since it was heard, its error) comes
# before the metrics, and the table narrows those columns before it lets one leave the screen.
NODE_COLUMNS = [
    Column("name", "NODE", 16, min_width=10, clip="start"),
    Column("status", "STATE", 10, min_width=7),
    Column("flags", "FLAGS", 18, min_width=8),
    Column("age", "SEEN", 6, "right"),
    Column("error", "ERROR", 24, min_width=8, grow=True),
    Column("job", "JOB", 10, clip="start"),
    Column("gpus", "GPUS", 5, "right"),
    Column("util", "UTIL %", 6, "right"),
    Column("temp", "TEMP °C", 7, "right"),
    Column("power", "POWER W", 7, "right"),
    Column("mem", "MEM %", 5, "right"),
    Column("rx", "RX", 7, "right"),
    Column("tx", "TX", 7, "right"),
    Column("step", "STEP TIME", 9, "right"),
]
KEPT_COLUMNS = 5  # NODE to ERROR

STATUS_STYLES: dict[NodeStatus, Style] = {
    NodeStatus.OK: Style(color="green"),
    NodeStatus.STALE: Style(color="yellow", bold=True),
    NodeStatus.DEGRADED: Style(color="red", bold=True),
    NodeStatus.DOWN: Style(color="red", bold=True),
    NodeStatus.REFUSED: Style(color="magenta", bold=True),
    NodeStatus.CONNECTING: Style(color="grey50"),
}
_BAD = Style(color="red", bold=True)
_WARN = Style(color="yellow")
_HOT = Style(color="yellow", bold=True)  # hot is a warning; red is for what is broken


def seen_text(age_s: float | None, every_s: float) -> str:
    """The SEEN cell: ``<1.5s`` for a node heard within its cadence (``<3.0s`` at summaries every 2 s), else how
    long ago it was heard.

    An age ticking over every second on each of a thousand rows is noise to read, and it makes every
    row new on every redraw (the table repaints only the rows that changed); a late node shows its age.
    """
    if seen_age(age_s, every_s) == 0.0:
        return "<" + format_age(ON_TIME_INTERVALS * every_s)
    return format_age(age_s)


def _num(value: float | None, fmt: str) -> str:
    return "N/A" if value is None else format(value, fmt)


def node_cells(row: NodeRow) -> list[Cell]:
    """One node-table row as plain-text cells, in NODE_COLUMNS' order: the node's strings are never markup."""
    gpus = f"{row.gpus - row.gpu_bad}/{row.gpus}" if row.gpu_bad else str(row.gpus)
    hot = row.temp_max is not None and row.temp_max >= HOT_C
    step = "N/A" if row.step_time_s is None else f"{row.step_time_s:.2f}s"
    return [
        (row.name, None),
        (str(row.status), STATUS_STYLES[row.status]),
        (row.flags, _BAD if row.flags else None),
        (seen_text(row.age_s, row.every_s), _WARN if row.status is not NodeStatus.OK else None),
        (row.error or "", _BAD if row.error else None),
        (row.job, None),
        (gpus, _BAD if row.gpu_bad else None),
        (_num(row.util, ".0f"), None),
        (_num(row.temp_max, ".0f"), _HOT if hot else None),
        (_num(row.power_w, ".0f"), None),
        (_num(row.mem_pct, ".0f"), None),
        (format_rate(row.rx_bps), None),
        (format_rate(row.tx_bps), None),
        (step, None),
    ]


class FleetScreen(ViewScreen):
    """Heatmap on the left, one table row per node on the right; enter opens a node."""

    VIEW_NAME = "nodes"
    BINDINGS = [
        Binding("slash", "filter", "Filter"),
        Binding("m", "metric", "Metric"),
        Binding("s", "sort", "Sort"),
        Binding("r", "reverse", "Reverse"),
        Binding("p", "preflight", "Pre-flight now"),
        Binding("z", "zoom", "Zoom"),
        Binding("w", "worst", "Worst GPU"),
        Binding("right_square_bracket", "heatmap_page(1)", "Heatmap page"),
        Binding("left_square_bracket", "heatmap_page(-1)", "Heatmap page back", show=False),
        Binding("tab", "switch_focus", "Heatmap/table", show=False),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.metric = Metric.UTIL
        self.sort_key = "name"
        self.reverse = False
        self.filter_text = ""
        self._only: tuple[list[str], frozenset[str]] | None = None  # the filter's names, as a set for the heatmap
        self._measured: list[str] | None = None  # the names list the name column was last fitted to

    def compose_view(self) -> ComposeResult:
        with Horizontal(id="fleet-body"):
            with Vertical(id="heatmap-pane"):
                yield PlainStatic(id="heatmap-legend")
                yield GpuHeatmap(id="heatmap")
            with Vertical(id="table-pane"):
                yield Input(placeholder="filter: part of a name, a state (stale, down) or a flag (patrol, preflight, isolated, stack)",
                            id="fleet-filter")
                yield TextTable(NODE_COLUMNS, keep=KEPT_COLUMNS, id="node-table")
                yield PlainStatic(id="node-detail")

    def prepare(self) -> None:
        self.query_one("#fleet-filter", Input).display = False
        self.query_one("#node-table", TextTable).focus()

    def refresh_view(self) -> None:
        rows = self.store.node_rows(self.sort_key, self.reverse, self.filter_text)
        table = self.query_one("#node-table", TextTable)
        table.sort_key, table.sort_reverse = self.sort_key, self.reverse
        names = rows.names  # the same list while the order stands: nothing here walks the fleet then
        if names is not self._measured:
            # The name column as wide as the longest name (within its width): room for the error on a narrow screen.
            self._measured = names
            table.limit_width("name", max(map(cell_len, names), default=0))
        table.set_rows(rows, names, node_cells)
        # The highlighted row only: at 12,500 nodes the table makes rows for the page it draws, no more.
        self._show_detail(rows[table.cursor] if 0 <= table.cursor < len(rows) else None)
        only = None
        if self.filter_text:
            if self._only is None or self._only[0] is not names:
                self._only = (names, frozenset(names))
            only = self._only[1]
        heatmap = self.query_one("#heatmap", GpuHeatmap)
        heatmap.set_nodes(self.store.heatmap(self.metric, only), highlight=table.cursor_key,
                          health=self.metric is Metric.HEALTH)
        self._show_legend(heatmap)
        shown = f"  filter {self.filter_text!r}: {len(rows)} shown" if self.filter_text else ""
        parts: list[str | tuple[str, str]] = [("gridwatch", "bold"), "  nodes", shown]
        if rows.as_of is not None and self.sort_key not in ("name", "status"):
            # A value order is made every few seconds (its rows' values are always fresh): say how old it is.
            age = format_age(max(self.store.clock.now() - rows.as_of, 0.0))
            parts.append((f"  {self.sort_key} order as of {age} ago, made every {VALUE_ORDER_EVERY_S:g} s", "grey50"))
        prom = self.runtime.prometheus
        if prom is not None:
            # Each panel's source in words: a Prometheus that is down or slow says so here, the rest keeps drawing.
            bad = prom.failing(Panel.GPUS) or prom.failing(Panel.HOSTS)
            parts.append(("  " + prom.status_line(), "bold red" if bad else "grey50"))
        self.set_title(*parts)

    def _show_legend(self, heatmap: GpuHeatmap) -> None:
        zoom = "a cell per node: its worst GPU, a line per rack" if heatmap.zoomed else "a cell per GPU"
        legend = Text(f"colour: {self.metric} (m)  {zoom} (z)  ")
        if heatmap.health:
            for index, (word, value) in enumerate(HEALTH_STEPS):
                legend.append(" " if index else "")
                legend.append("█", style=cell_style(value, health=True))
                legend.append(f" {word}")
        else:
            legend.append("cold ")
            for value in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0):
                legend.append("█", style=cell_style(value))
            legend.append(" hot")
        page, pages = heatmap.page
        if pages > 1:
            legend.append(f"  page {page}/{pages} ([ ] PgUp PgDn)", style="bold")
        legend.append("\n" + LEGEND)
        self.query_one("#heatmap-legend", Static).update(legend, layout=False)

    def _show_detail(self, row: NodeRow | None) -> None:
        """The highlighted node in one line, its error in full (the table column clips it)."""
        text = Text()
        if row is not None:
            text.append(row.name, style="bold")
            text.append(f"  {row.status}", style=STATUS_STYLES[row.status])
            text.append(f"  seen {seen_text(row.age_s, row.every_s)} ago")  # as its SEEN cell says it
            if row.flags:
                text.append(f"  {row.flags}", style=_BAD)
            if row.error:
                text.append("  " + row.error, style=_BAD)
        self.query_one("#node-detail", Static).update(text, layout=False)

    # ---------------------------------------------------------------- actions

    def action_filter(self) -> None:
        box = self.query_one("#fleet-filter", Input)
        box.display = True
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "fleet-filter":
            self.filter_text = event.value
            self.refresh_view()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "fleet-filter":
            self.query_one("#node-table", TextTable).focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#fleet-filter", Input)
        box.value = ""
        box.display = False
        self.filter_text = ""
        self.query_one("#node-table", TextTable).focus()
        self.refresh_view()

    def action_metric(self) -> None:
        metrics = list(Metric)
        self.metric = metrics[(metrics.index(self.metric) + 1) % len(metrics)]
        self.refresh_view()

    def action_sort(self) -> None:
        self.sort_key = SORT_KEYS[(SORT_KEYS.index(self.sort_key) + 1) % len(SORT_KEYS)]
        self.refresh_view()

    def action_reverse(self) -> None:
        self.reverse = not self.reverse
        self.refresh_view()

    def action_zoom(self) -> None:
        heatmap = self.query_one("#heatmap", GpuHeatmap)
        heatmap.set_zoom(not heatmap.zoomed)
        self._show_legend(heatmap)

    def action_worst(self) -> None:
        """Jump to the node with the worst GPU on the colour's metric, wherever it is in the fleet."""
        name = self.store.worst_node(self.metric)
        if name is None:
            self.gw.note = f"no GPU reports {self.metric}"
            return
        table = self.query_one("#node-table", TextTable)
        if not table.move_to(name):  # hidden by the filter: show the whole fleet again
            self.action_clear_filter()
            table.move_to(name)
        heatmap = self.query_one("#heatmap", GpuHeatmap)
        heatmap.highlight = name
        heatmap.scroll_to_node(name)
        heatmap.refresh()
        self._show_legend(heatmap)

    def action_heatmap_page(self, direction: int) -> None:
        heatmap = self.query_one("#heatmap", GpuHeatmap)
        step = max(heatmap.size.height, 1) * direction
        heatmap.scroll_to(y=max(int(heatmap.scroll_y) + step, 0), animate=False, immediate=True)
        self._show_legend(heatmap)

    def action_preflight(self) -> None:
        self.gw.run_preflight()

    def action_switch_focus(self) -> None:
        table = self.query_one("#node-table", TextTable)
        heatmap = self.query_one("#heatmap", GpuHeatmap)
        (heatmap if table.has_focus else table).focus()

    def on_text_table_selected(self, event: TextTable.Selected) -> None:
        self.gw.open_node(event.key)

    def on_text_table_highlighted(self, event: TextTable.Highlighted) -> None:
        table = self.query_one("#node-table", TextTable)
        if 0 <= table.cursor < len(table.rows):
            self._show_detail(table.rows[table.cursor])
        heatmap = self.query_one("#heatmap", GpuHeatmap)
        heatmap.highlight = event.key
        heatmap.refresh()

    def on_gpu_heatmap_node_clicked(self, event: GpuHeatmap.NodeClicked) -> None:
        self.query_one("#node-table", TextTable).move_to(event.name)
        self.gw.open_node(event.name)
