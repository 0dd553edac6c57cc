"""The frame every console view shares: a title line, the view, the status bar and the key footer."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from rich.text import Text
from textual.app import ComposeResult
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Static

from gridwatch.console.tui.widgets import PlainStatic, StatusBar

if TYPE_CHECKING:
    from gridwatch.console.fleet.state import StateStore
    from gridwatch.console.runtime.core import ConsoleRuntime
    from gridwatch.console.tui.app import GridwatchApp


class ViewScreen(Screen[None]):
    """A view the app refreshes once a tick via :meth:`refresh_view`; never per frame."""

    VIEW_NAME = "view"
    # Redrawn at the summaries' cadence on a large fleet (GridwatchApp.redraw_every), news at once; a view of one
    # node (its whole samples every tick, its live log) says False and is redrawn every tick.
    AT_CADENCE = True
    # Actions that change something: hidden (and refused) in read-only mode.
    CHANGING_ACTIONS: frozenset[str] = frozenset()

    @property
    def gw(self) -> GridwatchApp:
        return cast("GridwatchApp", self.app)

    @property
    def runtime(self) -> ConsoleRuntime:
        return self.gw.runtime

    @property
    def store(self) -> StateStore:
        return self.gw.runtime.store

    def compose(self) -> ComposeResult:
        yield PlainStatic(id="view-title", classes="view-title")
        yield from self.compose_view()
        yield StatusBar(id="status-bar")
        yield Footer()

    def compose_view(self) -> ComposeResult:
        yield from ()

    _ready = False

    class Ready(Message):
        """The view has drawn itself and focused its widget: keys typed while it was coming can go to it now."""

    def on_mount(self) -> None:
        # Widgets nested in containers mount after the screen does: draw once they are all there.
        self.call_after_refresh(self._first_draw)

    def _first_draw(self) -> None:
        self._ready = True
        self.prepare()
        self.tick()
        self.post_message(self.Ready())

    @property
    def ready(self) -> bool:
        """True once the view has drawn itself from the store."""
        return self._ready

    def prepare(self) -> None:
        """Subclasses focus a widget or subscribe here, once their widgets exist."""

    def on_screen_resume(self) -> None:
        self.tick()

    def set_title(self, *parts: str | tuple[str, str]) -> None:
        """Set the title line from plain strings and (text, style) pairs: node text is never markup."""
        self.query_one("#view-title", Static).update(Text.assemble(*parts), layout=False)

    def tick(self) -> None:
        """Redraw from the store: the view, then the status bar."""
        if not self._ready or not self.is_attached:
            return  # pushed but not composed yet (its on_mount draws it), or being taken down
        try:
            self.refresh_view()
            incidents = self.gw.open_incident_count()
            alert: str = self.runtime.alert or getattr(self.runtime, "relay_alert", "") or ""
            role, role_style = "", ""
            election = self.runtime.election
            if election is not None:
                # Where this console stands among several: leader, observer and who leads, or why no one acts.
                standing = election.standing
                role = standing.line
                role_style = "bold green" if election.leading else "cyan" if standing.leader else "bold yellow"
                if alert and alert in role:
                    alert = ""  # the role says it already
            self.query_one(StatusBar).show(
                self.store.summary(), self.runtime.read_only, incidents, self.gw.note, alert, role, role_style
            )
        except NoMatches:
            # The timer can fire while the screen's widgets are being removed (a view popped,
            # the app closing): there is nothing left to draw, and that is no error.
            return

    def refresh_view(self) -> None:
        """Subclasses redraw their widgets from the store here."""

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in self.CHANGING_ACTIONS and self.runtime.read_only:
            return False
        return True
