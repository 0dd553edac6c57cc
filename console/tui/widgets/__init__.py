"""Widgets of the console: each in its own module, re-exported here."""

from console.tui.widgets.heatmap import GpuHeatmap
from console.tui.widgets.plain import PlainStatic, plain, plain_text
from console.tui.widgets.plot import BraillePlot
from console.tui.widgets.sparkline import sparkline
from console.tui.widgets.status_bar import StatusBar, format_age, format_rate
from console.tui.widgets.text_table import Column, TextTable

__all__ = ["BraillePlot", "Column", "GpuHeatmap", "PlainStatic", "StatusBar", "TextTable", "format_age", "format_rate", "plain",
           "plain_text", "sparkline"]
