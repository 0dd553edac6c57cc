"""The line above the key footer: connected/total nodes, the age of the oldest data, the mode."""

from __future__ import annotations

from rich.text import Text

from gridwatch.console.fleet.rows import FleetSummary
from gridwatch.console.tui.widgets.plain import PlainStatic


def format_age(seconds: float | None) -> str:
    """``0.4s``, ``12s``, ``3m``, ``2h``; N/A for never."""
    if seconds is None:
        return "N/A"
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def format_rate(bps: float | None) -> str:
    """Bytes per second, human-sized; N/A for None."""
    if bps is None:
        return "N/A"
    for unit in ("B", "K", "M", "G"):
        if abs(bps) < 1000:
            return f"{bps:.0f}{unit}" if unit == "B" else f"{bps:.1f}{unit}"
        bps /= 1000
    return f"{bps:.1f}T"


class StatusBar(PlainStatic):
    """Shows a :class:`FleetSummary`; the app sets it once a tick."""

    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; color: $text; padding: 0 1; }
    """

    def show(self, summary: FleetSummary, read_only: bool, incidents_open: int = 0, note: str = "", alert: str = "",
             role: str = "", role_style: str = "") -> None:
        """``role``: where this console stands among several sharing the acting (empty: it is alone)."""
        text = Text()
        style = "green" if summary.connected == summary.total and summary.total else "yellow"
        text.append(f"{summary.connected}/{summary.total} nodes connected", style=style)
        if summary.hearsay:
            # Not agents' links: the exporter's series, which can watch and page but not act.
            text.append(f" ({summary.hearsay:,} read from Prometheus, no agent)", style="yellow")
        text.append(f"  {summary.gpus} GPUs")
        text.append(f"  oldest data {format_age(summary.oldest_age_s)}")
        if incidents_open:
            text.append(f"  {incidents_open} open incidents", style="bold red")
        text.append("  READ-ONLY" if read_only else "  operator", style="bold cyan" if read_only else "bold")
        if role:
            text.append(f"  {role}", style=role_style)
        if alert:
            # The console's own trouble (its incident database failing): louder than any note.
            text.append("  ")
            text.append(alert, style="bold white on red")
        if note:
            text.append("  ")
            text.append(note, style="italic")
        # One line, fixed height: no layout pass for the whole screen on every tick (and none at all when unchanged).
        self.update(text, layout=False)
