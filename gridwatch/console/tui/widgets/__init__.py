"""Widgets of the console: each in its own module, re-exported here."""

from gridwatch.console.tui.widgets.heatmap import GpuHeatmap
from gridwatch.console.tui.widgets.plain import PlainStatic, plain, plain_text
from gridwatch.console.tui.widgets.plot import BraillePlot
from gridwatch.console.tui.widgets.sparkline import sparkline
from gridwatch.console.tui.widgets.status_bar import StatusBar, format_age, format_rate
from gridwatch.console.tui.widgets.text_table import Column, TextTable

__all__ = ["BraillePlot", "Column", "GpuHeatmap", "PlainStatic", "StatusBar", "TextTable", "format_age", "format_rate", "plain",
           "plain_text", "sparkline"]
