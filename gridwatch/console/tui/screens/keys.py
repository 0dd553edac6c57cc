"""The ``?`` screen: every key of the current view and of the app, and the ``:`` commands."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen, Screen

from gridwatch.console.tui.screens.command_line import COMMANDS
from gridwatch.console.tui.widgets import PlainStatic


def _key_label(key: str) -> str:
    return key.replace("question_mark", "?").replace("colon", ":").replace("slash", "/")


class KeysScreen(ModalScreen[None]):
    """Lists the enabled bindings of the screen underneath: a disabled action is not shown."""

    BINDINGS = [Binding("escape,question_mark,q", "close", "Close")]

    def __init__(self, under: Screen) -> None:
        super().__init__()
        self.under = under
        self.rows: list[tuple[str, str]] = []

    def on_mount(self) -> None:
        self.query_one("#keys-box").border_title = "Keys"

    def compose(self) -> ComposeResult:
        seen: set[str] = set()
        # check_action hides a changing action in read-only mode; hidden keys are not listed.
        for key, active in self.under.active_bindings.items():
            binding = active.binding
            if not active.enabled or not binding.description or key in seen:
                continue
            seen.add(key)
            self.rows.append((_key_label(key), binding.description))
        self.rows.append(("ctrl+p", "command palette"))
        # A command this console does not offer (take over, with no etcd) is not listed either.
        offers = getattr(self.app, "offers", lambda entry: True)
        self.rows.extend((f":{entry.usage}", entry.help) for entry in COMMANDS if offers(entry))
        # The summaries' cadence in force, so an operator knows how fresh the fleet view is.
        fleet: Any = getattr(getattr(self.app, "runtime", None), "fleet", None)
        options = getattr(fleet, "options", None)
        if fleet is not None and options is not None and str(getattr(options, "mode", "")) == "summary":
            from gridwatch.console.runtime.config import cadence_line

            self.rows.append(("cadence", cadence_line(options.summary_every, len(fleet.links))))
        table = Table(expand=True, show_header=False, box=None)
        table.add_column("key", style="bold cyan", width=14)
        table.add_column("does")
        for key, what in self.rows:
            table.add_row(Text(key), Text(what))
        with VerticalScroll(id="keys-box"):
            yield PlainStatic(table)

    def action_close(self) -> None:
        self.dismiss(None)
