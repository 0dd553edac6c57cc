"""The training run: step, where its time went (goodput and its losses), loss curve, step time per rank, checkpoints."""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Static

from gridwatch.console.fleet.goodput import LABELS, Breakdown, Reliability, TimeUse
from gridwatch.console.fleet.rows import TrainingSummary
from gridwatch.console.tui.screens.base import ViewScreen
from gridwatch.console.tui.widgets import BraillePlot, Column, PlainStatic, TextTable, format_age
from gridwatch.console.tui.widgets.text_table import Cell

RANK_COLUMNS = [
    Column("rank", "RANK", 5, "right"),
    Column("time", "STEP TIME", 9, "right"),
    Column("bar", "", 30),
    Column("mark", "", 10),
]
_STRAGGLER = Style(color="red", bold=True)
NO_TRAINER = "no trainer attached: no node reports a trainer status"
BAR_WIDTH = 60
# One colour per use of time; the legend names each, so the bar reads without colour too.
USE_STYLES: dict[TimeUse, str] = {
    TimeUse.PRODUCTIVE: "green", TimeUse.DETECTION: "red", TimeUse.REFORM: "magenta",
    TimeUse.RECOMPUTE: "bright_red", TimeUse.CHECKPOINT: "blue", TimeUse.RESTORE: "cyan",
    TimeUse.WAITING: "yellow", TimeUse.STARTUP: "bright_blue", TimeUse.SLOW_STEPS: "bright_yellow",
    TimeUse.OTHER: "grey50",
}


def rank_cells(summary: TrainingSummary) -> tuple[list[list[Cell]], list[str]]:
    """One row per rank; a straggler's bar and mark are red."""
    times = summary.status.rank_step_times
    stragglers = set(summary.status.stragglers)
    slowest = max(times.values(), default=0.0) or 1.0

    def rank_of(key: str) -> int:
        return int(key) if key.isdigit() else 1 << 30

    rows: list[list[Cell]] = []
    keys: list[str] = []
    for rank in sorted(times, key=rank_of):
        seconds = times[rank]
        late = rank_of(rank) in stragglers
        style = _STRAGGLER if late else None
        rows.append([(rank, style), (f"{seconds:.3f}s", style), ("█" * max(int(30 * seconds / slowest), 1), style),
                     ("straggler" if late else "", style)])
        keys.append(rank)
    return rows, keys


def training_text(summary: TrainingSummary) -> Text:
    s = summary.status
    text = Text()
    text.append(f"job {s.job or 'N/A'}", style="bold")
    text.append(f"   phase {s.phase}   step {s.step if s.step is not None else 'N/A'}")
    if s.epoch is not None:
        text.append(f"   epoch {s.epoch}")
    text.append(f"   loss {s.loss:.4f}" if s.loss is not None else "   loss N/A")
    text.append(f"   tokens/s {s.tokens_per_s:,.0f}" if s.tokens_per_s is not None else "   tokens/s N/A")
    text.append(f"   step time {s.step_time_s:.3f}s" if s.step_time_s is not None else "")
    text.append(f"\nworld size {s.world_size if s.world_size is not None else 'N/A'}   membership: ")
    text.append(", ".join(str(m) for m in s.membership) or "N/A")
    text.append(f"\nreported by {summary.node} {format_age(summary.age_s)} ago; {summary.nodes_reporting} nodes report")
    return text


def bar_cells(breakdown: Breakdown, width: int = BAR_WIDTH) -> list[tuple[TimeUse, int]]:
    """How many of ``width`` cells each use gets (largest remainders), in the order of :class:`TimeUse`."""
    wall = breakdown.wall_s
    if wall <= 0:
        return []
    exact = [(use, width * breakdown.seconds[use] / wall) for use in TimeUse]
    cells = {use: int(x) for use, x in exact}
    spare = width - sum(cells.values())
    for use, x in sorted(exact, key=lambda item: -(item[1] - int(item[1])))[:max(spare, 0)]:
        cells[use] += 1
    return [(use, cells[use]) for use in TimeUse if cells[use] > 0]


def _pct(value: float | None) -> str:
    return "N/A" if value is None else f"{value * 100:.1f} %"


def _dur(value: float | None) -> str:
    return "N/A" if value is None else f"{value:.1f} s"


def goodput_text(windows: dict[str, Breakdown], reliability: Reliability) -> Text:
    """Where the run's time went: one bar of blocks over the run, goodput per window, the losses named."""
    run = windows["run"]
    text = Text("where the time went", style="bold")
    text.append(f"   goodput {_pct(run.goodput)} over {run.wall_s:.0f} s")
    for name, window in windows.items():
        if name != "run":
            text.append(f"   {name} {_pct(window.goodput)}")
    text.append("\n")
    for use, cells in bar_cells(run):
        text.append("\u2588" * cells, style=USE_STYLES[use])
    text.append("\n")
    parts = [(TimeUse.PRODUCTIVE, run.seconds[TimeUse.PRODUCTIVE]), *run.losses()] if run.wall_s > 0 else []
    for index, (use, seconds) in enumerate(parts):
        text.append("  " if index else "")
        text.append("\u2588", style=USE_STYLES[use])
        text.append(f" {LABELS[use]} {seconds:.0f} s ({run.share(use) * 100:.1f} %)")
    text.append(f"\n{reliability.incidents} incidents   MTTD {_dur(reliability.mttd_s)}   "
                f"MTTR {_dur(reliability.mttr_s)}   MTBF {_dur(reliability.mtbf_s)}")
    return text


def checkpoint_text(summary: TrainingSummary) -> Text:
    tiers = {"0": "memory", "1": "local disk", "2": "second copy"}
    text = Text("last checkpoint per tier\n", style="bold")
    for tier, label in tiers.items():
        step = summary.status.checkpoints.get(tier)
        text.append(f"  tier {tier} {label:<12} ")
        text.append("none yet" if step is None else f"step {step}", style="yellow" if step is None else "")
        text.append("\n")
    for tier, step in summary.status.checkpoints.items():
        if tier not in tiers:
            text.append(f"  tier {tier} step {step}\n")
    return text


class TrainingScreen(ViewScreen):
    """Reads the most advanced trainer status; says so plainly when none is attached."""

    VIEW_NAME = "training"

    def compose_view(self) -> ComposeResult:
        yield PlainStatic(id="training-head")
        goodput = PlainStatic(id="goodput")
        goodput.styles.padding = (0, 1)  # in line with the head above it
        yield goodput
        with Horizontal(id="training-body"):
            with Vertical(id="loss-pane"):
                yield PlainStatic(Text("loss", style="bold"), classes="pane-title", id="loss-title")
                yield BraillePlot(id="loss-plot")
            with Vertical(id="ranks-pane"):
                yield PlainStatic(Text("step time per rank", style="bold"), classes="pane-title")
                yield TextTable(RANK_COLUMNS, id="rank-table")
                yield PlainStatic(id="checkpoints")

    def refresh_view(self) -> None:
        self.set_title(("gridwatch", "bold"), "  training")
        summary = self.store.training()
        head = self.query_one("#training-head", Static)
        if summary is None:
            head.update(Text(NO_TRAINER, style="bold yellow"))
            self.query_one("#loss-plot", BraillePlot).set_points([])
            self.query_one("#rank-table", TextTable).set_rows([], [])
            self.query_one("#checkpoints", Static).update("")
            self.query_one("#goodput", Static).display = False
            return
        head.update(training_text(summary))
        goodput = self.runtime.goodput
        windows = goodput.windows()
        bar = self.query_one("#goodput", Static)
        bar.display = windows["run"].wall_s > 0  # nothing to break down before the console has followed the job
        if bar.display:
            bar.update(goodput_text(windows, goodput.reliability()))
        self.query_one("#loss-plot", BraillePlot).set_points([(float(s), v) for s, v in summary.loss])
        if summary.loss:
            first, last = summary.loss[0][0], summary.loss[-1][0]
            self.query_one("#loss-title", Static).update(Text(f"loss, steps {first} to {last}", style="bold"))
        rows, keys = rank_cells(summary)
        self.query_one("#rank-table", TextTable).set_rows(rows, keys)
        self.query_one("#checkpoints", Static).update(checkpoint_text(summary))
