"""A table drawn with the Line API: only visible rows are rendered, updates never rebuild a cache."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.events import Click, Resize
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.strip import Strip

from gridwatch.console.tui.widgets.painted import PaintedOnce, Run, Runs, merged
from gridwatch.console.tui.widgets.plain import plain


@dataclass(frozen=True, slots=True)
class Column:
    """A column: ``key`` names it for sorting, ``width`` is in cells.

    ``min_width``: how narrow the table may make it so that the columns it keeps in view fit
    (None: never narrower). ``grow``: it takes the room left once every column fits.
    ``clip="start"`` keeps a clipped value's end (node names differ there).
    """

    key: str
    title: str
    width: int
    align: Literal["left", "right"] = "left"
    min_width: int | None = None
    grow: bool = False
    clip: Literal["end", "start"] = "end"


# A cell is literal text plus an optional style: text is never parsed as markup.
Cell = tuple[str, Style | None]


def fit(text: str, width: int, align: str = "left", clip: str = "end") -> str:
    """Pad or clip ``text`` to exactly ``width`` cells (an ellipsis marks what was cut); controls dropped.

    ``clip="start"`` cuts the beginning and keeps the end.
    """
    text = plain(text)
    length = cell_len(text)
    if length > width:
        if width <= 1:
            return set_cell_size(text, width)
        if clip == "start":
            tail = text[-(width - 1):]
            while cell_len(tail) > width - 1:  # wide characters: drop from the front until it fits
                tail = tail[1:]
            return "…" + " " * (width - 1 - cell_len(tail)) + tail
        return set_cell_size(text, width - 1) + "…"
    pad = " " * (width - length)
    return pad + text if align == "right" else text + pad


def column_widths(columns: Sequence[Column], width: int, keep: int) -> list[int]:
    """Each column's width in a table ``width`` cells wide (a space after each column).

    When everything fits, the first growing column takes the rest. When the first ``keep``
    columns do not fit, they are narrowed towards their ``min_width``: first the others from the
    right (their width is for the worst case), then the growing one (it has the text to spare).
    """
    widths = [c.width for c in columns]
    total = sum(w + 1 for w in widths)
    if total <= width:
        grow = next((i for i, c in enumerate(columns) if c.grow), None)
        if grow is not None:
            widths[grow] += width - total
        return widths
    kept = list(range(min(keep, len(columns))))
    over = sum(widths[i] + 1 for i in kept) - width
    order = [i for i in reversed(kept) if not columns[i].grow] + [i for i in reversed(kept) if columns[i].grow]
    for i in order:
        if over <= 0:
            break
        least = columns[i].min_width
        if least is not None and widths[i] > least:
            cut = min(widths[i] - least, over)
            widths[i] -= cut
            over -= cut
    return widths


class TextTable(PaintedOnce, can_focus=True):
    """Rows of plain-text cells with a cursor; posts :class:`Selected` on enter.

    A DataTable invalidates its whole render cache on every ``update_cell``
    (about 80 ms at 10,000 rows); this table holds its rows as a list and draws
    only the rows on screen, so replacing all rows once a tick is cheap.
    """

    COMPONENT_CLASSES = {"text-table--header", "text-table--cursor", "text-table--sorted"}
    # The cursor row's text takes the colour that reads best on the cursor (black on the accent's
    # orange, about 10:1), over the cells' own colours: a selected row must stay readable.
    DEFAULT_CSS = """
    TextTable { height: 1fr; }
    TextTable > .text-table--header { text-style: bold; background: $panel; }
    TextTable > .text-table--cursor { background: $accent 40%; color: auto 100%; }
    TextTable:focus > .text-table--cursor { background: $accent; color: auto 100%; }
    TextTable > .text-table--sorted { text-style: bold underline; background: $panel; }
    """
    BINDINGS = [
        Binding("up,k", "cursor(-1)", "Up", show=False),
        Binding("down,j", "cursor(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home,g", "jump(0)", "First", show=False),
        Binding("end,G", "jump(-1)", "Last", show=False),
        Binding("enter", "select", "Open", show=False),
        # A table wider than the screen scrolls a column at a time, not a cell: 40 presses would reach the end.
        Binding("left", "column(-1)", "Scroll Left", show=False),
        Binding("right", "column(1)", "Scroll Right", show=False),
    ]

    cursor: reactive[int] = reactive(0, always_update=True, repaint=False)

    class _RowMessage(Message):
        """Something happened to the row with ``key``."""

        def __init__(self, table: TextTable, key: str) -> None:
            super().__init__()
            self.table = table
            self.key = key

        @property
        def control(self) -> TextTable:
            return self.table

    class Selected(_RowMessage):
        """Enter was pressed on a row."""

    class Highlighted(_RowMessage):
        """The cursor moved to another row."""

    def __init__(self, columns: list[Column], *, keep: int | None = None, name: str | None = None,
                 id: str | None = None, classes: str | None = None) -> None:
        """``keep``: how many leading columns are narrowed (to their ``min_width``) to stay in view; all by default."""
        super().__init__(name=name, id=id, classes=classes)
        self.columns = columns
        self.keep = len(columns) if keep is None else keep
        self._widths: tuple[int, list[int]] | None = None  # (table width, column widths) as last laid out
        self._paint_view: tuple[list[int], int] | None = None  # (widths, scroll) during one paint
        self._limits: dict[str, int] = {}  # column key -> the widest value it holds, where a view said so
        self.rows: Sequence[Any] = []
        self.keys: list[str] = []
        self._format: Callable[[Any], list[Cell]] | None = None
        self._formatted: dict[int, list[Cell]] = {}
        self.sort_key: str | None = None
        self.sort_reverse = False

    # ----------------------------------------------------------------- data

    def set_rows(self, rows: Sequence[Any], keys: list[str], formatter: Callable[[Any], list[Cell]] | None = None) -> None:
        """Replace every row; the cursor stays on the same key when that row is still there.

        With ``formatter``, rows are any objects and only the rows drawn are
        formatted into cells: at 1,250 rows and 60 on screen, 95 % are never formatted.
        """
        current = self.cursor_key
        self.rows = rows
        self.keys = keys
        self._format = formatter
        self._formatted = {}
        self.virtual_size = Size(sum(w + 1 for w in self.widths), len(rows) + 1)
        if current is not None and 0 <= self.cursor < len(keys) and keys[self.cursor] == current:
            pass  # still in its place: no search through 12,500 keys on every tick
        elif current is not None and current in keys:
            self.set_reactive(TextTable.cursor, keys.index(current))
        else:
            self.set_reactive(TextTable.cursor, min(self.cursor, max(len(rows) - 1, 0)))
        self.refresh_changed()  # once a tick: only the lines whose text changed are painted again

    def set_columns(self, columns: list[Column], keep: int | None = None) -> None:
        """Lay the table out with other columns (a view that fits its columns to its width); rows must match them."""
        self.columns = columns
        self.keep = len(columns) if keep is None else keep
        self._widths = None
        self._formatted = {}
        self.virtual_size = Size(sum(w + 1 for w in self.widths), len(self.rows) + 1)
        self.refresh()

    def limit_width(self, key: str, cells: int) -> None:
        """Make column ``key`` no wider than ``cells`` (its widest value), yet as wide as its title and sort arrow."""
        col = next(c for c in self.columns if c.key == key)
        cells = min(max(cells, cell_len(col.title) + 2), col.width)
        if self._limits.get(key) != cells:
            self._limits[key] = cells
            self._widths = None
            self.refresh()

    @property
    def widths(self) -> list[int]:
        """The columns' widths at the table's present width (laid out again when that changes)."""
        width = self.scrollable_content_region.width
        if self._widths is None or self._widths[0] != width:
            columns = [replace(c, width=self._limits[c.key]) if c.key in self._limits else c for c in self.columns]
            self._widths = (width, column_widths(columns, width, self.keep))
        return self._widths[1]

    def on_resize(self, event: Resize) -> None:
        self.virtual_size = Size(sum(w + 1 for w in self.widths), len(self.rows) + 1)

    def cells(self, index: int) -> list[Cell]:
        """Row ``index`` as the cells it is drawn with."""
        if self._format is None:
            return self.rows[index]
        cells = self._formatted.get(index)
        if cells is None:
            cells = self._formatted[index] = self._format(self.rows[index])
        return cells

    def row_cells(self) -> list[list[Cell]]:
        """Every row's cells (formats them all: for tests and exports, not for drawing)."""
        return [self.cells(i) for i in range(len(self.rows))]

    @property
    def cursor_key(self) -> str | None:
        if 0 <= self.cursor < len(self.keys):
            return self.keys[self.cursor]
        return None

    def move_to(self, key: str) -> bool:
        """Put the cursor on ``key``; False when no row has it."""
        if key not in self.keys:
            return False
        self.cursor = self.keys.index(key)
        return True

    # -------------------------------------------------------------- actions

    def watch_cursor(self, old: int, new: int) -> None:
        clamped = min(max(new, 0), max(len(self.rows) - 1, 0))
        if clamped != new:
            self.set_reactive(TextTable.cursor, clamped)
        self._scroll_to_cursor()
        self.refresh()
        key = self.cursor_key
        if key is not None and old != clamped:
            self.post_message(self.Highlighted(self, key))

    def _scroll_to_cursor(self) -> None:
        visible = max(self.size.height - 1, 1)
        top = int(self.scroll_y)
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False, immediate=True)
        elif self.cursor >= top + visible:
            self.scroll_to(y=self.cursor - visible + 1, animate=False, immediate=True)

    def action_cursor(self, delta: int) -> None:
        self.cursor = self.cursor + delta

    def action_page(self, direction: int) -> None:
        self.cursor = self.cursor + direction * max(self.size.height - 2, 1)

    def action_jump(self, where: int) -> None:
        self.cursor = 0 if where == 0 else len(self.rows) - 1

    def action_column(self, direction: int) -> None:
        """Scroll sideways so that the next (or previous) column starts at the left edge."""
        starts, x = [], 0
        for width in self.widths:
            starts.append(x)
            x += width + 1
        now = round(self.scroll_x)
        if direction > 0:
            target = next((s for s in starts if s > now), now)
            target = min(target, round(self.max_scroll_x))
        else:
            target = max((s for s in starts if s < now), default=0)
        self.scroll_to(x=target, animate=False, immediate=True)

    def action_select(self) -> None:
        key = self.cursor_key
        if key is not None:
            self.post_message(self.Selected(self, key))

    def on_click(self, event: Click) -> None:
        row = event.y - 1 + int(self.scroll_y)
        if event.y >= 1 and 0 <= row < len(self.rows):
            self.cursor = row
            if event.chain >= 2:
                self.action_select()

    # ------------------------------------------------------------ rendering

    def _header(self) -> Runs:
        header = self.get_component_rich_style("text-table--header")
        sorted_style = self.get_component_rich_style("text-table--sorted")
        runs: list[Run] = []
        for col, width in zip(self.columns, self.widths):
            if col.key == self.sort_key and width > 2:
                # The arrow stays whole; a title too long for it is clipped before it.
                arrow = " ▼" if self.sort_reverse else " ▲"
                title = col.title if cell_len(col.title) + 2 <= width else fit(col.title, width - 2)
                runs.append((fit(title + arrow, width, col.align), sorted_style))
            else:
                runs.append((fit(col.title, width, col.align), header))
            runs.append((" ", header))
        return tuple(runs)

    @contextmanager
    def _styled(self) -> Iterator[None]:
        # The columns' widths and the scroll read once a paint too (each walks Textual's regions).
        self._paint_view = (self.widths, self.scroll_offset.y)
        try:
            with super()._styled():
                yield
        finally:
            self._paint_view = None

    def line_runs(self, y: int) -> Runs:
        base = self.paint_style
        if y == 0:
            return self._header()
        widths, top = self._paint_view or (self.widths, self.scroll_offset.y)
        index = y - 1 + top
        if index >= len(self.rows):
            return ((" " * self.size.width, base),)
        row_style = self.get_component_rich_style("text-table--cursor") if index == self.cursor else None
        space = base + row_style if row_style else base
        runs: list[Run] = []
        for col, cells, (text, style) in zip(self.columns, widths, self.cells(index)):
            cell_style = base + style if style else base
            if row_style is not None:
                cell_style = cell_style + row_style
            runs.append((fit(text, cells, col.align, col.clip), cell_style))
            runs.append((" ", space))
        return merged(runs)

    def strip_of(self, runs: Runs, y: int) -> Strip:
        scroll_x = self.scroll_offset.x
        return Strip([Segment(text, style) for text, style in runs]).crop_extend(scroll_x, scroll_x + self.size.width,
                                                                                 self.paint_style)
