"""Open and recent incidents: timeline with time to detect and to recover, playbook, audit trail; acknowledge, silence, act.

``l`` opens the logs of the incident's nodes around its detection, merged by time, the blamed rank's lines marked.
"""

from __future__ import annotations

import time

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Static

from gridwatch.console.runtime.incidents import IncidentRow
from gridwatch.console.tui.screens.base import ViewScreen
from gridwatch.console.tui.screens.confirm import Confirmed, ConfirmScreen
from gridwatch.console.tui.screens.logs import Highlight, LogsScreen, LogWindow, ranks_named
from gridwatch.console.tui.screens.node import SEVERITY_STYLES
from gridwatch.console.tui.widgets import Column, PlainStatic, TextTable, format_age
from gridwatch.console.tui.widgets.text_table import Cell

# WHAT takes the room a wide terminal has, and gives it up first on a narrow one (the detail shows it whole).
INCIDENT_COLUMNS = [
    Column("sev", "SEV", 8),
    Column("state", "STATE", 12),
    Column("node", "NODE", 16, min_width=10, clip="start"),
    Column("title", "WHAT", 40, min_width=20, grow=True),
    Column("playbook", "PLAYBOOK", 22, min_width=12),
    Column("ttd", "TTD", 7, "right"),
    Column("ttr", "TTR", 7, "right"),
    Column("age", "AGE", 6, "right"),
]
# The logs key shows this long before the incident's fault (or detection) to this long after its detection.
INCIDENT_LOG_WINDOW_S = 300.0
STATE_STYLES = {"open": Style(color="red", bold=True), "acting": Style(color="yellow", bold=True),
                "acknowledged": Style(color="yellow"), "silenced": Style(color="grey50"),
                "recovered": Style(color="cyan"), "resolved": Style(color="green")}


def state_word(row: IncidentRow) -> str:
    """What the STATE column says: the incident's phase (open, acting, recovered, resolved), as the store and
    /metrics have it; an operator's acknowledgement or silence shows while nothing has recovered yet."""
    phase = str(row.phase)
    if row.state in ("acknowledged", "silenced") and phase in ("open", "acting"):
        return row.state
    return phase


def _when(ts: float | None) -> str:
    return "—" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _secs(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.1f}s" if value < 100 else format_age(value)


def incident_cells(row: IncidentRow, now: float) -> list[Cell]:
    return [
        (row.severity, SEVERITY_STYLES.get(row.severity)),
        (word := state_word(row), STATE_STYLES.get(word)),
        (row.node, None),
        (row.title, None),
        (row.playbook or "", None),
        (_secs(row.detect_s), None),
        (_secs(row.recover_s), None),
        (format_age(now - row.detected_at), None),
    ]


def mean_times(rows: list[IncidentRow]) -> str:
    """MTTD and MTTR over the incidents listed that have them, for the title line."""
    detect = [r.detect_s for r in rows if r.detect_s is not None]
    recover = [r.recover_s for r in rows if r.recover_s is not None]
    if not detect and not recover:
        return ""
    mttd = f"{sum(detect) / len(detect):.1f}s" if detect else "—"
    mttr = f"{sum(recover) / len(recover):.1f}s over {len(recover)}" if recover else "—"
    return f"  MTTD {mttd}  MTTR {mttr}"


def incident_detail(row: IncidentRow) -> Text:
    """Timeline, plan and audit trail of one incident, as plain text."""
    text = Text()
    text.append(row.title, style="bold")
    text.append(f"  on {row.node}  [{row.id}]\n")
    if row.blamed:
        # Who the ranks' collective records name, and why: the node acted on, not the ones that reported.
        text.append("blamed     ", style="bold")
        text.append(", ".join(row.blamed), style="bold red")
        text.append(f"  {row.blame_why}\n" if row.blame_why else "\n")
    if row.fault_at is not None:
        step = "" if row.fault_step is None else f"  (training step {row.fault_step})"
        text.append(f"fault      {_when(row.fault_at)}{step}\n")
    detect = "" if row.detect_s is None else f"  ({row.detect_s:.1f} s after the fault)"
    text.append(f"detected   {_when(row.detected_at)}{detect}\n")
    text.append(f"acted      {_when(row.acted_at)}\n")
    recover = "" if row.recover_s is None else f"  ({row.recover_s:.1f} s after the fault: the job trains past it)"
    text.append(f"recovered  {_when(row.recovered_at)}{recover}\n")
    if row.silenced_until is not None and row.state == "silenced":
        text.append(f"silenced until {_when(row.silenced_until)}\n", style="grey50")
    text.append(f"playbook   {row.playbook or 'none'}\n")
    for i, step in enumerate(row.plan, 1):
        text.append(f"  {i}. {step}\n")
    text.append("audit trail\n", style="bold")
    if not row.audit:
        text.append("  (nothing yet)\n", style="dim")
    for entry in row.audit:
        text.append(f"  {_when(entry.at)}  {entry.who}  {entry.what}")
        if entry.why:
            text.append(f"  why: {entry.why}")
        if entry.outcome:
            text.append(f"  -> {entry.outcome}")
        text.append("\n")
    return text


class IncidentsScreen(ViewScreen):
    """Every change asks first (a modal); in read-only mode the changing keys do not exist."""

    VIEW_NAME = "incidents"
    CHANGING_ACTIONS = frozenset({"acknowledge", "silence", "act"})
    BINDINGS = [
        Binding("a", "acknowledge", "Acknowledge"),
        Binding("s", "silence", "Silence"),
        Binding("x", "act", "Act (run plan)"),
        Binding("l", "logs", "Logs around it"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, IncidentRow] = {}

    def compose_view(self) -> ComposeResult:
        yield TextTable(INCIDENT_COLUMNS, id="incident-table")
        yield PlainStatic(id="incident-detail")

    def prepare(self) -> None:
        self.query_one("#incident-table", TextTable).focus()

    def refresh_view(self) -> None:
        backend = self.runtime.incidents
        rows = backend.incidents() if backend is not None else []
        self.set_title(("gridwatch", "bold"), "  incidents", mean_times(rows))
        self.rows = {r.id: r for r in rows}
        now = self.store.clock.now()
        table = self.query_one("#incident-table", TextTable)
        table.set_rows([incident_cells(r, now) for r in rows], [r.id for r in rows])
        self._show_detail(table.cursor_key)

    def _show_detail(self, key: str | None) -> None:
        detail = self.query_one("#incident-detail", Static)
        if self.runtime.incidents is None:
            detail.update(Text("no incident store is attached to this console", style="yellow"))
        elif key is None or key not in self.rows:
            detail.update(Text("no incidents", style="green"))
        else:
            row = self.runtime.incidents.detail(key) or self.rows[key]
            detail.update(incident_detail(row))

    def on_text_table_highlighted(self, event: TextTable.Highlighted) -> None:
        self._show_detail(event.key)

    def _selected(self) -> IncidentRow | None:
        key = self.query_one("#incident-table", TextTable).cursor_key
        return self.rows.get(key) if key else None

    def log_window(self, row: IncidentRow) -> LogWindow:
        """The reporters' and the blamed node's logs from a few minutes before the incident to a few after."""
        stored = getattr(self.runtime.plan_store, "stored_incident", None)
        incident = stored(row.id) if stored is not None else None
        nodes = list(dict.fromkeys([row.node, *(incident.reporters if incident is not None else [])]))
        summary = incident.summary if incident is not None and incident.summary else row.title
        start = min(t for t in (row.fault_at, row.detected_at) if t is not None)
        return LogWindow(f"incident {row.id}", nodes, start - INCIDENT_LOG_WINDOW_S,
                         row.detected_at + INCIDENT_LOG_WINDOW_S,
                         Highlight(frozenset(ranks_named(summary)), frozenset([row.node])))

    def action_logs(self) -> None:
        row = self._selected()
        if row is not None:
            self.app.push_screen(LogsScreen(self.log_window(row)))

    def action_acknowledge(self) -> None:
        row = self._selected()
        if row is not None:
            self._confirm("Acknowledge incident", row, "acknowledge", None)

    def action_silence(self) -> None:
        row = self._selected()
        if row is not None:
            self._confirm("Silence incident", row, "silence", "1h")

    def action_act(self) -> None:
        row = self._selected()
        if row is not None:
            self._confirm("Run the plan", row, "act", None)

    def _confirm(self, title: str, row: IncidentRow, what: str, duration: str | None) -> None:
        text = Text.assemble(f"{what} ", (row.title, "bold"), " on ", (row.node, "bold"))
        if what == "act" and row.plan:
            text.append("\nplan: " + " → ".join(row.plan))

        def done(result: Confirmed | None) -> None:
            if result is not None:
                self.gw.run_incident_action(row.id, what, result.reason, result.seconds)

        self.app.push_screen(ConfirmScreen(title, text, ask_duration=duration), done)
