"""The fleet heatmap: one cell per GPU grouped by node, or zoomed out one cell per node grouped by rack; Line API."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from rich.cells import cell_len
from rich.color import Color
from rich.style import Style
from textual.events import Click, Resize
from textual.geometry import Size
from textual.message import Message

from gridwatch.console.fleet.node import NodeStatus
from gridwatch.console.fleet.rows import HeatmapNode, LazyRows
from gridwatch.console.tui.widgets.painted import PaintedOnce, Run, Runs, merged
from gridwatch.console.tui.widgets.plain import plain
from gridwatch.console.tui.widgets.text_table import fit
from gridwatch.sshlink.hostlist import compress

LABEL_MAX = 24  # a name column wider than this would crowd out the cells
GROUP_LABEL_MIN = 6  # a group's name above its cells gets at least this many columns
BUCKETS = 10
# Cold to hot for how busy a GPU is (util, temperature, power, memory), the same scale for each so a
# glance reads the same way: dark blue to pale yellow, never red, so that red on the console means broken.
_RAMP = ["#253494", "#2c5fa8", "#1d91c0", "#2fa8bf", "#41b6a4", "#5cc28a", "#8bd16f", "#b8dd5a", "#dde84e",
         "#f5ee55", "#fff9a8"]
_STYLES = [Style(color=Color.parse(c)) for c in _RAMP]
# The health metric (0 ok, 0.5 degraded, 1 failing) has its own three colours: red is failing.
HEALTH_STEPS = (("ok", 0.0), ("degraded", 0.5), ("failing", 1.0))
_HEALTH = [Style(color=Color.parse(c)) for c in ("#4caf50", "#ffc107", "#f44336")]
_NA = Style(color="grey50")
_DOWN = Style(color="red", dim=True)
_MARKS = {
    NodeStatus.DOWN: ("×", Style(color="red", bold=True)),
    NodeStatus.REFUSED: ("×", Style(color="magenta", bold=True)),
    NodeStatus.STALE: ("~", Style(color="yellow", bold=True)),
    NodeStatus.CONNECTING: ("…", Style(color="grey50")),
}
_ISOLATED = ("i", Style(color="cyan", bold=True))
_MISMATCH = ("!", Style(color="magenta", bold=True))
_CHECKS = ("P", Style(color="red", bold=True, reverse=True))
LEGEND = "marks: × down  ~ stale  P patrol/pre-flight failing\n       i isolated  ! stack differs  ? N/A"
ZOOM_LABEL = 18  # the group's name before its cells when zoomed out
_T = TypeVar("_T")
_RACK = re.compile(r"^(.+?)[-._][^-._]*$")  # rack12-node07 -> rack12


def _kept(cache: dict[str, tuple[tuple, Any]], node: HeatmapNode, look: tuple,
          make: Callable[[HeatmapNode, Style, Style | None], _T], base: Style, extra: Style | None) -> _T:
    """What ``make(node, base, extra)`` made last time, while the node's stamp and ``look`` are unchanged; else anew."""
    key = (node.stamp, look)
    kept = cache.get(node.name)
    if kept is not None and kept[0] == key:
        return kept[1]
    made = make(node, base, extra)
    cache[node.name] = (key, made)
    return made


def cell_style(value: float, health: bool = False) -> Style:
    """A cell's colour for a 0..1 value: the cold-to-hot ramp, or with ``health`` ok/degraded/failing."""
    if health:
        return _HEALTH[0 if value < 0.25 else 1 if value < 0.75 else 2]
    return _STYLES[min(max(int(value * BUCKETS + 0.5), 0), BUCKETS)]


def node_mark(node: HeatmapNode) -> tuple[str, Style | None]:
    """The one-character mark before a node's cells: worst condition wins."""
    if node.status in _MARKS:
        return _MARKS[node.status]
    if node.checks_failing:
        return _CHECKS
    if node.isolated:
        return _ISOLATED
    if node.mismatch:
        return _MISMATCH
    return (" ", None)


def common_suffix(names: list[str]) -> str:
    """The domain all names share (``.cluster.local``), which a short label can drop."""
    if len(names) < 2:
        return ""
    shared = os.path.commonprefix([n[::-1] for n in names])[::-1]
    dot = shared.find(".")
    return shared[dot:] if dot >= 0 else ""


def group_runs(names: Sequence[str], per_line: int) -> list[tuple[int, int]]:
    """Lines of the zoomed-out heatmap: (start, stop) runs of nodes in the same rack, at most ``per_line`` a line.

    A rack is what a name says before its last ``-``, ``.`` or ``_`` (``rack12-node07``);
    names without one (``node00042``) fall into blocks of consecutive nodes.
    """
    runs: list[tuple[int, int]] = []
    start = 0
    key: str | None = None
    suffix = common_suffix(list(names))  # a shared domain is no rack
    for i, name in enumerate(names):
        m = _RACK.match(name[: -len(suffix)] if suffix else name)
        k = m.group(1) if m else ""
        if i == start:
            key = k
        elif k != key or i - start >= per_line:
            runs.append((start, i))
            start, key = i, k
    if len(names) > start:
        runs.append((start, len(names)))
    return runs


def short_label(name: str, width: int, suffix: str = "") -> str:
    """A name in ``width`` cells keeping its end, where node names differ (``…a17-n03``)."""
    name = plain(name)
    if suffix and name.endswith(suffix) and len(name) > len(suffix):
        name = name[: -len(suffix)]
    if cell_len(name) <= width:
        return fit(name, width)
    return "…" + name[len(name) - width + 1 :] if width > 1 else name[-width:]


class GpuHeatmap(PaintedOnce, can_focus=True):
    """Nodes' cells in blocks; every block is labelled with its node's name.

    When every node fits on screen, one node a line with its full name. When
    not (1,250 nodes of 8 GPUs in 80 columns: 8 nodes a line, 157 pairs of
    lines, scrolled), each line of cells has a line above it naming each block,
    the end of the name kept. Only the lines on screen are drawn.
    """

    DEFAULT_CSS = """
    GpuHeatmap { height: 1fr; }
    GpuHeatmap > .gpu-heatmap--label { color: $text-muted; }
    GpuHeatmap > .gpu-heatmap--highlight { text-style: reverse; }
    """
    COMPONENT_CLASSES = {"gpu-heatmap--label", "gpu-heatmap--highlight"}

    class NodeClicked(Message):
        """A node's cells were clicked."""

        def __init__(self, heatmap: GpuHeatmap, name: str) -> None:
            super().__init__()
            self.heatmap = heatmap
            self.name = name

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.nodes: Sequence[HeatmapNode] = []
        self.highlight: str | None = None
        self.zoomed = False  # one cell per node (its worst GPU), a line per rack
        self.health = False  # the values are health (ok, degraded, failing), not how busy a GPU is
        self._names: list[str] = []
        self._cells_per_node = 8
        self._per_line = 1
        self._one_per_line = True
        self._label_width = 0  # the name column when one node a line
        self._suffix = ""
        self._suffix_of: list[str] | None = None  # the names list the suffix was found in
        self._runs: list[tuple[int, int]] = []  # zoomed out: the nodes of each line
        self._runs_for: tuple[int, str, str, int] | None = None
        self._run_labels: dict[int, str] = {}
        # Node name -> (its stamp, highlighted and the view's look; its block's runs, or zoomed out its one cell).
        self._node_runs: dict[str, tuple[tuple, Any]] = {}
        self._node_cell: dict[str, tuple[tuple, Any]] = {}
        self._styles: dict[tuple[Style, Style, Style | None], Style] = {}  # base + a cell's style (+ highlight), once
        self._counted = -1  # how many nodes the cells per node were counted over
        self._uncounted = True  # some node had not said how many GPUs it has when they were counted

    def set_nodes(self, nodes: Sequence[HeatmapNode], highlight: str | None = None, health: bool = False) -> None:
        """Replace the cells (once a tick) and redraw the visible lines; ``health``: the values are health."""
        self.nodes = nodes
        self.highlight = highlight
        self.health = health
        if isinstance(nodes, LazyRows):
            # Read from the nodes, not their cells: a cell is made only for a line on screen.
            self._names = nodes.names
            # Counted again when nodes come or go, not every tick; and until every node has said how many GPUs
            # it has (a node listed before its hello counts none, and would leave one cell per node for good).
            if len(nodes) != self._counted or self._uncounted:
                self._counted = len(nodes)
                counts = [n.gpu_count for n in nodes.nodes]
                self._uncounted = not counts or min(counts) == 0
                self._cells_per_node = max(counts, default=8) or 1
        else:
            self._names = [n.name for n in nodes]
            self._cells_per_node = max((n.gpus for n in nodes), default=8) or 1
        if len(self._node_runs) > len(self._names) or len(self._node_cell) > len(self._names):
            # Nodes went (or were renamed): their cells go too, with the readings they hold.
            shown = set(self._names)
            self._node_runs = {k: v for k, v in self._node_runs.items() if k in shown}
            self._node_cell = {k: v for k, v in self._node_cell.items() if k in shown}
        self._layout()
        self.refresh_changed()  # once a tick: only the lines whose cells changed are painted again

    def set_zoom(self, zoomed: bool) -> None:
        """Zoom out (one cell per node) or in (one cell per GPU), keeping the highlighted node on screen."""
        self.zoomed = zoomed
        self._layout()
        self.scroll_to_node(self.highlight)
        self.refresh()

    def line_of(self, name: str) -> int | None:
        """The first line the node's cells are drawn on, if it is shown."""
        try:
            index = self._names.index(name)
        except ValueError:
            return None
        if self.zoomed:
            return next((i for i, (a, b) in enumerate(self._runs) if a <= index < b), None)
        if self._one_per_line:
            return index
        return 2 * (index // self._per_line)

    def scroll_to_node(self, name: str | None) -> None:
        """Scroll so the node's line is on screen (a far page included)."""
        line = self.line_of(name) if name else None
        if line is None:
            return
        top, height = int(self.scroll_y), max(self.size.height, 1)
        if not top <= line < top + height - 1:
            self.scroll_to(y=max(line - height // 2, 0), animate=False, immediate=True)

    @property
    def page(self) -> tuple[int, int]:
        """(page shown, pages), counted in screens of lines: what PgUp/PgDn move by."""
        height = max(self.size.height, 1)
        pages = max(-(-self.virtual_size.height // height), 1)
        top = int(self.scroll_y)
        if top and top >= self.max_scroll_y:
            return pages, pages  # scrolled to the end: the last page, however short
        return min(top // height + 1, pages), pages

    @property
    def _block(self) -> int:
        """Columns per node: its mark, its cells, and room for its label in grouped lines."""
        cells = self._cells_per_node
        return 1 + (cells if self._one_per_line else max(cells, GROUP_LABEL_MIN))

    def _layout(self) -> None:
        count = len(self.nodes)
        if self.zoomed:
            self._one_per_line = False
            per_line = max(self.size.width - ZOOM_LABEL - 1, 1)
            key = (count, self._names[0] if count else "", self._names[-1] if count else "", per_line)
            if key != self._runs_for:
                self._runs, self._runs_for = group_runs(self._names, per_line), key
                self._run_labels = {}
            self.virtual_size = Size(self.size.width, len(self._runs))
            return
        self._one_per_line = count <= max(self.size.height, 1)
        if self._one_per_line:
            self._per_line = 1
            self._label_width = min(max((cell_len(n.name) for n in self.nodes), default=0), LABEL_MAX) + 1
            self._suffix, self._suffix_of = "", None
            lines = count
        else:
            self._per_line = max(self.size.width // self._block, 1)
            self._label_width = 0
            if self._suffix_of is not self._names:  # the store keeps one names list until nodes come or go
                self._suffix, self._suffix_of = common_suffix(self._names), self._names
            lines = 2 * -(-count // self._per_line)
        self.virtual_size = Size(self.size.width, lines)

    def on_resize(self, event: Resize) -> None:
        self._layout()

    def node_at(self, x: int, y: int) -> str | None:
        """The node drawn at screen offset (x, y), name or cells, if any."""
        line = y + int(self.scroll_y)
        if self.zoomed:
            if not 0 <= line < len(self._runs) or x < ZOOM_LABEL + 1:
                return None
            start, stop = self._runs[line]
            index = start + x - ZOOM_LABEL - 1
            return self._names[index] if index < stop else None
        if self._one_per_line:
            return self.nodes[line].name if 0 <= line < len(self.nodes) else None
        slot = x // self._block
        index = (line // 2) * self._per_line + slot
        if x < 0 or slot >= self._per_line or index >= len(self.nodes):
            return None
        return self.nodes[index].name

    def on_click(self, event: Click) -> None:
        name = self.node_at(event.x, event.y)
        if name is not None:
            self.post_message(self.NodeClicked(self, name))

    def line_runs(self, y: int) -> Runs:
        width = self.size.width
        base = self.paint_style
        line = y + int(self.scroll_y)
        if self.zoomed:
            return self._zoomed_line(line, width, base)
        per_line = self._per_line
        start = line * per_line if self._one_per_line else (line // 2) * per_line
        chunk = self.nodes[start : start + per_line]
        if not chunk:
            return ((" " * width, base),)
        label_style = base + self.get_component_rich_style("gpu-heatmap--label")
        hi = self.get_component_rich_style("gpu-heatmap--highlight")
        if not self._one_per_line and line % 2 == 0:
            return self._label_line(chunk, label_style, label_style + hi, base)
        segments: list[Run] = []
        if self._one_per_line:
            name = chunk[0].name
            style = label_style + hi if name == self.highlight else label_style
            segments.append((fit(name, self._label_width - 1), style))
            segments.append((" ", base))
        # A node's cells are made again only when what they show changed (a new reading, a new state): at a
        # redraw a second and summaries every few, most nodes on screen have no news.
        view = (base, hi, self.health, self._cells_per_node, self._block)
        for node in chunk:
            lit = node.name == self.highlight
            segments.extend(_kept(self._node_runs, node, (lit, view), self._cells_of, base, hi if lit else None))
        return merged(segments)

    def _cells_of(self, node: HeatmapNode, base: Style, extra: Style | None) -> Runs:
        """One node's block: its mark, a cell per GPU, the padding; cells of one style in a row as one run."""
        styles = self._styles

        def combined(style: Style, extra: Style | None) -> Style:
            key = (base, style, extra)
            found = styles.get(key)
            if found is None:
                found = styles[key] = base + style + extra if extra else base + style
            return found

        mark, mark_style = node_mark(node)
        runs: list[Run] = [(mark, combined(mark_style, None) if mark_style else base)]
        down = node.status in (NodeStatus.DOWN, NodeStatus.REFUSED)
        stale = node.status is NodeStatus.STALE
        values = node.values
        for i in range(self._cells_per_node):
            value = values[i] if i < len(values) else None
            if value is None:
                glyph, style = ("·" if down else "?"), (_DOWN if down else _NA)
            else:
                # A stale node keeps its last colours, shaded so it reads as old.
                glyph, style = ("▒" if stale else "█"), (_DOWN if down else cell_style(value, self.health))
            runs.append((glyph, combined(style, extra)))
        runs.extend([(" ", base)] * (self._block - 1 - self._cells_per_node))
        return merged(runs)

    def _label_line(self, chunk: Sequence[HeatmapNode], style: Style, hi_style: Style, base: Style) -> Runs:
        """The names above a line of blocks, each over its own cells (the mark column left blank)."""
        label_width = self._block - 1
        segments: list[Run] = []
        for node in chunk:
            segments.append((" ", base))
            text = short_label(node.name, label_width, self._suffix)
            segments.append((text, hi_style if node.name == self.highlight else style))
        return merged(segments)

    def _zoomed_cell(self, node: HeatmapNode, base: Style, extra: Style | None) -> tuple[str, Style]:
        """A node's one cell zoomed out: its mark when down, stale or failing checks, else its worst GPU's colour."""
        if node.status in _MARKS:  # a down or stale node shows its mark, not an old colour
            glyph, style = _MARKS[node.status]
        elif node.checks_failing:
            glyph, style = _CHECKS
        else:
            value = node.worst
            glyph, style = ("?", _NA) if value is None else ("█", cell_style(value, self.health))
        return glyph, (base + style + extra if extra else base + style)

    def _zoomed_line(self, line: int, width: int, base: Style) -> Runs:
        """A rack's nodes, one cell each coloured by its worst GPU, after the rack's name (hostlist form)."""
        if not 0 <= line < len(self._runs):
            return ((" " * width, base),)
        start, stop = self._runs[line]
        label_style = base + self.get_component_rich_style("gpu-heatmap--label")
        hi = self.get_component_rich_style("gpu-heatmap--highlight")
        label = self._run_labels.get(line)
        if label is None:
            label = self._run_labels[line] = short_label(compress(self._names[start:stop]), ZOOM_LABEL)
        segments: list[Run] = [(label, label_style), (" ", base)]
        view = (base, hi, self.health)
        for i in range(start, stop):
            node = self.nodes[i]
            lit = node.name == self.highlight
            segments.append(_kept(self._node_cell, node, (lit, view), self._zoomed_cell, base, hi if lit else None))
        return merged(segments)
