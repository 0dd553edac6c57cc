"""Screens of the console: one view per module, re-exported here."""

from console.screens.base import ViewScreen
from console.screens.command_line import COMMANDS, CommandLine
from console.screens.confirm import ConfirmScreen, Confirmed
from console.screens.fleet import FleetScreen
from console.screens.incidents import IncidentsScreen
from console.screens.keys import KeysScreen
from console.screens.logs import LogsScreen
from console.screens.node import NodeScreen
from console.screens.training import TrainingScreen

__all__ = ["COMMANDS", "CommandLine", "ConfirmScreen", "Confirmed", "FleetScreen", "IncidentsScreen", "KeysScreen",
           "LogsScreen", "NodeScreen", "TrainingScreen", "ViewScreen"]
