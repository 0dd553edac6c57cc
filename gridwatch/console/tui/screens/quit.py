"""The question ``q`` asks in the demo before quitting takes its cluster down: q again or y quits, any other key stays."""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen

from gridwatch.console.tui.widgets import PlainStatic

# The keys that confirm; every other key (Esc, Enter, n, :) cancels.
QUIT_KEYS = frozenset({"q", "y"})


class QuitScreen(ModalScreen[bool]):
    """Dismisses with True for q or y, False for any other key or a click."""

    def compose(self) -> ComposeResult:
        what = Text.assemble(("Quit the demo?", "bold"), "\n\nIts agents and its trainer stop and the cluster it "
                             "made is removed.\n\n", ("q", "bold"), " or ", ("y", "bold"), " quits, any other key stays.")
        with Vertical(id="quit-box"):
            yield PlainStatic(what, id="quit-what")

    def on_key(self, event: events.Key) -> None:
        event.stop()
        event.prevent_default()
        self.dismiss(event.key in QUIT_KEYS)

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.dismiss(False)
