"""Screens of the console: one view per module, re-exported here."""

from gridwatch.console.tui.screens.base import ViewScreen
from gridwatch.console.tui.screens.command_line import COMMANDS, CommandLine
from gridwatch.console.tui.screens.confirm import Confirmed, ConfirmScreen
from gridwatch.console.tui.screens.fleet import FleetScreen
from gridwatch.console.tui.screens.incidents import IncidentsScreen
from gridwatch.console.tui.screens.jobs import JobsScreen
from gridwatch.console.tui.screens.keys import KeysScreen
from gridwatch.console.tui.screens.logs import LogsScreen
from gridwatch.console.tui.screens.node import NodeScreen
from gridwatch.console.tui.screens.quit import QuitScreen
from gridwatch.console.tui.screens.training import TrainingScreen

__all__ = ["COMMANDS", "CommandLine", "ConfirmScreen", "Confirmed", "FleetScreen", "IncidentsScreen", "JobsScreen", "KeysScreen",
           "LogsScreen", "NodeScreen", "QuitScreen", "TrainingScreen", "ViewScreen"]
