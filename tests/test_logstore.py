"""The console's log store: real SQLite files, written off the event loop, searched with the Logs view's query, pruned."""

from __future__ import annotations

import os
import re
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gridwatch.console.fleet.logquery import parse_log_query
from gridwatch.console.runtime.logfeed import LogFeed, LogStoreCollector, log_feed_of, log_store_of, search_logs
from gridwatch.console.runtime.logstore import Evidence, LogRow, LogStore, LogStoreError, store_path_for
from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
from gridwatch.playbooks.loader import load_builtin
from gridwatch.playbooks.plans import Incident, Plan
from gridwatch.wire.protocol import Event, LogLine, Sample, Text
from tests.conftest import wait_until, wait_until_sync

T0 = 1_790_000_000.0


def _row(node: str, ts: float, line: str, severity: str = "", source: str = "log:/var/log/syslog") -> LogRow:
    return LogRow(node=node, ts=ts, source=source, line=line, severity=severity, kind="event" if severity else "line")


@pytest.fixture
def store(tmp_path: Path):
    s = LogStore(store_path_for(tmp_path / "incidents.db"))
    yield s
    s.close()


def _runtime(tmp_path: Path, **options):
    """A runtime with its log store and no shipped playbook: synthetic frames open no incident."""
    return build_runtime(RuntimeOptions(endpoints=[], key_path="", known_hosts="", db_path=str(tmp_path / "incidents.db"),
                                        skip_playbooks=tuple(pb.name for pb in load_builtin()), **options))


async def test_a_batch_written_off_the_loop_is_queryable_in_a_private_file(store: LogStore, tmp_path: Path) -> None:
    path = tmp_path / "incidents.logs" / "logs.db"
    assert store.path == path
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    store.write([_row("node-1", T0 + i, f"line {i}") for i in range(3)])
    store.add("node-2", T0 + 5, "nvml", "xid gpu1 code=79 GPU has fallen off the bus", "critical", "event")
    await wait_until(lambda: store.counters.written == 4, 10, "both batches written")
    # Written by the writer's own process: SQLite's work never holds the console's interpreter.
    assert store.writer_pid is not None and store.writer_pid != os.getpid()
    rows = store.query()
    assert [(r.node, r.line, r.where) for r in rows] == [("node-1", "line 0", "store"), ("node-1", "line 1", "store"),
                                                         ("node-1", "line 2", "store"),
                                                         ("node-2", "xid gpu1 code=79 GPU has fallen off the bus", "store")]
    assert rows[-1].severity == "critical" and rows[-1].kind == "event"
    for name in [p.name for p in path.parent.iterdir()]:
        assert (path.parent / name).stat().st_mode & 0o077 == 0, name


def test_the_query_language_filters_by_node_set_time_severity_and_pattern(store: LogStore) -> None:
    store.write([
        _row("node-01", T0 + 0, "NCCL WARN Watchdog caught collective operation timeout", "error"),
        _row("node-02", T0 + 10, "GPU has fallen off the bus", "critical"),
        _row("node-03", T0 + 20, "step 800 loss 2.31"),
        _row("node-04", T0 + 30, "watchdog: rank 2 never entered all_reduce #808", "warning"),
        _row("node-02", T0 + 40, "step 801 loss 2.30"),
    ])
    assert store.flush()
    lines = lambda rows: [r.line for r in rows]  # noqa: E731
    assert lines(store.query(nodes="node-[01-02]")) == ["NCCL WARN Watchdog caught collective operation timeout",
                                                         "GPU has fallen off the bus", "step 801 loss 2.30"]
    assert lines(store.query(nodes=["node-03"])) == ["step 800 loss 2.31"]
    assert lines(store.query(since=T0 + 10, until=T0 + 20)) == ["GPU has fallen off the bus", "step 800 loss 2.31"]
    # Raw lines carry no severity: a severity keeps events only, as the Logs view does.
    assert lines(store.query(severity="error")) == ["NCCL WARN Watchdog caught collective operation timeout",
                                                    "GPU has fallen off the bus"]
    assert len(store.query(severity="info")) == 3
    # A plain string: the index, case-insensitive, any substring (not only whole words).
    assert lines(store.query(pattern="watchdog")) == ["NCCL WARN Watchdog caught collective operation timeout",
                                                      "watchdog: rank 2 never entered all_reduce #808"]
    assert lines(store.query(pattern="ff the b")) == ["GPU has fallen off the bus"]
    assert lines(store.query(pattern="syslog")) == lines(store.query())  # the source is searched too
    # A regular expression: run over what the other filters leave.
    assert lines(store.query(pattern=r"step \d+ loss 2\.3[01]", nodes="node-02")) == ["step 801 loss 2.30"]
    assert lines(store.query(pattern="#8")) == ["watchdog: rank 2 never entered all_reduce #808"]  # under 3 chars
    assert lines(store.query(limit=2)) == ["watchdog: rank 2 never entered all_reduce #808", "step 801 loss 2.30"]
    # The Logs view's one-line query, whole.
    assert lines(store.query_text("node:node-[01-04] sev:warning watch", now=T0 + 60)) == [
        "NCCL WARN Watchdog caught collective operation timeout", "watchdog: rank 2 never entered all_reduce #808"]
    assert lines(store.query_text("since:35s loss", now=T0 + 60)) == ["step 801 loss 2.30"]
    assert lines(store.query_text("since:35s until:25s", now=T0 + 60)) == ["watchdog: rank 2 never entered all_reduce #808"]
    for bad in (dict(severity="fatal"), dict(nodes="node-[1-"), dict(since=T0 + 5, until=T0)):
        with pytest.raises(LogStoreError) as info:
            store.query(**bad)  # type: ignore[arg-type]
        assert "\n" not in str(info.value)


HOSTILE_LINES = ['he said "stop" here', "near NEAR(a b) and a AND b OR c", "x'; DROP TABLE lines; -- y",
                 'col line:x {1} * ^start$']


@pytest.mark.parametrize(("pattern", "found"), [
    ('"', [0]),  # one character: the regular expression
    ('"stop"', [0]),  # a phrase with quotes: doubled, never FTS syntax
    ('said "', [0]),
    ('foo" OR "bar', []),
    ("AND b OR", [1]),  # FTS operators, as text
    ("NEAR", [1]),
    (r"NEAR\(a", [1]),
    ("'; DROP TABLE lines; --", [2]),
    ("line:x", [3]),  # an FTS column filter, as text
    (r"\{1\} \*", [3]),
    ("^col", [3]),
])
def test_hostile_patterns_are_text_to_the_index(store: LogStore, pattern: str, found: list[int]) -> None:
    store.write([_row("node-1", T0 + i, line) for i, line in enumerate(HOSTILE_LINES)])
    assert store.flush()
    assert [r.line for r in store.query(pattern=pattern)] == [HOSTILE_LINES[i] for i in found]
    assert store.count() == len(HOSTILE_LINES)  # the table is still there


@pytest.mark.parametrize("pattern", ["NEAR(", "*", "a**", "(?P<", "[z-a]"])
def test_a_bad_pattern_is_one_line_not_a_crash(store: LogStore, pattern: str) -> None:
    store.write([_row("node-1", T0, "anything")])
    assert store.flush()
    with pytest.raises(LogStoreError, match="^bad regular expression: ") as info:
        store.query(pattern=pattern)
    assert "\n" not in str(info.value)


def test_retention_prunes_the_oldest_by_age_but_keeps_an_open_incidents_window(tmp_path: Path) -> None:
    store = LogStore(tmp_path / "l.logs" / "logs.db", retention_s=3600.0)
    try:
        store.write([_row(f"node-{i % 3}", T0 + 60 * i, f"minute {i}") for i in range(120)])  # two hours of three nodes
        assert store.flush()
        keep = [Evidence("node-1", T0 + 60 * 9, T0 + 60 * 21)]  # node-1's lines of minutes 10, 13, 16, 19
        store.prune(keep, now=T0 + 60 * 120)
        assert store.flush()
        left = store.query(limit=1000)
        assert min(r.ts for r in left if r.line not in {"minute 10", "minute 13", "minute 16", "minute 19"}) == T0 + 3600
        assert {"minute 10", "minute 13", "minute 16", "minute 19"} <= {r.line for r in left}
        assert store.counters.pruned_age == 60 - 4 and store.counters.pruned_size == 0
        assert store.count() == 120 - 56
        # Pruned from the index too: the text finds nothing that is gone.
        assert store.query(pattern="minute 1") == [r for r in left if r.line.startswith("minute 1")]
    finally:
        store.close()


def test_size_pruning_removes_the_oldest_until_the_store_fits_and_keeps_the_window(tmp_path: Path) -> None:
    store = LogStore(tmp_path / "l.logs" / "logs.db")
    try:
        store.write([_row(f"node-{i % 4}", T0 + i, f"line {i:05d} " + "x" * 80) for i in range(20_000)])
        assert store.flush(30)
        full = store.bytes
        store.max_bytes = full // 2
        store.prune([Evidence("node-0", T0, T0 + 100)], now=T0 + 20_000)
        assert store.flush(60)
        assert store.bytes <= full // 2 and store.counters.pruned_size > 5000 and store.counters.pruned_age == 0
        left = store.query(limit=100_000)
        kept = [r for r in left if r.ts <= T0 + 100]
        assert [r.ts for r in kept] == [T0 + i for i in range(0, 101, 4)]  # node-0's window, whole
        rest = [r.ts for r in left if r.ts > T0 + 100]
        assert rest == [T0 + i for i in range(int(rest[0] - T0), 20_000)]  # what is left is the newest, unbroken
        # The file gives the freed pages back (incremental vacuum).
        assert store.path.stat().st_size <= full // 2 + 64 * 1024
    finally:
        store.close()


def test_whole_days_go_at_once_and_an_open_incidents_lines_outlive_their_day(tmp_path: Path) -> None:
    day0 = 1_789_948_800.0  # a UTC midnight
    store = LogStore(tmp_path / "l.logs" / "logs.db", retention_s=3 * 86400.0)
    try:
        store.write([_row(f"node-{h % 2}", day0 + 3600 * h, f"hour {h}") for h in range(5 * 24)])  # five days
        assert store.flush()
        window = Evidence("node-1", day0 + 3600 * 4, day0 + 3600 * 6)  # hours 5 (node-1) of day one
        store.prune([window], now=day0 + 5 * 86400)
        assert store.flush()
        left = store.query(limit=1000)
        assert [r.line for r in left][:2] == ["hour 5", "hour 48"]  # days one and two gone, but for the window
        assert store.counters.pruned_age == 48 - 1
        with sqlite3.connect(store.path) as conn:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name GLOB 'lines_*'")}
        assert tables == {"lines_kept", "lines_p20260923", "lines_p20260924", "lines_p20260925"}
        assert [r.line for r in store.query(pattern="hour 5", nodes="node-1")] == ["hour 5", "hour 51", "hour 53", "hour 55",
                                                                                  "hour 57", "hour 59"]
        # By size: the oldest day first; the window stays while its incident is open, then goes with its age.
        store.max_bytes = store.bytes * 4 // 5  # one day of three is enough
        store.prune([window], now=day0 + 5 * 86400)
        assert store.flush()
        assert [r.line for r in store.query(limit=1000)][:2] == ["hour 5", "hour 72"] and store.counters.pruned_size == 24
        store.prune([], now=day0 + 5 * 86400)
        assert store.flush()
        assert store.query(pattern="^hour 5$") == [] and store.counters.pruned_age == 48
    finally:
        store.close()


def test_a_full_queue_drops_the_oldest_batch_and_counts_it_without_blocking(tmp_path: Path) -> None:
    store = LogStore(tmp_path / "l.logs" / "logs.db", queue_batches=2)
    blocker = sqlite3.connect(store.path, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")  # the disk is "slow": the writer waits for this lock
        store.write([_row("node-1", T0, "batch 1")])
        wait_until_sync(lambda: store.queued == 0 and store._done == 0, 10, "the writer to take batch 1")
        started = time.monotonic()
        for n in range(2, 6):
            store.write([_row("node-1", T0 + n, f"batch {n}"), _row("node-1", T0 + n + 0.5, f"batch {n} b")])
        assert time.monotonic() - started < 1.0  # never waits for the writer
        assert store.queued == 2 and store.counters.dropped_batches == 2 and store.counters.dropped == 4
        blocker.execute("ROLLBACK")
        assert store.flush(20)
        assert [r.line for r in store.query()] == ["batch 1", "batch 4", "batch 4 b", "batch 5", "batch 5 b"]
        assert store.counters.written == 5
    finally:
        blocker.close()
        store.close()


def test_a_read_only_store_reads_and_refuses_what_is_not_one(tmp_path: Path) -> None:
    path = store_path_for(tmp_path / "incidents.db")
    with pytest.raises(LogStoreError, match="^no log store at "):
        LogStore(path, read_only=True)
    writer = LogStore(path)
    writer.write([_row("node-1", T0, "kept")])
    writer.close()
    reader = LogStore(path, read_only=True)
    assert [r.line for r in reader.query()] == ["kept"]
    with pytest.raises(LogStoreError):
        reader.prune()
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(LogStoreError, match="^cannot read the log store .*no such table: lines_kept$"):
        LogStore(other, read_only=True)


# --------------------------------------------------------------------------- the runtime feeding it


def _link(name: str) -> SimpleNamespace:
    return SimpleNamespace(endpoint=f"127.0.0.1:{len(name)}", name=name)


async def test_the_runtime_keeps_events_and_streamed_lines_and_counts_them(tmp_path: Path) -> None:
    runtime = _runtime(tmp_path)
    store = log_store_of(runtime)
    assert store is not None and store.path == tmp_path / "incidents.logs" / "logs.db"
    assert store.retention_s == 14 * 86400 and store.max_bytes == 20 * 10**9  # cluster.toml's defaults
    link = _link("node-7")
    runtime.on_frame(link, Event(node=Text("node-7"), ts=T0, kind=Text("xid"), severity=Text("critical"), gpu=1, code=79,
                                 message=Text("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."),
                                 source=Text("log:/var/log/kern.log")))
    runtime.on_frame(link, LogLine(node=Text("node-7"), ts=T0 + 2, source=Text("log:/var/log/train.log"),
                                   line=Text("[rank3]: step 12 loss 2.2"), line_ts=T0 + 1))
    runtime.on_frame(link, Sample(node=Text("node-7"), ts=T0 + 3))
    await wait_until(lambda: store.counters.written == 2, 10, "the two lines written")
    rows = store.query()
    assert [(r.node, r.ts, r.kind, r.severity, r.line) for r in rows] == [
        ("node-7", T0, "event", "critical", "xid gpu1 code=79 NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."),
        ("node-7", T0 + 1, "line", "", "[rank3]: step 12 loss 2.2")]
    registry = CollectorRegistry()
    registry.register(LogStoreCollector(store))
    text = generate_latest(registry).decode()
    assert "gridwatch_console_log_lines_written_total 2.0" in text
    assert 'gridwatch_console_log_lines_pruned_total{reason="size"} 0.0' in text
    assert "gridwatch_console_log_lines_dropped_total 0.0" in text
    # With several consoles only the leader keeps the logs.
    runtime.election = SimpleNamespace(leading=False)  # type: ignore[assignment]
    runtime.on_frame(link, LogLine(node=Text("node-7"), ts=T0 + 4, source=Text("x"), line=Text("observer's")))
    assert store.flush() and store.counters.written == 2
    runtime.election = None
    runtime.fleet = None  # no agent to reach: the runtime starts and stops with its store
    await runtime.start()
    await runtime.stop()
    assert store._thread is not None and not store._thread.is_alive()  # closed with the runtime
    runtime.plan_store.close()


def test_no_database_no_store_and_a_store_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    assert log_store_of(build_runtime(RuntimeOptions(endpoints=[], key_path="", known_hosts=""))) is None
    (tmp_path / "incidents.logs").write_text("a file where the folder goes")
    with pytest.raises(ValueError, match="^cannot make the log store ") as info:
        _runtime(tmp_path)
    assert "\n" not in str(info.value)


class _Fleet:
    """Answers searches as agents would: the lines of a node in the range asked."""

    def __init__(self, lines: list[LogLine]) -> None:
        self.lines = lines
        self.asked: list[tuple[str, list[str] | None, float | None, float | None]] = []

    async def search(self, pattern, nodes=None, since=None, until=None, limit=500, on_progress=None):  # noqa: ANN001, ANN201
        self.asked.append((pattern, nodes, since, until))
        return [ln for ln in self.lines if (nodes is None or str(ln.node) in nodes)
                and (since is None or ln.line_ts >= since) and (until is None or ln.line_ts <= until)]

    async def stop(self) -> None:
        pass

    async def start(self) -> None:
        pass


def _line(node: str, ts: float, text: str) -> LogLine:
    return LogLine(node=Text(node), ts=ts, source=Text("log:/var/log/train.log"), line=Text(text), line_ts=ts)


async def test_an_incident_opening_asks_its_nodes_for_the_window_around_it(tmp_path: Path) -> None:
    runtime = _runtime(tmp_path)
    feed = log_feed_of(runtime)
    assert feed is not None
    fleet = _Fleet([_line("node-2", T0 - 400, "too early"), _line("node-2", T0 - 200, "before"),
                    _line("node-3", T0 - 10, "blamed rank"), _line("node-2", T0 + 200, "after"),
                    _line("node-9", T0, "another node")])
    runtime.fleet = fleet  # type: ignore[assignment]
    feed.after_s = 0.0  # the "5 minutes after" ask comes at once here
    feed.before_s = 300.0
    incident = Incident(id="xid-hardware:node-2:1", playbook="xid-hardware", kind="xid", severity="critical",
                        scope="node", node="node-2", blamed=["node-3"], opened_at=T0, last_seen_at=T0)
    feed.on_plan(Plan(incident=incident, steps=[]))
    feed.on_plan(Plan(incident=incident, steps=[]))  # a plan made again asks nothing more
    await wait_until(lambda: len(fleet.asked) == 2, 10, "the two asks")
    assert fleet.asked == [(".", ["node-2", "node-3"], T0 - 300, T0), (".", ["node-2", "node-3"], T0, T0)]
    store = feed.store
    await wait_until(lambda: store.flush(0.1) and len(store.query()) == 2, 10, "the window written")
    fleet.lines.append(_line("node-2", T0 + 100, "after"))
    feed.after_s = 300.0
    await feed._ask(["node-2"], T0 - 300, T0 + 300)  # asked again: the lines already kept are kept once
    assert store.flush()
    assert [(r.node, r.line) for r in store.query()] == [("node-2", "before"), ("node-3", "blamed rank"),
                                                         ("node-2", "after"), ("node-2", "after")]
    await runtime.stop()
    runtime.plan_store.close()


async def test_pruning_keeps_what_the_incident_store_says_is_open(tmp_path: Path) -> None:
    runtime = _runtime(tmp_path)
    feed = log_feed_of(runtime)
    assert isinstance(feed, LogFeed)
    store = feed.store
    store.retention_s = 600.0
    now = float(int(time.time()))  # whole seconds: the window's ends are exact
    store.write([_row("node-2", now - 3000 + i, f"old {i}") for i in range(0, 1000, 100)])
    incident = Incident(id="xid-hardware:node-2:1", playbook="xid-hardware", kind="xid", severity="critical",
                        scope="node", node="node-2", opened_at=now - 2500, last_seen_at=now - 2500)
    runtime.plan_store.save_plan(Plan(incident=incident, steps=[]))
    assert [(e.node, e.since, e.until) for e in feed.evidence()] == [("node-2", now - 2800, now - 2200)]
    feed.prune_now()
    assert store.flush()
    assert [r.line for r in store.query()] == [f"old {i}" for i in range(200, 801, 100)]
    runtime.resolve(incident.id, "fixed", who="alice")
    assert feed.evidence() == []
    feed.prune_now()
    assert store.flush() and store.query() == [] and store.counters.pruned_age == 10
    await runtime.stop()
    runtime.plan_store.close()


async def test_a_search_asks_the_store_then_the_agents_and_marks_each_line(tmp_path: Path) -> None:
    runtime = _runtime(tmp_path)
    store = log_store_of(runtime)
    assert store is not None
    store.write([_row("node-1", T0, "NCCL timeout kept"), _row("node-1", T0 + 5, "NCCL timeout seen by both")])
    assert store.flush()
    runtime.fleet = _Fleet([_line("node-1", T0 + 5, "NCCL timeout seen by both"),  # type: ignore[assignment]
                            _line("node-1", T0 + 9, "NCCL timeout live only")])
    rows = await search_logs(runtime, parse_log_query("node:node-1 nccl", now=T0 + 60), now=T0 + 60)
    assert [(r.line, r.where) for r in rows] == [("NCCL timeout kept", "store"), ("NCCL timeout seen by both", "store"),
                                                 ("NCCL timeout live only", "agent")]
    # A severity keeps events only: raw lines from the agents carry none, so they are not asked.
    rows = await search_logs(runtime, parse_log_query("sev:error nccl", now=T0 + 60), now=T0 + 60)
    assert rows == [] and len(runtime.fleet.asked) == 1  # type: ignore[union-attr]
    await runtime.stop()
    runtime.plan_store.close()


def test_a_plain_string_is_found_whole_not_as_scattered_trigrams(store: LogStore) -> None:
    lines = ["abc xyz", "xyz abc", "GPU Größe ÜBER", "SeqNum=4242, done", "SeqNum=42, 4242 done"]
    store.write([_row("node-1", T0 + i, line) for i, line in enumerate(lines)])
    assert store.flush()
    assert [r.line for r in store.query(pattern="bc x")] == ["abc xyz"]  # its trigrams are in both lines
    assert [r.line for r in store.query(pattern="SeqNum=4242,")] == ["SeqNum=4242, done"]
    assert [r.line for r in store.query(pattern="größe über")] == ["GPU Größe ÜBER"]  # case-insensitive beyond ASCII
    long = "SeqNum=4242, done" * 3
    store.write([_row("node-1", T0 + 9, long)])
    assert store.flush() and [r.line for r in store.query(pattern=long)] == [long]  # more trigrams than asked


def _v1_partition(conn: sqlite3.Connection, part: str) -> None:
    """A partition as version 1 made it: the trigram index with positions and row sizes."""
    t, f = f"lines_{part}", f"fts_{part}"
    conn.executescript(f"""
        CREATE TABLE {t} (id INTEGER PRIMARY KEY, node TEXT NOT NULL, ts REAL NOT NULL, source TEXT NOT NULL,
                          severity TEXT NOT NULL, sev INTEGER, kind TEXT NOT NULL, line TEXT NOT NULL);
        CREATE INDEX {t}_ts ON {t}(ts);
        CREATE INDEX {t}_node ON {t}(node, ts);
        CREATE VIRTUAL TABLE {f} USING fts5(line, source, content='{t}', content_rowid='id', tokenize='trigram');
        CREATE TRIGGER {t}_ai AFTER INSERT ON {t} BEGIN
            INSERT INTO {f}(rowid, line, source) VALUES (new.id, new.line, new.source); END;
        CREATE TRIGGER {t}_ad AFTER DELETE ON {t} BEGIN
            INSERT INTO {f}({f}, rowid, line, source) VALUES ('delete', old.id, old.line, old.source); END;
    """)


def test_a_version_1_store_opens_as_it_is_and_a_newer_one_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "l.logs" / "logs.db"
    path.parent.mkdir(mode=0o700)
    old = sqlite3.connect(path, isolation_level=None)
    old.execute("PRAGMA journal_mode=WAL")
    day = "p20260921"  # T0's UTC day
    for part in ("kept", day):
        _v1_partition(old, part)
    old.execute(f"INSERT INTO lines_{day}(node, ts, source, severity, sev, kind, line) "
                "VALUES ('node-1', ?, 'log:/var/log/kern.log', '', NULL, 'line', 'old Xid 79 line')", (T0,))
    old.execute("PRAGMA user_version=1")
    old.close()
    store = LogStore(path, retention_s=86400.0)
    try:
        store.write([_row("node-1", T0 + 86400, "new Xid 79 line")])  # the next day: a new partition, no positions
        store.write([_row("node-1", T0 + 1, "later Xid 79 line")])  # the old day, its row trigger gone: indexed once
        assert store.flush()
        assert [r.line for r in store.query(pattern="xid 79")] == ["old Xid 79 line", "later Xid 79 line",
                                                                   "new Xid 79 line"]
        with sqlite3.connect(path) as conn:
            assert not conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger' AND name GLOB '*_ai'"
                                    ).fetchall()
            assert conn.execute(f"SELECT count(*) FROM fts_{day}_docsize").fetchone()[0] == 2
        assert [r.line for r in store.query(pattern="kern.log")] == ["old Xid 79 line"]
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
            ddl = dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE name GLOB 'fts_p*' AND type = 'table'"))
        assert "detail=none" not in ddl[f"fts_{day}"] and "detail=none" in ddl["fts_p20260922"]
        store.prune([], now=1_790_040_000.0 + 86400)  # the old day goes whole, as any day does
        assert store.flush() and [r.line for r in store.query()] == ["new Xid 79 line"]
        assert store.counters.pruned_age == 2 and store.count() == 1
    finally:
        store.close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version=4")
    with pytest.raises(LogStoreError, match="is a log store of another version \\(4\\); move it aside$") as info:
        LogStore(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("pattern", "narrowed"), [
    (r"rank\d+\]: step 1", True), (r"Xid .*: 79,", True), ("(?x) x i d", True), (r"cable|fallen", False),
    (r"ab?c", False), (r"[xX]id", False), ("a.c", False),
])
def test_a_regex_is_narrowed_by_the_literal_text_every_match_holds(store: LogStore, pattern: str, narrowed: bool) -> None:
    from gridwatch.console.runtime.logpattern import pattern_clause

    lines = ["[rank3]: step 12 loss", "[rank4]: step 2 loss", "NVRM: Xid (PCI:0000:3b:00): 79, pid=1", "xid 79",
             "cable unplugged", "GPU has fallen", "ac abc aXc", "XID: 13"]
    store.write([_row("node-1", T0 + i, line) for i, line in enumerate(lines)])
    assert store.flush()
    assert ("MATCH" in pattern_clause(pattern)[0]) is narrowed
    regex = re.compile(pattern, re.IGNORECASE)
    assert [r.line for r in store.query(pattern=pattern)] == [ln for ln in lines if regex.search(ln)]
    # Within a window the rows are read in time order instead (the index answers for whole days): the same lines.
    assert "MATCH" not in pattern_clause(pattern, narrow_regex=False)[0]
    assert [r.line for r in store.query(pattern=pattern, since=T0 + 1, until=T0 + 6)] == [
        ln for i, ln in enumerate(lines) if 1 <= i <= 6 and regex.search(ln)]


def test_a_batch_keeps_every_line_byte_for_byte_and_a_time_that_is_no_number_is_kept_as_a_number(store: LogStore) -> None:
    # A node's NaN clock made the whole batch fail (SQLite stores NaN as NULL, and ts is NOT NULL): every line lost.
    lines = ['say "hi" \\ back\\slash', "GPU Größe ÜBER ✓", "tab\there", "{'loss': 1.5, 'epoch': 0.01}", "[1, 2]", "null"]
    store.write([_row("node-1", T0 + i + 0.123456789, line) for i, line in enumerate(lines)]
                + [_row("node-2", float("nan"), "a NaN clock"), _row("node-2", float("inf"), "an infinite clock")])
    assert store.flush()
    got = sorted(store.query(nodes="node-1"), key=lambda r: r.ts)
    assert [r.line for r in got] == lines
    assert [r.ts for r in got] == [T0 + i + 0.123456789 for i in range(len(lines))]  # the same double back
    odd = {r.line: r.ts for r in store.query(nodes="node-2")}
    assert odd["a NaN clock"] == 0.0  # the epoch's day
    assert time.time() < odd["an infinite clock"] <= time.time() + 86400  # no later than tomorrow, as any line
    assert store.counters.written == len(lines) + 2 and store.counters.failed == 0


def test_a_killed_writer_process_is_started_again_and_its_batch_written_once(tmp_path: Path) -> None:
    store = LogStore(tmp_path / "l.logs" / "logs.db")
    try:
        store.write([_row("node-1", T0, "before")])
        assert store.flush() and store.counters.written == 1
        first = store.writer_pid
        assert first is not None
        os.kill(first, 9)  # the OOM killer, or an operator's kill -9
        store.write([_row("node-1", T0 + 1, "after")])
        assert store.flush(20)
        # The batch sent to the dead process goes to a new one: stored once, nothing failed.
        assert store.writer_pid not in (None, first)
        assert [r.line for r in store.query()] == ["before", "after"] and store.counters.failed == 0
        assert store.counters.written == 2
    finally:
        store.close()
    assert store.writer_pid is None or not _alive(store.writer_pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
