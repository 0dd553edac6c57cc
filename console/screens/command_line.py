"""The k9s-style ``:`` command line: ``:nodes``, ``:logs``, ``:incidents``, ``:training``, ``:node NAME``, ``:preflight``."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Input

COMMANDS: dict[str, str] = {
    "nodes": "the fleet: heatmap and node table",
    "node NAME": "one node: GPUs, host, events, live log",
    "logs": "events and log lines across nodes; search the agents",
    "incidents": "open and recent incidents, acknowledge, silence, act",
    "training": "the training run: loss, step time per rank, checkpoints",
    "preflight [SPEC]": "check the connected nodes (or SPEC) now; results in the node view",
    "quit": "leave the console",
}


class CommandLine(ModalScreen[str | None]):
    """A one-line prompt at the bottom; dismisses with the command typed, or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def compose(self) -> ComposeResult:
        yield Input(placeholder="nodes | node NAME | logs | incidents | training | preflight [SPEC] | quit", id="command-input")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip().lstrip(":"))

    def action_cancel(self) -> None:
        self.dismiss(None)
