"""The confirmation dialog every changing action goes through: what will happen, and why."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from gridwatch.console.tui.widgets import PlainStatic, plain_text
from gridwatch.playbooks.durations import parse_duration


@dataclass(slots=True)
class Confirmed:
    """What the operator confirmed: the reason, and a duration when one was asked for."""

    reason: str
    seconds: float | None = None


class ConfirmScreen(ModalScreen[Confirmed | None]):
    """Asks before anything changes; dismisses with :class:`Confirmed`, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, what: Text, *, ask_duration: str | None = None) -> None:
        super().__init__()
        self.title_text = title
        self.what = what
        self.ask_duration = ask_duration

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box"):
            yield Label(plain_text(Text(self.title_text, style="bold")), id="confirm-title")
            yield PlainStatic(self.what, id="confirm-what")
            if self.ask_duration is not None:
                yield Input(value=self.ask_duration, placeholder="for how long: 500ms, 30m, 2h", id="confirm-duration")
            yield Input(placeholder="reason (goes to the audit log)", id="confirm-reason")
            yield PlainStatic(id="confirm-error")
            with Horizontal(id="confirm-buttons"):
                yield Button("Confirm", variant="error", id="confirm-yes")
                yield Button("Cancel", id="confirm-no")

    def on_mount(self) -> None:
        self.query_one("#confirm-reason", Input).focus()

    def _finish(self) -> None:
        seconds = None
        if self.ask_duration is not None:
            # The one duration grammar, as in playbooks: 500ms, 90, 60s, 5m, 1h, 2d.
            try:
                seconds = parse_duration(self.query_one("#confirm-duration", Input).value)
                if seconds <= 0:
                    raise ValueError("it must last longer than 0")
            except ValueError as exc:
                self.query_one("#confirm-error", Static).update(Text(f"bad duration: {exc}", style="red"))
                return
        self.dismiss(Confirmed(self.query_one("#confirm-reason", Input).value.strip(), seconds))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._finish()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "confirm-yes":
            self._finish()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)
