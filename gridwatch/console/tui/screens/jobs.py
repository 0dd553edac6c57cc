"""The scheduler's jobs across the fleet, as ``squeue`` shows them: read by each node's agent, never the controller."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult

from gridwatch.console.fleet.node import NodeStatus
from gridwatch.console.fleet.rows import JobRow
from gridwatch.console.tui.screens.base import ViewScreen
from gridwatch.console.tui.screens.fleet import STATUS_STYLES
from gridwatch.console.tui.widgets import Column, PlainStatic, TextTable
from gridwatch.console.tui.widgets.text_table import Cell
from gridwatch.sshlink.hostlist import compress

JOB_COLUMNS = [
    Column("id", "JOBID", 10),
    Column("scheduler", "SCHED", 10),
    Column("user", "USER", 10),
    Column("name", "NAME", 20, min_width=8, clip="start"),
    Column("state", "WORST NODE", 10),
    Column("nodes", "NODES", 18, min_width=8),
    Column("on", "SEEN ON", 24, min_width=8, grow=True),
    Column("pids", "PROCS", 6, "right"),
]
NO_JOBS = "no scheduler job seen: no agent reports a Slurm job or a Kubernetes pod on its node"


def job_cells(row: JobRow) -> list[Cell]:
    """One job as plain-text cells (node text is never markup); the worst node's state in its colour."""
    return [(row.id, None), (row.scheduler, None), (row.user, None), (row.name, None),
            (str(row.worst), STATUS_STYLES[row.worst] if row.worst is not NodeStatus.OK else None),
            (row.nodes, None), (compress(row.on), None), (str(row.pids), None)]


class JobsScreen(ViewScreen):
    """One row per job; Enter opens the first node it runs on."""

    VIEW_NAME = "jobs"

    def __init__(self) -> None:
        super().__init__()
        self._rows: dict[str, JobRow] = {}

    def compose_view(self) -> ComposeResult:
        yield PlainStatic(id="jobs-note")
        yield TextTable(JOB_COLUMNS, keep=2, id="job-table")

    def prepare(self) -> None:
        self.query_one("#job-table", TextTable).focus()

    def refresh_view(self) -> None:
        rows = self.store.jobs()
        self.set_title(("gridwatch", "bold"), f"  jobs  {len(rows)}")
        note = self.query_one("#jobs-note", PlainStatic)
        note.update(Text(NO_JOBS, style="bold yellow") if not rows else Text(""))
        note.display = not rows
        self._rows = {f"{r.scheduler}/{r.id}": r for r in rows}
        self.query_one("#job-table", TextTable).set_rows(rows, list(self._rows), job_cells)

    def on_text_table_selected(self, event: TextTable.Selected) -> None:
        row = self._rows.get(event.key)
        if row is not None and row.on:
            self.gw.open_node(row.on[0])
