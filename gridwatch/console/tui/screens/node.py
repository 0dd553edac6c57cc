"""One node up close: per-GPU rows with sparklines, host sparklines, patrol and pre-flight, events, live log."""

from __future__ import annotations

import math
import time

from rich.cells import cell_len
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Static

from gridwatch.console.fleet.history import (
    GPU_MEM,
    GPU_POWER,
    GPU_TEMP,
    GPU_UTIL,
    HOST_CPU,
    HOST_MEM,
    HOST_RX,
    HOST_TX,
)
from gridwatch.console.fleet.metrics import gpu_pcie_traffic, hca_traffic, host_traffic
from gridwatch.console.fleet.node import (
    CheckVerdict,
    NodeState,
    PatrolStatus,
    event_text,
)
from gridwatch.console.fleet.prometheus import HistoryWindow, NodeHistory, Panel
from gridwatch.console.tui.screens.base import ViewScreen
from gridwatch.console.tui.screens.confirm import Confirmed, ConfirmScreen
from gridwatch.console.tui.widgets import Column, PlainStatic, TextTable, format_age, format_rate, sparkline
from gridwatch.console.tui.widgets.text_table import Cell
from gridwatch.playbooks.durations import format_duration
from gridwatch.playbooks.history import LEMON_AT, TrackRecord
from gridwatch.wire.protocol import AgentAction, IbPortSample

SPARK = 16  # the widest a GPU metric's sparkline is drawn; narrower (to none) where the screen is narrower
_METRICS = (("util", "UTIL %"), ("temp", "TEMP °C"), ("power", "POWER W"), ("mem", "MEM %"))
UNKNOWN = "-"  # a clock or rate the GPU's NVML does not give


def gpu_columns(spark: int) -> list[Column]:
    """The per-GPU table with sparklines ``spark`` cells wide (0: values only).

    What says a GPU is bad (state, XIDs, ECC, throttling) comes first, as in the fleet table: a narrow
    screen scrolls the metrics off to the right (arrows), never those.
    """
    def metric(key: str, title: str) -> Column:
        return Column(key, title, max(cell_len(title), 4 + (spark + 1 if spark else 0)), "left" if spark else "right")

    return [
        Column("gpu", "GPU", 3, "right"),
        Column("name", "NAME", 18, min_width=8),
        Column("state", "STATE", 6),
        Column("xid", "XID", 4, "right"),
        Column("ecc", "ECC s/d", 7),
        Column("throttle", "THROTTLE", 16, min_width=8),
        *(metric(key, title) for key, title in _METRICS),
        Column("clock", "SM/MEM MHz", 10, "right"),
        Column("pcie", "PCIE RX/TX", 11, "right"),
        Column("nvlink", "NVLINK RX/TX", 13, "right"),
    ]


def spark_width(width: int) -> int:
    """The widest sparkline (up to SPARK) with which every GPU column fits in ``width`` cells at its full width."""
    for spark in range(SPARK, 0, -1):
        if sum(c.width + 1 for c in gpu_columns(spark)) <= width:
            return spark
    return 0


PROCESS_COLUMNS = [
    Column("gpu", "GPU", 3, "right"),
    Column("pid", "PID", 8, "right"),
    Column("user", "USER", 12),
    Column("job", "JOB", 10),
    Column("mem", "GPU MEM", 9, "right"),
    Column("command", "COMMAND", 80, grow=True),
]
PROCESS_ROWS = 8  # the processes pane's height in rows; more scroll (tab to it)
EVENT_COLUMNS = [
    Column("time", "TIME", 8),
    Column("sev", "SEV", 8),
    Column("what", "EVENT", 80, grow=True),
]
LOG_COLUMNS = [
    Column("time", "TIME", 8),
    Column("source", "SOURCE", 16),
    Column("line", "LINE", 140, grow=True),
]
SEVERITY_STYLES = {
    "critical": Style(color="red", bold=True, reverse=True),
    "error": Style(color="red", bold=True),
    "warning": Style(color="yellow"),
    "info": Style(color="cyan"),
}
_BAD = Style(color="red", bold=True)
_HOT = Style(color="yellow", bold=True)  # hot is a warning; red is for what is broken
HOT_C = 85  # a GPU this hot (°C) is marked hot
_GOOD = Style(color="green")
_MUTED = Style(color="grey50")
# Host lines: label 8, value 9, sparkline, " (ib 400.0G)" 12 within the host pane (70, less padding and scrollbar).
HOST_SPARK = 36


def clock_time(ts: float) -> str:
    """Local HH:MM:SS of a timestamp."""
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "--:--:--"


def _value_spark(now: float | None, series: list[float], fmt: str, lo: float | None, hi: float | None,
                 spark: int = SPARK) -> str:
    value = "N/A" if now is None else format(now, fmt)
    return (f"{value:>4} " + sparkline(series, spark, lo, hi)) if spark else value


def format_clocks(sm_mhz: float | None, mem_mhz: float | None) -> str:
    """SM and memory clocks as ``1980/2619`` (MHz, the column says so); ``-`` for one NVML does not give."""
    if sm_mhz is None and mem_mhz is None:
        return UNKNOWN
    return "/".join(UNKNOWN if v is None else f"{v:.0f}" for v in (sm_mhz, mem_mhz))


def format_pair(rx: float | None, tx: float | None) -> str:
    """Received/sent bytes per second as ``12.3G/4.5G``; ``-`` for a direction NVML does not give."""
    if rx is None and tx is None:
        return UNKNOWN
    return "/".join(UNKNOWN if v is None else format_rate(v) for v in (rx, tx))


def squeeze(values: list[float], width: int) -> list[float]:
    """``values`` averaged into ``width`` buckets (NaN where a bucket has no data), for a sparkline of a long past."""
    if len(values) <= width:
        return values
    out = []
    for i in range(width):
        part = [v for v in values[i * len(values) // width:(i + 1) * len(values) // width] if not math.isnan(v)]
        out.append(sum(part) / len(part) if part else math.nan)
    return out


def gpu_cells(node: NodeState, history: NodeHistory | None = None, spark: int = SPARK) -> tuple[list[list[Cell]], list[str]]:
    """Per-GPU rows in :func:`gpu_columns` order, sparklines ``spark`` wide.

    The sparklines show ``history`` (the past hour or day from Prometheus) when given.
    """
    rows: list[list[Cell]] = []
    keys: list[str] = []
    sample = node.sample
    if sample is None:
        return rows, keys
    names = {g.index: str(g.name) for g in node.hello.gpus} if node.hello else {}
    for gpu in sample.gpus:
        hist = node.gpu_history[gpu.index] if gpu.index < len(node.gpu_history) else None
        series = (lambda m: hist.series(m)) if hist else (lambda m: [])  # noqa: E731
        if history is not None:
            past = history.gpus.get(gpu.index)
            series = (lambda m: squeeze(past[m], SPARK)) if past else (lambda m: [])  # noqa: E731
        mem = 100.0 * gpu.mem_used_mb / gpu.mem_total_mb if gpu.mem_used_mb is not None and gpu.mem_total_mb else None
        sbe = "N/A" if gpu.ecc_sbe is None else str(gpu.ecc_sbe)
        dbe = "N/A" if gpu.ecc_dbe is None else str(gpu.ecc_dbe)
        xids = node.xids.get(gpu.index, 0)
        rows.append([
            (str(gpu.index), None),
            (names.get(gpu.index, "?"), None),
            (str(gpu.state), _BAD if gpu.state != "ok" else None),
            (str(xids), _BAD if xids else None),
            (f"{sbe}/{dbe}", _BAD if (gpu.ecc_dbe or 0) > 0 else None),
            (",".join(str(t) for t in gpu.throttle), Style(color="yellow") if gpu.throttle else None),
            (_value_spark(gpu.util, series(GPU_UTIL), ".0f", 0, 100, spark), None),
            (_value_spark(gpu.temp_c, series(GPU_TEMP), ".0f", 20, 95, spark),
             _HOT if (gpu.temp_c or 0) >= HOT_C else None),
            (_value_spark(gpu.power_w, series(GPU_POWER), ".0f", 0, None, spark), None),
            (_value_spark(mem, series(GPU_MEM), ".0f", 0, 100, spark), None),
            (format_clocks(gpu.sm_clock_mhz, gpu.mem_clock_mhz), None),
            (format_pair(*gpu_pcie_traffic(gpu)), None),
            (format_pair(gpu.nvlink_rx_bps, gpu.nvlink_tx_bps), None),
        ])
        keys.append(str(gpu.index))
    return rows, keys


def format_mib(mb: float | None) -> str:
    """GPU memory as nvitop writes it: ``812MiB``, ``30.5GiB``; N/A for None."""
    if mb is None:
        return "N/A"
    return f"{mb:.0f}MiB" if mb < 1024 else f"{mb / 1024:.1f}GiB"


def process_cells(node: NodeState) -> tuple[list[list[Cell]], list[str]]:
    """The compute processes on each GPU (nvitop's list) from the node's latest full sample: by GPU, biggest first.

    Their user, job and command are the node's text: plain cells, never markup.
    """
    rows: list[list[Cell]] = []
    keys: list[str] = []
    sample = node.sample
    if sample is None:
        return rows, keys
    for gpu in sorted(sample.gpus, key=lambda g: g.index):
        for proc in sorted(gpu.processes, key=lambda p: -(p.used_mb or 0.0)):
            rows.append([
                (str(gpu.index), None),
                (str(proc.pid), None),
                (str(proc.user) or "N/A", None if proc.user else _MUTED),
                (str(proc.job) or "-", None if proc.job else _MUTED),
                (format_mib(proc.used_mb), None),
                (str(proc.command) or "N/A", None if proc.command else _MUTED),
            ])
            keys.append(f"{gpu.index}/{proc.pid}")
    return rows, keys


def host_text(node: NodeState) -> Text:
    """Host CPU, memory and NIC lines with sparklines."""
    hist = node.host_history
    host = node.sample.host if node.sample else None
    text = Text()

    def line(label: str, now: str, series: list[float], lo: float | None, hi: float | None, ib: str = "") -> None:
        text.append(f"{label:<8}", style="bold")
        text.append(f"{now:>8} ")
        text.append(sparkline(series, HOST_SPARK, lo, hi), style="cyan")
        if ib:
            text.append(f" (ib {ib})")
        text.append("\n")

    cpu = "N/A" if host is None or host.cpu_percent is None else f"{host.cpu_percent:.0f}%"
    mem = "N/A"
    if host is not None and host.mem_used_mb is not None and host.mem_total_mb:
        mem = f"{100 * host.mem_used_mb / host.mem_total_mb:.0f}%"
    # The fleet's definition: NICs and HCA ports, so RDMA traffic does not read 0 B; the HCAs' share said beside it.
    rx, tx = host_traffic(host) if host is not None else (None, None)
    ib_rx, ib_tx = hca_traffic(host) if host is not None else (None, None)
    line("cpu", cpu, hist.series(HOST_CPU), 0, 100)
    line("memory", mem, hist.series(HOST_MEM), 0, 100)
    line("net rx", format_rate(rx), hist.series(HOST_RX), 0, None, "" if ib_rx is None else format_rate(ib_rx))
    line("net tx", format_rate(tx), hist.series(HOST_TX), 0, None, "" if ib_tx is None else format_rate(ib_tx))
    if host is not None and host.load1 is not None:
        text.append(f"load    {host.load1:.2f} {host.load5 or 0:.2f} {host.load15 or 0:.2f}\n")
    agent = node.sample.agent if node.sample else None
    if agent is not None:
        # The agent's own footprint: it should stay cheap, and this shows whether it does.
        cpu_s = "N/A" if agent.cpu_percent is None else f"{agent.cpu_percent:.1f}%"
        rss = "N/A" if agent.rss_mb is None else f"{agent.rss_mb:.0f} MB"
        tick = "N/A" if agent.tick_ms is None else f"{agent.tick_ms:.1f} ms"
        text.append(f"agent   cpu {cpu_s}  rss {rss}  tick {tick}  clients {agent.clients}")
        if agent.dropped_frames:
            text.append(f"  dropped {agent.dropped_frames}", style="bold red")
    if host is not None and host.ib:
        text.append("\n")
        text.append_text(ib_text(host.ib))
    return text


def ib_text(ports: list[IbPortSample]) -> Text:
    """The InfiniBand table: one line per HCA port (state, rate, traffic, non-zero error counters, growth)."""
    text = Text()
    text.append("InfiniBand\n", style="bold")
    text.append(f"{'PORT':<12}{'STATE':<8}{'RATE':>5} {'LINK':<4} {'RX/TX B/s':<13} ERRORS (+NEW)\n", style="bold")
    for port in ports:
        up = port.state == "ACTIVE"
        rate = "N/A" if port.rate_gbps is None else f"{port.rate_gbps:g}G"
        layer = {"InfiniBand": "IB", "Ethernet": "RoCE"}.get(str(port.link_layer), str(port.link_layer or "N/A"))
        traffic = f"{format_rate(port.rx_bps)}/{format_rate(port.tx_bps)}"
        text.append(f"{str(port.device) + '/' + str(port.port):<12}")
        text.append(f"{str(port.state or 'N/A'):<8}", style=_GOOD if up else _BAD)
        text.append(f"{rate:>5} {layer:<4} {traffic:<13} ")
        errors = [f"{name} {value}" + (f" (+{port.deltas[name]})" if name in port.deltas else "")
                  for name, value in port.errors.items()]
        text.append(", ".join(errors) or "-", style=_BAD if port.deltas else (Style(color="yellow") if errors else None))
        text.append("\n")
    return text


def _check_lines(text: Text, checks: list[CheckVerdict]) -> None:
    for check in checks:
        text.append(f"  {check.name:<9}", style="bold")
        text.append("ok  " if check.ok else "FAIL", style=_GOOD if check.ok else _BAD)
        text.append(f" {check.detail}\n")


def checks_text(node: NodeState, now: float) -> Text:
    """The node's patrol state and its last pre-flight, each failing check with its one-line reason."""
    text = Text()
    text.append("checks\n", style="bold")
    patrol = node.patrol
    text.append("patrol     ", style="bold")
    age = "" if patrol.changed_at is None else f" for {format_age(max(now - patrol.changed_at, 0.0))}"
    if patrol.status is PatrolStatus.FAILING:
        text.append(f"FAILING{age}: {', '.join(c.name for c in patrol.failing)}\n", style=_BAD)
        _check_lines(text, patrol.failing)
    elif patrol.status is PatrolStatus.OK:
        text.append(f"ok{age} (recovered)\n", style=_GOOD)
    else:
        text.append("no failure reported since connected\n", style=_MUTED)
    result = node.preflight
    text.append("preflight  ", style="bold")
    if result is None:
        text.append("not run this session (:preflight, or p in the fleet view)\n", style=_MUTED)
        return text
    ago = f" {format_age(max(now - result.at, 0.0))} ago"
    if result.ok:
        text.append(f"passed{ago}\n", style=_GOOD)
    else:
        failing = result.failing
        what = result.error or f"{len(failing)} of {len(result.checks)} checks failed"
        text.append(f"FAILED{ago}: {what}\n", style=_BAD)
    _check_lines(text, result.checks)
    return text


def history_text(history: TrackRecord, limit: int = 8) -> Text:
    """The node's history: lemon score, mean time between incidents, and its last incidents (kind, GPU, outcome, TTR)."""
    text = Text()
    text.append("history", style="bold")
    lemon = history.lemon
    text.append(f"  lemon {lemon:.1f}", style=_BAD if lemon >= LEMON_AT else (Style(color="yellow") if lemon >= 1 else None))
    text.append(f" (fleet median {history.fleet_median:.1f}, 30 days)")
    mtbi = "N/A" if history.mtbi_s is None else format_duration(history.mtbi_s)
    text.append(f"  {history.total_incidents} incidents, {history.remediations} remediated, "
                f"{history.returns} returned  MTBI {mtbi}\n")
    if history.kept_out:
        text.append(f"KEPT OUT: {history.kept_out} (I forces the return)\n", style=_BAD)
    for line in history.incidents[:limit]:
        where = "the node" if line.gpu is None else f"gpu {line.gpu}"  # never "gpu -": a node-wide incident
        ttr = "N/A" if line.ttr is None else format_duration(line.ttr)
        what = line.kind + (f" {line.code}" if line.code is not None else "")
        text.append(f"{time.strftime('%m-%d %H:%M', time.localtime(line.at))} {what:<14.14} {where:<8} "
                    f"TTR {ttr:<6} {line.outcome}\n")
    return text


def isolate_effect(action: str, scheduler: str) -> str:
    """What isolating (or putting back) really does, for the confirm dialog.

    Isolation is gridwatch's own mark, kept by the agent; the scheduler's drain
    is another thing, made only by a playbook's drain_node step.
    """
    if action == AgentAction.ISOLATE:
        text = (": gridwatch marks it isolated (kept across agent restarts), its trainer is asked to leave the job, "
                "and playbooks send it no more job-wide steps")
        if scheduler != "none":
            text += f". {scheduler.capitalize()} is not told: only a playbook's drain_node step drains it there"
        return text
    text = ": gridwatch clears its isolation mark, so playbooks count it in the job again"
    if scheduler != "none":
        text += f"; a {scheduler.capitalize()} drain that gridwatch made is resumed"
    return text


class NodeScreen(ViewScreen):
    """Opened with enter on a node; streams that node's log lines while open."""

    VIEW_NAME = "node"
    AT_CADENCE = False  # one node, streaming whole samples while it is open
    CHANGING_ACTIONS = frozenset({"isolate", "checkpoint", "force_return", "keep_scene"})
    HISTORY_EVERY = 5.0  # seconds between reads of the node's history from the incident database
    _history_read = float("-inf")  # when it was last read (the store's clock)
    BINDINGS = [
        Binding("i", "isolate", "Isolate/unisolate"),
        Binding("I", "force_return", "Return, forced", show=False),
        Binding("c", "checkpoint", "Checkpoint now"),
        Binding("k", "keep_scene", "Keep the scene"),
        Binding("h", "history", "Live/1h/1d"),
        Binding("tab", "app.focus_next", "Next pane", show=False),
    ]

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # A node read from Prometheus has no agent to take an action: offer only what can work.
        node = self.store.by_name(self.node_name) if action in self.CHANGING_ACTIONS else None
        if node is not None and self.store.hearsay(node):
            return False
        return super().check_action(action, parameters)

    def __init__(self, node_name: str) -> None:
        super().__init__()
        self.node_name = node_name
        self.window = HistoryWindow.LIVE  # what the GPU sparklines show: live samples, or Prometheus's past
        self.spark = SPARK  # the GPU table's sparkline width, fitted to the screen's

    def compose_view(self) -> ComposeResult:
        yield TextTable(gpu_columns(self.spark), id="gpu-table")
        procs = TextTable(PROCESS_COLUMNS, id="gpu-procs")
        procs.display = False  # shown once the node reports a process (its agent reads NVML's list)
        yield procs
        with Horizontal(id="node-lower"):
            # Host, checks and history outgrow the pane on a short terminal: it scrolls (tab to it, then arrows).
            with VerticalScroll(id="host-pane"):
                yield PlainStatic(id="host-panel")
                yield PlainStatic(id="node-checks")
                yield PlainStatic(id="node-history")
            with Vertical(id="node-events-pane"):
                yield PlainStatic(Text("recent events", style="bold"), classes="pane-title")
                yield TextTable(EVENT_COLUMNS, id="node-events")
        yield PlainStatic(Text("live log", style="bold"), classes="pane-title")
        yield TextTable(LOG_COLUMNS, id="node-log")

    def prepare(self) -> None:
        self.runtime.subscribe_logs(self.node_name, True)
        self.query_one("#gpu-table", TextTable).focus()

    def on_unmount(self) -> None:
        self.runtime.subscribe_logs(self.node_name, False)

    def refresh_view(self) -> None:
        node = self.store.by_name(self.node_name)
        if node is None:
            self.set_title(("gridwatch", "bold"), "  node ", (self.node_name, "bold"), ("  unknown node", "red"))
            return
        status = self.store.health(node)
        shade = "green" if status == "ok" else "bold red" if status == "degraded" else "bold yellow"
        parts: list[str | tuple[str, str]] = [("gridwatch", "bold"), "  node ", (node.name, "bold"), "  ",
                                              (str(status), shade),
                                              f"  seen {format_age(self.store.age(node))} ago"]
        if node.isolated:
            parts.append(("  ISOLATED", "bold cyan"))
        if self.store.hearsay(node):
            parts.append(("  read from Prometheus, no agent: it can be watched, not acted on", "bold yellow"))
        if self.store.stack_mismatch(node):
            parts.append(("  STACK DIFFERS", "bold magenta"))
        if node.patrol.status is PatrolStatus.FAILING:
            parts.append(("  PATROL FAILING", "bold red"))
        if node.preflight is not None and not node.preflight.ok:
            parts.append(("  PRE-FLIGHT FAILED", "bold red"))
        if node.hello is not None:
            parts.append(f"  agent {node.hello.agent_version}  stack {str(node.hello.stack.hash)[:12]}")
        if node.role:
            parts.append(f"  role {node.role}")
        if node.gaps:
            parts.append((f"  {node.gaps} frames lost", "bold red"))
        if node.last_gap:
            parts.append(("  " + node.last_gap, "red"))
        if node.foreign_frames:
            parts.append((f"  {node.foreign_frames} frames claiming another node dropped", "bold red"))
        error = node.link_error or node.last_error
        if error:
            parts.append(("  " + error, "red"))
        history = self._history_part(parts)
        self.set_title(*parts)
        table = self.query_one("#gpu-table", TextTable)
        self._fit_gpu_columns(table)
        rows, keys = gpu_cells(node, history, self.spark)
        table.set_rows(rows, keys)
        rows, keys = process_cells(node)
        procs = self.query_one("#gpu-procs", TextTable)
        procs.display = bool(rows)
        if rows:
            procs.styles.height = min(len(rows), PROCESS_ROWS) + 1  # and the header
        procs.set_rows(rows, keys)
        self.query_one("#host-panel", Static).update(host_text(node))
        self.query_one("#node-checks", Static).update(checks_text(node, self.store.clock.now()))
        self._refresh_history()
        events = list(node.events)[::-1]
        self.query_one("#node-events", TextTable).set_rows(
            [[(clock_time(r.event.ts or r.received_at), None),
              (str(r.event.severity), SEVERITY_STYLES.get(str(r.event.severity))),
              (event_text(r.event), None)] for r in events],
            [str(r.seq) for r in events])
        logs = list(node.logs)
        log_table = self.query_one("#node-log", TextTable)
        follow = log_table.cursor >= len(log_table.rows) - 1
        log_table.set_rows([[(clock_time(r.line.line_ts or r.line.ts), None), (str(r.line.source), None),
                             (str(r.line.line), None)] for r in logs], [str(r.seq) for r in logs])
        if follow and logs:
            log_table.cursor = len(logs) - 1

    def _fit_gpu_columns(self, table: TextTable) -> None:
        """Sparklines as wide as the table has room for: every column in view down to about 120 cells."""
        width = table.scrollable_content_region.width or self.size.width
        spark = spark_width(width)
        if spark != self.spark:
            self.spark = spark
            table.set_columns(gpu_columns(spark))

    def on_resize(self) -> None:
        # The table has its new width once laid out: fit its columns then, and redraw their cells.
        self.call_after_refresh(self.tick)

    def _refresh_history(self) -> None:
        """The history pane, read again every HISTORY_EVERY seconds; hidden where no incident is recorded."""
        now = self.store.clock.now()
        if now - self._history_read < self.HISTORY_EVERY:
            return
        self._history_read = now
        pane = self.query_one("#node-history", Static)
        reader = getattr(self.runtime.plan_store, "node_history", None)
        history: TrackRecord | None = reader(self.node_name, now=now) if reader is not None else None
        pane.display = history is not None and history.total_incidents > 0
        if history is not None and pane.display:
            pane.update(history_text(history))

    # ---------------------------------------------------------------- actions

    def action_force_return(self) -> None:
        """Put the node back in service although a history rule keeps it out (audited with what it overrides)."""
        what = Text.assemble("return node ", (self.node_name, "bold"), " to service, overriding the history rules",
                             isolate_effect(AgentAction.UNISOLATE, self.runtime.scheduler))

        def done(result: Confirmed | None) -> None:
            if result is None:
                return

            async def go() -> None:
                sent = await self.runtime.node_action(self.node_name, AgentAction.UNISOLATE, result.reason, force=True)
                self._history_read = float("-inf")
                self.gw.set_note(f"forced return of {self.node_name}: {'ok' if sent.ok else 'failed: ' + sent.message}")

            self.gw.run_worker(go(), group="node-action")

        self.app.push_screen(ConfirmScreen("Confirm forced return", what), done)

    def action_history(self) -> None:
        """Live samples -> the past hour -> the past day (from Prometheus) -> live."""
        prom = self.runtime.prometheus
        if prom is None:
            self.gw.set_note("no Prometheus configured: the node view shows live samples only (--prometheus URL)")
            return
        windows = list(HistoryWindow)
        self.window = windows[(windows.index(self.window) + 1) % len(windows)]
        prom.request_history(self.node_name, self.window)
        self.refresh_view()

    def _history_part(self, parts: list[str | tuple[str, str]]) -> NodeHistory | None:
        """The history the sparklines show (None: live), its panel's state appended to the title."""
        prom = self.runtime.prometheus
        if prom is None or self.window is HistoryWindow.LIVE:
            return None
        status = prom.panels[Panel.HISTORY]
        history = prom.history(self.node_name, self.window)
        line = status.line(self.store.clock.now())
        if history is None and not prom.failing(Panel.HISTORY):
            line = f"history: asking Prometheus for the past {self.window}"
        parts.append((f"  past {self.window}: " + line, "bold red" if prom.failing(Panel.HISTORY) else "cyan"))
        return history

    def action_isolate(self) -> None:
        node = self.store.by_name(self.node_name)
        action = AgentAction.UNISOLATE if node is not None and node.isolated else AgentAction.ISOLATE
        what = Text.assemble(f"{action} node ", (self.node_name, "bold"), isolate_effect(action, self.runtime.scheduler))
        self._confirm_then(action, what)

    def action_checkpoint(self) -> None:
        self._confirm_then(AgentAction.CHECKPOINT_NOW, Text.assemble("ask the trainer on ", (self.node_name, "bold"),
                                                                     " to checkpoint now"))

    def action_keep_scene(self) -> None:
        where = " and copy it to this console" if self.runtime.scenes is not None else ""
        self._confirm_then(AgentAction.CAPTURE_SCENE, Text.assemble(
            "keep the scene of ", (self.node_name, "bold"), " (frames, logs, stacks) on the node", where))

    def _confirm_then(self, action: str, what: Text) -> None:
        def done(result: Confirmed | None) -> None:
            if result is not None:
                self.gw.run_node_action(self.node_name, action, result.reason)

        self.app.push_screen(ConfirmScreen(f"Confirm {action}", what), done)
