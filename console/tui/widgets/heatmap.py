"""The fleet heatmap: one cell per GPU, grouped by node, drawn with the Line API."""

from __future__ import annotations

import os

from rich.color import Color
from rich.segment import Segment
from rich.style import Style
from rich.cells import cell_len
from textual.events import Click, Resize
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from console.fleet.state import HeatmapNode, NodeStatus
from console.tui.widgets.plain import plain
from console.tui.widgets.text_table import fit

LABEL_MAX = 24  # a name column wider than this would crowd out the cells
GROUP_LABEL_MIN = 6  # a group's name above its cells gets at least this many columns
BUCKETS = 10
# Cold to hot; the same scale for every metric so a glance reads the same way.
_RAMP = ["#2b4c7e", "#2f7fa3", "#2fa38a", "#4caf50", "#8bc34a", "#cddc39", "#ffeb3b", "#ffc107", "#ff9800",
         "#f44336", "#d50000"]
_STYLES = [Style(color=Color.parse(c)) for c in _RAMP]
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


def cell_style(value: float) -> Style:
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


def short_label(name: str, width: int, suffix: str = "") -> str:
    """A name in ``width`` cells keeping its end, where node names differ (``…a17-n03``)."""
    name = plain(name)
    if suffix and name.endswith(suffix) and len(name) > len(suffix):
        name = name[: -len(suffix)]
    if cell_len(name) <= width:
        return fit(name, width)
    return "…" + name[len(name) - width + 1 :] if width > 1 else name[-width:]


class GpuHeatmap(ScrollView, can_focus=True):
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
        self.nodes: list[HeatmapNode] = []
        self.highlight: str | None = None
        self._cells_per_node = 8
        self._per_line = 1
        self._one_per_line = True
        self._label_width = 0  # the name column when one node a line
        self._suffix = ""

    def set_nodes(self, nodes: list[HeatmapNode], highlight: str | None = None) -> None:
        """Replace the cells (once a tick) and redraw the visible lines."""
        self.nodes = nodes
        self.highlight = highlight
        self._cells_per_node = max((n.gpus for n in nodes), default=8) or 1
        self._layout()
        self.refresh()

    @property
    def _block(self) -> int:
        """Columns per node: its mark, its cells, and room for its label in grouped lines."""
        cells = self._cells_per_node
        return 1 + (cells if self._one_per_line else max(cells, GROUP_LABEL_MIN))

    def _layout(self) -> None:
        count = len(self.nodes)
        self._one_per_line = count <= max(self.size.height, 1)
        if self._one_per_line:
            self._per_line = 1
            self._label_width = min(max((cell_len(n.name) for n in self.nodes), default=0), LABEL_MAX) + 1
            self._suffix = ""
            lines = count
        else:
            self._per_line = max(self.size.width // self._block, 1)
            self._label_width = 0
            self._suffix = common_suffix([n.name for n in self.nodes])
            lines = 2 * -(-count // self._per_line)
        self.virtual_size = Size(self.size.width, lines)

    def on_resize(self, event: Resize) -> None:
        self._layout()

    def node_at(self, x: int, y: int) -> str | None:
        """The node drawn at screen offset (x, y), name or cells, if any."""
        line = y + int(self.scroll_y)
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

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.rich_style
        line = y + int(self.scroll_y)
        per_line = self._per_line
        start = line * per_line if self._one_per_line else (line // 2) * per_line
        chunk = self.nodes[start : start + per_line]
        if not chunk:
            return Strip.blank(width, base)
        label_style = base + self.get_component_rich_style("gpu-heatmap--label")
        hi = self.get_component_rich_style("gpu-heatmap--highlight")
        if not self._one_per_line and line % 2 == 0:
            return self._label_line(chunk, label_style, label_style + hi, width, base)
        segments: list[Segment] = []
        if self._one_per_line:
            name = chunk[0].name
            style = label_style + hi if name == self.highlight else label_style
            segments.append(Segment(fit(name, self._label_width - 1), style))
            segments.append(Segment(" ", base))
        # Runs of cells with one style become one segment: fewer objects per line to compose.
        run: list[str] = []
        run_style: Style | None = None

        def put(glyph: str, style: Style) -> None:
            nonlocal run_style
            if style is not run_style and run:
                segments.append(Segment("".join(run), run_style))
                run.clear()
            run_style = style
            run.append(glyph)

        styles: dict[int, Style] = {}

        def combined(style: Style, extra: Style | None) -> Style:
            key = id(style) if extra is None else -id(style)
            found = styles.get(key)
            if found is None:
                found = styles[key] = base + style + extra if extra else base + style
            return found

        pad = self._block - 1 - self._cells_per_node
        for node in chunk:
            mark, mark_style = node_mark(node)
            put(mark, combined(mark_style, None) if mark_style else base)
            down = node.status in (NodeStatus.DOWN, NodeStatus.REFUSED)
            stale = node.status is NodeStatus.STALE
            extra = hi if node.name == self.highlight else None
            values = node.values
            for i in range(self._cells_per_node):
                value = values[i] if i < len(values) else None
                if value is None:
                    glyph, style = ("·" if down else "?"), (_DOWN if down else _NA)
                else:
                    # A stale node keeps its last colours, shaded so it reads as old.
                    glyph, style = ("▒" if stale else "█"), (_DOWN if down else cell_style(value))
                put(glyph, combined(style, extra))
            for _ in range(pad):
                put(" ", base)
        if run:
            segments.append(Segment("".join(run), run_style))
        return Strip(segments).crop_extend(0, width, base)

    def _label_line(self, chunk: list[HeatmapNode], style: Style, hi_style: Style, width: int, base: Style) -> Strip:
        """The names above a line of blocks, each over its own cells (the mark column left blank)."""
        label_width = self._block - 1
        segments = []
        for node in chunk:
            segments.append(Segment(" ", base))
            text = short_label(node.name, label_width, self._suffix)
            segments.append(Segment(text, hi_style if node.name == self.highlight else style))
        return Strip(segments).crop_extend(0, width, base)
