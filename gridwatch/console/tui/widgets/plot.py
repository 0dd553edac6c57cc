"""A line plot in braille dots (2x4 per cell), for the loss curve."""

from __future__ import annotations

import math

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

AXIS_WIDTH = 9
_DOTS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))  # [row][col] bits of U+2800


def braille_rows(points: list[tuple[float, float]], width: int, height: int) -> tuple[list[str], float, float]:
    """Rasterise (x, y) points into ``height`` strings of ``width`` braille cells; returns rows, y min, y max."""
    finite = [(x, y) for x, y in points if math.isfinite(y)]
    if width <= 0 or height <= 0 or not finite:
        return [" " * max(width, 0)] * max(height, 0), 0.0, 0.0
    xs = [p[0] for p in finite]
    ys = [p[1] for p in finite]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    dots_w, dots_h = width * 2, height * 4
    grid = [[0] * width for _ in range(height)]
    prev: tuple[int, int] | None = None
    for x, y in finite:
        px = 0 if x1 == x0 else int((x - x0) / (x1 - x0) * (dots_w - 1))
        py = dots_h // 2 if y1 == y0 else int((y1 - y) / (y1 - y0) * (dots_h - 1))
        # Draw the segment from the previous point, so a steep drop reads as a line, not dust.
        ax, ay = prev if prev is not None else (px, py)
        steps = max(abs(px - ax), abs(py - ay), 1)
        for k in range(steps + 1):
            dx = ax + (px - ax) * k // steps
            dy = ay + (py - ay) * k // steps
            grid[dy // 4][dx // 2] |= _DOTS[dy % 4][dx % 2]
        prev = (px, py)
    rows = ["".join(chr(0x2800 + bits) if bits else " " for bits in row) for row in grid]
    return rows, y0, y1


def axis_label(value: float) -> str:
    return f"{value:>{AXIS_WIDTH - 2}.4g} ┤"


class BraillePlot(Widget):
    """Plots (x, y) points; the newest data replaces the old with :meth:`set_points`."""

    DEFAULT_CSS = """
    BraillePlot { height: 1fr; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.points: list[tuple[float, float]] = []
        self._rows: list[str] = []
        self._y: tuple[float, float] = (0.0, 0.0)
        self._shape: tuple[int, int] = (0, 0)

    def set_points(self, points: list[tuple[float, float]]) -> None:
        self.points = points
        self._shape = (0, 0)
        self.refresh()

    def _raster(self) -> None:
        shape = (max(self.size.width - AXIS_WIDTH, 0), self.size.height)
        if shape != self._shape:
            rows, lo, hi = braille_rows(self.points, *shape)
            self._rows, self._y, self._shape = rows, (lo, hi), shape

    def render_line(self, y: int) -> Strip:
        self._raster()
        base = self.rich_style
        width = self.size.width
        if not self.points or y >= len(self._rows):
            return Strip.blank(width, base)
        lo, hi = self._y
        if y == 0:
            label = axis_label(hi)
        elif y == len(self._rows) - 1:
            label = axis_label(lo)
        else:
            label = " " * (AXIS_WIDTH - 1) + "│"
        line = Style(color="cyan")
        return Strip([Segment(label, base), Segment(self._rows[y], base + line)]).crop_extend(0, width, base)
