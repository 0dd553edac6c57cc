"""The Textual app of ``gridwatch console``: views over the state store, redrawn on a timer."""

from __future__ import annotations

from typing import Iterable

from loguru import logger
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from console.hostlist import HostlistError, expand
from console.runtime import ConsoleRuntime
from console.screens import (
    CommandLine,
    FleetScreen,
    IncidentsScreen,
    KeysScreen,
    LogsScreen,
    NodeScreen,
    TrainingScreen,
    ViewScreen,
)

VIEWS: dict[str, type[ViewScreen]] = {
    "logs": LogsScreen,
    "incidents": IncidentsScreen,
    "training": TrainingScreen,
}


class GridwatchApp(App[None]):
    """Bindings and navigation; every view reads the store on one 1 Hz tick, never per frame."""

    CSS_PATH = "app.tcss"
    TITLE = "gridwatch"
    BINDINGS = [
        Binding("question_mark", "keys", "Keys"),
        Binding("colon", "command_line", "Command"),
        Binding("escape", "back", "Back"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, runtime: ConsoleRuntime, *, tick_seconds: float = 1.0, start_runtime: bool = True) -> None:
        super().__init__()
        self.runtime = runtime
        self.tick_seconds = tick_seconds
        self.start_runtime = start_runtime
        self.note = ""  # the outcome of the last operator action, shown in the status bar
        self.preflight_running = False

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
        """Run the engine's clock rules, then redraw the topmost view (modals sit above it and stay put)."""
        self.runtime.tick_engine()
        for screen in reversed(self.screen_stack):
            if isinstance(screen, ViewScreen):
                screen.tick()
                break

    def open_incident_count(self) -> int:
        backend = self.runtime.incidents
        if backend is None:
            return 0
        return sum(1 for row in backend.incidents() if row.state == "open")

    # ------------------------------------------------------------- navigation

    def action_keys(self) -> None:
        if not isinstance(self.screen, KeysScreen):
            self.push_screen(KeysScreen(self.screen))

    def action_command_line(self) -> None:
        self.push_screen(CommandLine(), self.run_command)

    def action_back(self) -> None:
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
        if not command:
            return
        word, _, rest = command.partition(" ")
        word = word.lower()
        if word in ("nodes", "node", "fleet", "no") and not rest:
            self.show_view("nodes")
        elif word in ("node", "no") and rest:
            if self.runtime.store.by_name(rest.strip()) is None:
                self.set_note(f"no node called {rest.strip()!r}")
                return
            self.open_node(rest.strip())
        elif word in ("logs", "log", "lo"):
            self.show_view("logs")
        elif word in ("incidents", "incident", "inc", "in"):
            self.show_view("incidents")
        elif word in ("training", "train", "tr"):
            self.show_view("training")
        elif word in ("preflight", "pre-flight", "pf"):
            self.run_preflight(rest.strip() or None)
        elif word in ("q", "quit", "exit"):
            self.exit()
        else:
            self.set_note(f"unknown command :{command} (try :nodes :logs :incidents :training :preflight)")

    def set_note(self, note: str) -> None:
        self.note = note
        self.tick()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Nodes", "The fleet: heatmap and node table", lambda: self.show_view("nodes"))
        yield SystemCommand("Logs", "Events and log lines across nodes", lambda: self.show_view("logs"))
        yield SystemCommand("Incidents", "Open and recent incidents", lambda: self.show_view("incidents"))
        yield SystemCommand("Training", "The training run", lambda: self.show_view("training"))
        yield SystemCommand("Pre-flight", "Check every connected node now (changes nothing)", self.run_preflight)

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

    def run_node_action(self, node: str, action: str, reason: str) -> None:
        """Send a confirmed action to a node in the background; its outcome lands in the status bar."""

        async def go() -> None:
            result = await self.runtime.node_action(node, action, reason)
            outcome = "ok" if result.ok else f"failed: {result.message}"
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
