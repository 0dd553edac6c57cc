"""The Textual app of ``gridwatch console``: views over the state store, redrawn on a timer."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from loguru import logger
from rich.text import Text
from textual import events
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Input

from gridwatch.console.runtime.core import ConsoleRuntime
from gridwatch.console.runtime.leader import take_over
from gridwatch.console.tui.screens import (
    CommandLine,
    FleetScreen,
    IncidentsScreen,
    JobsScreen,
    KeysScreen,
    LogsScreen,
    NodeScreen,
    QuitScreen,
    TrainingScreen,
    ViewScreen,
)
from gridwatch.console.tui.screens.command_line import COMMANDS, Command, Verb, parse_command, usage_line
from gridwatch.console.tui.screens.confirm import Confirmed, ConfirmScreen
from gridwatch.sshlink.hostlist import HostlistError, expand
from gridwatch.wire.protocol import AgentAction

VIEWS: dict[str, type[ViewScreen]] = {
    Verb.LOGS: LogsScreen,
    Verb.INCIDENTS: IncidentsScreen,
    Verb.TRAINING: TrainingScreen,
    Verb.JOBS: JobsScreen,
}
# Keys that end the command line: what follows them in a burst belongs to the view beneath.
_LINE_ENDING_KEYS = frozenset({"enter", "escape"})
# Held keys are looked at again this often, should nothing else hand them on (a safety net).
_HOLD_RECHECK_S = 1.0
# A view of the whole fleet is redrawn at least this often, however slow its summaries: as often as they come
# up to auto's slowest cadence (5 s from 1,250 nodes). A redraw between two summaries of a node shows none of its
# news, and at 1,000 nodes a redraw and its paint cost the console about as much as all of its summaries do
# (BENCHMARKS.md, issue 25's eighth round). What is news rather than a reading (an event, a link going stale or
# down, an incident) is drawn at the next tick whatever this says; the ages in the SEEN column move in steps of
# the cadence. A whole number of the 1 s ticks it is redrawn on.
REDRAW_AT_LEAST_S = 5.0


class GridwatchApp(App[None]):
    """Bindings and navigation; every view reads the store on one 1 Hz tick, never per frame."""

    CSS_PATH = "app.tcss"
    TITLE = "gridwatch"
    BINDINGS = [
        Binding("question_mark", "keys", "Keys"),
        Binding("colon", "command_line", "Command"),
        # Offered only to an observer of a cluster whose consoles share the acting (etcd).
        Binding("L", "take_over", "Take over"),
        Binding("escape", "back", "Back"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, runtime: ConsoleRuntime, *, tick_seconds: float = 1.0, start_runtime: bool = True,
                 demo: bool = False) -> None:
        """``demo``: the runtime watches the demo's own cluster, which quitting takes down: ``q`` asks first."""
        super().__init__()
        self.runtime = runtime
        self.tick_seconds = tick_seconds
        self.start_runtime = start_runtime
        self.demo = demo
        self.note = ""  # the outcome of the last operator action, shown in the status bar
        self.preflight_running = False
        self._held: list[events.Key | events.Paste] = []  # typed before the screen on top could take them
        self._line_ending = False  # Enter or Escape went to a line whose command has not run yet
        self._stuck_timer: Timer | None = None
        self._hold_timer: Timer | None = None  # looks at held keys again should nothing else hand them on
        self._role_shown: tuple[str, bool] | None = None  # this console's standing among several, as last drawn
        self.monotonic: Callable[[], float] = time.monotonic  # the redraws' clock (a test's own)
        self._drawn_at = float("-inf")  # monotonic time of the view's last redraw on the tick
        self._news_drawn = -1  # the store's news counter at that redraw

    def get_default_screen(self) -> Screen:
        return FleetScreen()

    def on_mount(self) -> None:
        self.set_interval(self.tick_seconds, self.tick)
        if self.start_runtime:
            self.run_worker(self.runtime.start(), name="fleet", exit_on_error=False)

    async def on_unmount(self) -> None:
        if self.start_runtime:
            await self.runtime.stop()

    def tick(self) -> None:
        """Run the engine's clock rules (unless the runtime runs them itself), then redraw the topmost view."""
        if not self.runtime.ticking:
            self.runtime.tick_engine()
        election = self.runtime.election
        role = (election.standing.line, election.leading) if election is not None else None
        if role != self._role_shown:
            self._role_shown = role
            self._news_drawn = -1  # the status line says this console's standing: drawn at once
            self.refresh_bindings()  # the take-over key is offered to an observer only
        view = next((s for s in reversed(self.screen_stack) if isinstance(s, ViewScreen)), None)
        if view is None:
            return
        now = self.monotonic()
        news = self.runtime.store.news
        if view.AT_CADENCE and news == self._news_drawn:
            every = self.redraw_every()
            if every > self.tick_seconds and now - self._drawn_at < every - 0.05:
                return  # a tick between two redraws of a fleet whose summaries come slower than the tick
        self._drawn_at, self._news_drawn = now, news
        view.tick()

    def redraw_every(self) -> float:
        """Seconds between redraws of a view of the whole fleet: each tick, or as often as summaries come when
        they come slower, yet at least every REDRAW_AT_LEAST_S.

        With summaries every 2 s a node's reading changes every 2 s: redrawing every second showed half the
        nodes' news for the whole painting (a third of a console's CPU at a thousand nodes, then at 2 s). What is news
        rather than a reading (an event, a link's state, a relay, an alert, an incident, a pre-flight result:
        ``StateStore.news``) is drawn at the next tick, the operator's note and keys at once, whatever this says.
        """
        options = getattr(self.runtime.fleet, "options", None)
        every = float(getattr(options, "summary_every", 0.0) or 0.0)
        return max(self.tick_seconds, min(every, REDRAW_AT_LEAST_S))

    def open_incident_count(self) -> int:
        backend = self.runtime.incidents
        if backend is None:
            return 0
        # Open as the operator means it: not acknowledged or silenced, and not recovered or resolved yet.
        return backend.open_count()

    # ------------------------------------------------------------- navigation

    def action_keys(self) -> None:
        if not isinstance(self.screen, KeysScreen):
            self.push_screen(KeysScreen(self.screen))

    def action_command_line(self) -> None:
        self.push_screen(CommandLine(), self.run_command)

    async def action_back(self) -> None:  # async, as the App action it overrides
        if len(self.screen_stack) > 1 and isinstance(self.screen, ViewScreen):
            self.pop_screen()

    def _home(self) -> None:
        while len(self.screen_stack) > 1:
            self.pop_screen()

    def show_view(self, name: str) -> None:
        """k9s-style: a view replaces whatever was above the fleet view."""
        self._home()
        if name in VIEWS:
            self.push_screen(VIEWS[name]())

    def open_node(self, name: str) -> None:
        if isinstance(self.screen, NodeScreen):
            self.pop_screen()
        self.push_screen(NodeScreen(name))

    def run_command(self, command: str | None) -> None:
        """Run what was typed after ``:``; an unknown command says so in the status bar."""
        if self._line_ending:
            # Keys typed after this line belong to what the command opens: hand them on after it.
            self._line_ending = False
            if self._stuck_timer is not None:
                self._stuck_timer.stop()
            self.call_later(self._release_held)
        if not command:
            return
        parsed = parse_command(command)
        if parsed is None:
            self.set_note(f"unknown command :{command} (try {usage_line(self.offers)})")
            return
        entry, rest = parsed
        if entry.verb is Verb.NODE:
            if self.runtime.store.by_name(rest) is None:
                self.set_note(f"no node called {rest!r}")
                return
            self.open_node(rest)
        else:
            self._verb_action(entry.verb, rest)()

    def _verb_action(self, verb: Verb, rest: str = "") -> Callable[[], None]:
        """What a command without a node name does: one place for the ``:`` line and the palette."""
        if verb is Verb.PREFLIGHT:
            return lambda: self.run_preflight(rest or None)
        if verb is Verb.QUIT:
            return self._quit_later  # asks first in the demo, as q does
        if verb is Verb.TAKEOVER:
            return self.action_take_over
        return lambda: self.show_view(verb)

    def set_note(self, note: str) -> None:
        self.note = note
        self._news_drawn = -1  # the operator's own feedback is news: drawn now, not at the fleet's cadence
        self.tick()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for entry in COMMANDS:
            if entry.palette and self.offers(entry):
                yield SystemCommand(entry.palette, entry.help[0].upper() + entry.help[1:], self._verb_action(entry.verb))

    # ------------------------------------------------------------ typing ahead

    def _waiting_screen(self) -> bool:
        """The screen on top cannot take keys yet: a line whose field has no focus, a view not drawn."""
        screen = self.screen
        if isinstance(screen, CommandLine):
            return not screen.taking_keys
        return isinstance(screen, ViewScreen) and not screen.ready

    def _holding_keys(self) -> bool:
        """Hold keys while the screen on top cannot take them, while a line's command has not run, or older keys wait."""
        return bool(self._held) or self._line_ending or self._waiting_screen()

    async def on_event(self, event: events.Event) -> None:
        """Keys typed straight after ``:`` reach the command line in order, as in k9s (a paste too).

        A key goes first to the focused widget and comes back to the app's bindings
        only later, behind keys already queued; so ``:`` opens the line here, on
        arrival, and what follows waits until the line's field has focus (and, after
        Enter, until the command has run and opened its view). Keys typed while a
        view is still coming (the console just started, a view just opened) wait
        until it has drawn itself and focused its widget.
        """
        if isinstance(event, (events.Key, events.Paste)) and not event.is_forwarded:
            if isinstance(event, events.Key) and event.key == "ctrl+j":
                # Typed before the console took the terminal over, Enter went through the terminal's
                # line discipline, which turns its carriage return into a line feed: it is still Enter.
                event = events.Key("enter", "\r")
            if self._holding_keys():
                self._held.append(event)
                if self._hold_timer is None:
                    self._hold_timer = self.set_timer(_HOLD_RECHECK_S, self._release_late)
                return
            await self._deliver(event)
            return
        await super().on_event(event)

    async def _deliver(self, event: events.Key | events.Paste) -> None:
        """Deliver a key as Textual would, except that ``:`` opens the line at once and Enter or
        Escape on the line holds what follows until the line's command has run."""
        if isinstance(event, events.Key):
            if event.key == "colon" and not isinstance(self.focused, Input) and not isinstance(self.screen, QuitScreen):
                self.action_command_line()
                return
            if event.key in _LINE_ENDING_KEYS and isinstance(self.screen, CommandLine):
                self._line_ending = True
                # A safety net: should the line not close, the held keys are not held for ever.
                self._stuck_timer = self.set_timer(1.0, self._release_stuck)
        await super().on_event(event)

    def _release_stuck(self) -> None:
        if self._line_ending:
            self._line_ending = False
            self.call_later(self._release_held)

    def on_command_line_ready(self, _: CommandLine.Ready) -> None:
        self.call_later(self._release_held)

    def on_view_screen_ready(self, _: ViewScreen.Ready) -> None:
        self.call_later(self._release_held)

    def _release_late(self) -> None:
        # The safety net: a view taken down before it was ready sends no Ready, and the screen
        # under it, ready long since, sends none either. Look again, and again while keys wait.
        self._hold_timer = None
        if self._held:
            self.call_later(self._release_held)

    async def _release_held(self) -> None:
        """Hand held keys on as if they arrived now; after one that ends the line, wait until its command ran."""
        while self._held and not self._line_ending and not self._waiting_screen():
            await self._deliver(self._held.pop(0))
        if self._held and self._hold_timer is None:
            self._hold_timer = self.set_timer(_HOLD_RECHECK_S, self._release_late)

    # --------------------------------------------------------------- actions

    def run_preflight(self, spec: str | None = None) -> None:
        """Pre-flight the connected nodes (or the node set ``spec``) in the background; progress in the status bar."""
        if self.preflight_running:
            self.set_note("pre-flight is already running")
            return
        try:
            nodes = expand(spec) if spec else None
        except HostlistError as exc:
            self.set_note(f"pre-flight: bad node set: {exc}")
            return

        def progress(done: int, total: int) -> None:
            self.set_note(f"pre-flight: {done}/{total} nodes answered")

        async def go() -> None:
            try:
                report = await self.runtime.preflight(nodes, progress)
            except ValueError as exc:
                self.set_note(f"pre-flight: {exc}")
                return
            except Exception as exc:  # noqa: BLE001 - shown to the operator; the console keeps going
                logger.exception("pre-flight failed")
                self.set_note(f"pre-flight could not run: {type(exc).__name__}: {exc}")
                return
            finally:
                self.preflight_running = False
            failed = report.failed
            outcome = f"pre-flight: {len(report.passed_nodes)} passed, {len(failed)} failed"
            if failed:
                outcome += " (" + ", ".join(sorted(failed)[:5]) + (" …" if len(failed) > 5 else "") + ")"
            self.set_note(outcome)

        self.preflight_running = True
        self.set_note("pre-flight: starting")
        self.run_worker(go(), group="preflight")

    def _quit_later(self) -> None:
        self.call_later(self.action_quit)

    async def action_quit(self) -> None:
        """Quit; in the demo, which quitting takes down, ask first (``q`` again or ``y`` quits)."""
        if not self.demo or isinstance(self.screen, QuitScreen):
            self.exit()
            return

        def answered(quit_now: bool | None) -> None:
            if quit_now:
                self.exit()

        self.push_screen(QuitScreen(), answered)

    def offers(self, entry: Command) -> bool:
        """Whether this console offers a ``:`` command: take over only where consoles share the acting."""
        return entry.verb is not Verb.TAKEOVER or self.runtime.election is not None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "take_over":
            election = self.runtime.election
            return election is not None and not election.leading and not self.runtime.read_only_flag
        return True

    def action_take_over(self) -> None:
        """Take the acting over from the console that leads: confirmed, with a reason, audited."""
        election = self.runtime.election
        if election is None:
            self.set_note("nothing to take over: this console has no etcd and leads alone")
            return
        if election.leading:
            self.set_note(f"this console leads already ({election.standing.line})")
            return
        leader = election.standing.leader or "no console"
        what = Text.assemble("take the acting over from ", (leader, "bold"),
                             ": this console's playbooks and actions act from now on, and the agents refuse "
                             "requests from the console that led")

        def done(result: Confirmed | None) -> None:
            if result is None:
                return
            if not result.reason:
                self.set_note("take over: give a reason (it goes to the audit log)")
                return

            async def go() -> None:
                self.set_note(await take_over(self.runtime, result.reason))

            self.set_note("take over: asking etcd")
            self.run_worker(go(), group="take-over")

        self.push_screen(ConfirmScreen("Confirm take over", what), done)

    def run_node_action(self, node: str, action: str, reason: str) -> None:
        """Send a confirmed action to a node in the background; its outcome lands in the status bar."""

        async def go() -> None:
            result = await self.runtime.node_action(node, action, reason)
            outcome = "ok" if result.ok else f"failed: {result.message}"
            if result.ok and action == AgentAction.CAPTURE_SCENE:
                outcome = f"ok: {result.message}"  # where the scene is, on the node and at the console
            self.set_note(f"{action} on {node}: {outcome}")

        self.set_note(f"{action} on {node}: sent")
        self.run_worker(go(), group="node-action")

    def run_incident_action(self, incident_id: str, what: str, reason: str, seconds: float | None) -> None:
        """Acknowledge, silence or act on an incident, already confirmed by the operator."""

        async def go() -> None:
            try:
                if what == "acknowledge":
                    self.runtime.acknowledge(incident_id, reason)
                    self.set_note(f"incident {incident_id} acknowledged")
                elif what == "silence":
                    self.runtime.silence(incident_id, seconds or 3600.0, reason)
                    self.set_note(f"incident {incident_id} silenced")
                else:
                    self.set_note(f"incident {incident_id}: {await self.runtime.act_on_incident(incident_id, reason)}")
            except (PermissionError, KeyError) as exc:
                self.set_note(f"{what} refused: {exc}")
            except Exception as exc:  # noqa: BLE001 - shown to the operator; the console keeps going
                logger.exception("incident action failed")
                self.set_note(f"{what} failed: {type(exc).__name__}: {exc}")

        self.run_worker(go(), group="incident-action")
