"""The ``?`` screen: every key of the current view and of the app, and the ``:`` commands."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.keys import format_key
from textual.screen import ModalScreen, Screen

from gridwatch.console.tui.screens.command_line import COMMANDS
from gridwatch.console.tui.widgets import PlainStatic

# Keys as their keycaps read; a printable key is its character (format_key: "slash" -> "/").
_KEY_NAMES = {"escape": "Esc", "enter": "Enter", "tab": "Tab", "space": "Space", "backspace": "Backspace",
              "delete": "Del", "insert": "Ins", "pageup": "PgUp", "pagedown": "PgDn", "home": "Home", "end": "End",
              "up": "Up", "down": "Down", "left": "Left", "right": "Right"}


def key_name(key: str) -> str:
    """A binding's key by the name on the keyboard: ``Enter``, ``Esc``, ``PgUp``, ``/``, ``?``, ``Ctrl+S``, ``q``."""
    *modifiers, last = key.split("+") if key != "plus" else ["plus"]
    name = _KEY_NAMES.get(last)
    if name is None:
        shown = format_key(last)
        if len(shown) == 1:
            name = shown.upper() if modifiers else shown  # Ctrl+S as written on the key; q and L as typed
        else:
            name = last.replace("_", " ").capitalize()
    return "+".join([m.capitalize() for m in modifiers] + [name])


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
        # check_action hides a changing action in read-only mode; hidden keys are not listed.
        # Keys bound to one action (up and k) share a row: "Up, k".
        actions: dict[tuple[str, str], list[str]] = {}
        for key, active in self.under.active_bindings.items():
            binding = active.binding
            if not active.enabled or not binding.description:
                continue
            names = actions.setdefault((binding.action, binding.description), [])
            if key_name(key) not in names:
                names.append(key_name(key))
        for (action, description), names in actions.items():
            self.rows.append((", ".join(names), "command palette" if action == "command_palette" else description))
        if not any(action == "command_palette" for action, _ in actions):
            self.rows.append(("Ctrl+P", "command palette"))
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
