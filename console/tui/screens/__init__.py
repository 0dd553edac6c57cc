"""Screens of the console: one view per module, re-exported here."""

from console.tui.screens.base import ViewScreen
from console.tui.screens.command_line import COMMANDS, CommandLine
from console.tui.screens.confirm import ConfirmScreen, Confirmed
from console.tui.screens.fleet import FleetScreen
from console.tui.screens.incidents import IncidentsScreen
from console.tui.screens.keys import KeysScreen
from console.tui.screens.logs import LogsScreen
from console.tui.screens.node import NodeScreen
from console.tui.screens.training import TrainingScreen

__all__ = ["COMMANDS", "CommandLine", "ConfirmScreen", "Confirmed", "FleetScreen", "IncidentsScreen", "KeysScreen",
           "LogsScreen", "NodeScreen", "TrainingScreen", "ViewScreen"]
