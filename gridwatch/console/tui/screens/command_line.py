"""The k9s-style ``:`` command line, and the one table of its commands that the app, ``?`` and ctrl+p read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Input


class Verb(StrEnum):
    """What a ``:`` command does; the app dispatches on this, never on the words typed."""

    NODES = "nodes"
    NODE = "node"
    LOGS = "logs"
    INCIDENTS = "incidents"
    TRAINING = "training"
    JOBS = "jobs"
    PREFLIGHT = "preflight"
    TAKEOVER = "takeover"
    QUIT = "quit"


class Arg(StrEnum):
    """Whether a command takes the rest of the line."""

    NONE = "none"
    OPTIONAL = "optional"
    REQUIRED = "required"


@dataclass(frozen=True, slots=True)
class Command:
    """One ``:`` command: its words (the first is the one shown), its argument, what it does."""

    verb: Verb
    words: tuple[str, ...]
    help: str
    arg: Arg = Arg.NONE
    arg_name: str = ""
    palette: str = ""  # its title in the command palette (ctrl+p); empty: not offered there

    @property
    def usage(self) -> str:
        """``node NAME``, ``preflight [SPEC]``: how ``?`` and the prompt show it."""
        if self.arg is Arg.REQUIRED:
            return f"{self.words[0]} {self.arg_name}"
        if self.arg is Arg.OPTIONAL:
            return f"{self.words[0]} [{self.arg_name}]"
        return self.words[0]


# In the order ``?`` lists them. Words may be shared: ``:node NAME`` opens a node, a bare
# ``:node`` is the fleet.
COMMANDS: tuple[Command, ...] = (
    Command(Verb.NODES, ("nodes", "node", "fleet", "no"), "the fleet: heatmap and node table", palette="Nodes"),
    Command(Verb.NODE, ("node", "no"), "one node: GPUs, host, events, live log", Arg.REQUIRED, "NAME"),
    Command(Verb.LOGS, ("logs", "log", "lo"), "events and log lines across nodes; search the agents", palette="Logs"),
    Command(Verb.INCIDENTS, ("incidents", "incident", "inc", "in"),
            "open and recent incidents, acknowledge, silence, act", palette="Incidents"),
    Command(Verb.TRAINING, ("training", "train", "tr"), "the training run: loss, step time per rank, checkpoints",
            palette="Training"),
    Command(Verb.JOBS, ("jobs", "job", "squeue"), "the scheduler's jobs (Slurm, Kubernetes) and the nodes they run on",
            palette="Jobs"),
    Command(Verb.PREFLIGHT, ("preflight", "pre-flight", "pf"),
            "check the connected nodes (or SPEC) now; results in the node view", Arg.OPTIONAL, "SPEC",
            palette="Pre-flight"),
    # Listed only by a console whose cluster shares the acting through etcd (GridwatchApp.offers).
    Command(Verb.TAKEOVER, ("takeover", "take-over"),
            "take the acting over from the console that leads (asks for a reason; audited)", palette="Take over"),
    Command(Verb.QUIT, ("quit", "q", "exit"), "leave the console"),
)


def parse_command(text: str) -> tuple[Command, str] | None:
    """The command typed (``:`` already stripped) and its argument, or None when no command has that word."""
    word, _, rest = text.strip().lstrip(":").partition(" ")
    word, rest = word.lower(), rest.strip()
    named = [c for c in COMMANDS if word in c.words and not (c.arg is Arg.REQUIRED and not rest)]
    if rest:
        # A shared word with an argument means the command that takes one (``:node NAME``).
        named.sort(key=lambda c: c.arg is Arg.NONE)
    return (named[0], rest) if named else None


def usage_line(offers: Callable[[Command], bool] | None = None) -> str:
    """Every command's usage on one line, for the prompt and for an unknown command; ``offers`` says which are listed."""
    return " | ".join(c.usage for c in COMMANDS if offers is None or offers(c))


class CommandLine(ModalScreen[str | None]):
    """A one-line prompt at the bottom; dismisses with the command typed, or None.

    Keys can arrive between ``:`` and this screen's mount (a paste, ``tmux
    send-keys``, a fast typist); the app holds them until :attr:`taking_keys`
    and then hands them to the field in order (see ``GridwatchApp.on_event``).
    """

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    class Ready(Message):
        """The field has focus: keys held since ``:`` can go to it now."""

    def __init__(self) -> None:
        super().__init__()
        self.taking_keys = False
        self.closing = False

    def compose(self) -> ComposeResult:
        yield Input(placeholder=usage_line(getattr(self.app, "offers", None)), id="command-input")

    def on_mount(self) -> None:
        # Focus at once, not through focus() (which waits behind keys already queued): every key
        # the app handles from here on goes straight to the field.
        self.set_focus(self.query_one(Input))
        self.taking_keys = True
        self.post_message(self.Ready())

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.closing = True
        self.dismiss(event.value.strip().lstrip(":"))

    def action_cancel(self) -> None:
        self.closing = True
        self.dismiss(None)
