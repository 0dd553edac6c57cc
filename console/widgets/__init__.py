"""Widgets of the console: each in its own module, re-exported here."""

from console.widgets.heatmap import GpuHeatmap
from console.widgets.plain import PlainStatic, plain, plain_text
from console.widgets.plot import BraillePlot
from console.widgets.sparkline import sparkline
from console.widgets.status_bar import StatusBar, format_age, format_rate
from console.widgets.text_table import Column, TextTable

__all__ = ["BraillePlot", "Column", "GpuHeatmap", "PlainStatic", "StatusBar", "TextTable", "format_age", "format_rate", "plain",
           "plain_text", "sparkline"]
