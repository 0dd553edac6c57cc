"""The fleet heatmap: one cell per GPU, grouped by node, drawn with the Line API."""

from __future__ import annotations

from rich.color import Color
from rich.segment import Segment
from rich.style import Style
from textual.events import Click, Resize
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from console.state import HeatmapNode, NodeStatus
from console.widgets.text_table import fit

LABEL_WIDTH = 11
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
LEGEND = "marks: × down  ~ stale  i isolated  ! stack differs  ? N/A"


def cell_style(value: float) -> Style:
    return _STYLES[min(max(int(value * BUCKETS + 0.5), 0), BUCKETS)]


def node_mark(node: HeatmapNode) -> tuple[str, Style | None]:
    """The one-character mark before a node's cells: worst condition wins."""
    if node.status in _MARKS:
        return _MARKS[node.status]
    if node.isolated:
        return _ISOLATED
    if node.mismatch:
        return _MISMATCH
    return (" ", None)


class GpuHeatmap(ScrollView, can_focus=True):
    """Nodes laid out left to right, wrapped into lines; each line starts with its first node's name.

    At 1,250 nodes of 8 GPUs and 120 columns, that is 12 nodes a line and 105
    lines, scrolled; only the lines on screen are drawn.
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

    def set_nodes(self, nodes: list[HeatmapNode], highlight: str | None = None) -> None:
        """Replace the cells (once a tick) and redraw the visible lines."""
        self.nodes = nodes
        self.highlight = highlight
        self._cells_per_node = max((n.gpus for n in nodes), default=8) or 1
        self._layout()
        self.refresh()

    def _layout(self) -> None:
        block = self._cells_per_node + 1
        self._per_line = max((self.size.width - LABEL_WIDTH) // block, 1)
        lines = -(-len(self.nodes) // self._per_line)
        self.virtual_size = Size(self.size.width, lines)

    def on_resize(self, event: Resize) -> None:
        self._layout()

    def node_at(self, x: int, y: int) -> str | None:
        """The node drawn at screen offset (x, y), if any."""
        line = y + int(self.scroll_y)
        col = x - LABEL_WIDTH
        if col < 0:
            return None
        index = line * self._per_line + col // (self._cells_per_node + 1)
        if col // (self._cells_per_node + 1) >= self._per_line or index >= len(self.nodes):
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
        start = line * self._per_line
        chunk = self.nodes[start : start + self._per_line]
        if not chunk:
            return Strip.blank(width, base)
        label_style = base + self.get_component_rich_style("gpu-heatmap--label")
        hi = self.get_component_rich_style("gpu-heatmap--highlight")
        segments = [Segment(fit(chunk[0].name, LABEL_WIDTH - 1) + " ", label_style)]
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
        if run:
            segments.append(Segment("".join(run), run_style))
        return Strip(segments).crop_extend(0, width, base)
