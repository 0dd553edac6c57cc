"""A scroll view drawn line by line that repaints only the lines on screen whose content changed.

The fleet view is redrawn once a second whatever changed. Textual repaints a widget whole on
``refresh()``: every visible line is made again and composed (about 15 ms for a 200x60 screen,
most of a console's CPU at a thousand nodes). Here a widget says what each line holds as styled
runs of text; a tick compares them with what was drawn there and marks only the lines that
differ, so an unchanged line costs a comparison and Textual keeps its composed copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Region
from textual.scroll_view import ScrollView
from textual.strip import Strip

# What a line holds: its text in runs of one style each, left to right.
Run = tuple[str, Style]
Runs = tuple[Run, ...]


class PaintedOnce(ScrollView):
    """A scroll view whose lines read the widget's style once a paint, not once a line (it walks the ancestors).

    A subclass says what a line holds (:meth:`line_runs`) and may draw it its own way
    (:meth:`strip_of`); :meth:`refresh_changed` repaints only what differs from the screen.
    """

    _paint_style: Style | None = None  # rich_style during one paint

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        # Visible line -> the runs drawn there, for the view (scroll, size) they were drawn in.
        self._drawn: dict[int, Runs] = {}
        self._drawn_in: tuple | None = None
        # The runs a tick found changed, made once for the paint that follows (same view, and no other repaint
        # asked for since: a cursor or a highlight moved after the tick reads every line afresh).
        self._fresh: dict[int, Runs] = {}
        self._fresh_in: tuple | None = None
        self._marking = False  # refresh_changed's own call to refresh
        super().__init__(name=name, id=id, classes=classes)

    def refresh(self, *regions: Region, **kwargs: Any) -> Any:
        if not self._marking:
            self._fresh.clear()  # what changed since the tick (a cursor moved) is not in the runs it kept
        return super().refresh(*regions, **kwargs)

    @contextmanager
    def _styled(self) -> Iterator[None]:
        """The widget's style read once for every line made inside (it walks the ancestors)."""
        self._paint_style = self.rich_style
        try:
            yield
        finally:
            self._paint_style = None

    def render_lines(self, crop: Region) -> list[Strip]:
        # Where lines are placed, read once a paint: another place draws every line afresh.
        view = self._view()
        if view != self._drawn_in:
            self._drawn.clear()
            self._drawn_in = view
        if view != self._fresh_in:
            self._fresh.clear()
        with self._styled():
            return super().render_lines(crop)

    @property
    def paint_style(self) -> Style:
        return self._paint_style if self._paint_style is not None else self.rich_style

    def line_runs(self, y: int) -> Runs:
        """What visible line ``y`` holds; a blank line by default."""
        return ((" " * self.size.width, self.paint_style),)

    def strip_of(self, runs: Runs, y: int) -> Strip:
        """The line drawn from its runs, as wide as the widget."""
        base = self.paint_style
        return Strip([Segment(text, style) for text, style in runs]).crop_extend(0, self.size.width, base)

    def _view(self) -> tuple:
        # What places lines on screen: a change of any of it is a whole repaint (Textual makes one anyway).
        return (self.scroll_offset, self.size, self.virtual_size)

    def render_line(self, y: int) -> Strip:
        runs = self._fresh.pop(y, None)
        if runs is None:
            runs = self.line_runs(y)
        self._drawn[y] = runs
        return self.strip_of(runs, y)

    def refresh_changed(self) -> None:
        """Repaint the visible lines whose runs differ from what is on screen; all of them in a new view."""
        view = self._view()
        if view != self._drawn_in or not self._drawn:
            self._fresh.clear()
            self.refresh()
            return
        drawn = self._drawn
        fresh: dict[int, Runs] = {}
        with self._styled():
            for y in range(self.size.height):
                runs = self.line_runs(y)
                if runs != drawn.get(y):
                    fresh[y] = runs
        self._fresh, self._fresh_in = fresh, view
        if fresh:
            self._marking = True
            try:
                self.refresh(*_line_regions(sorted(fresh), self.size.width))
            finally:
                self._marking = False


def merged(runs: Iterable[Run]) -> Runs:
    """Runs side by side in the same style (the same object) as one: fewer segments for every strip made of the
    line (a table row of 14 cells and their gaps is 28 runs, most of them in the widget's own style)."""
    out: list[Run] = []
    texts: list[str] = []
    current: Style | None = None
    for text, style in runs:
        if style is not current:
            if texts:
                out.append(("".join(texts), current))  # type: ignore[arg-type]  # set with texts
            texts = []
            current = style
        texts.append(text)
    if texts:
        out.append(("".join(texts), current))  # type: ignore[arg-type]
    return tuple(out)


def _line_regions(lines: list[int], width: int) -> list[Region]:
    """Runs of consecutive lines as one region each (fewer regions for the compositor to cut)."""
    regions: list[Region] = []
    start = prev = lines[0]
    for y in lines[1:]:
        if y != prev + 1:
            regions.append(Region(0, start, width, prev - start + 1))
            start = y
        prev = y
    regions.append(Region(0, start, width, prev - start + 1))
    return regions
