"""The console's state store: the newest frames per node and short histories, read by the UI on a timer.

Frames arrive one at a time from the fleet; applying one costs O(size of the
frame). The UI never reacts per frame: it asks this store for rows, cells and
series once per tick. Nothing here imports textual.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection
from typing import TypeVar

from gridwatch.console.fleet.logquery import LogEntry, LogQuery, matches, severity_rank
from gridwatch.console.fleet.metrics import GpuAggregate, Metric, gpus_failing, host_traffic, worst_of
from gridwatch.console.fleet.node import (
    CheckVerdict,
    EventRecord,
    LogRecord,
    NodeState,
    NodeStatus,
    PatrolState,
    PatrolStatus,
    PreflightResult,
    event_text,
    patrol_failures,
)
from gridwatch.console.fleet.preflight import majority_hash
from gridwatch.console.fleet.rows import (
    FILTER_EVERY_S,
    SORT_FIELDS,
    STATUS_ORDER,
    VALUE_ORDER_EVERY_S,
    FleetSummary,
    HeatmapNode,
    JobRow,
    LazyRows,
    NodeRow,
    Order,
    TrainingSummary,
    seen_age,
    sort_value,
    status_key,
    value_key,
)
from gridwatch.playbooks.clock import Clock, ManualClock, SystemClock  # one clock for store and engine
from gridwatch.wire.heard import HeardOrder
from gridwatch.wire.protocol import (
    HEARSAY_VERSION,
    STALE_AFTER_INTERVALS,
    VIEWER_ACTIONS,
    ActionResult,
    Error,
    Event,
    Frame,
    Gap,
    Hello,
    LogLine,
    Sample,
    Summary,
    TrainerStatus,
    clean_text,
)

FLEET_EVENTS = 10_000
FLEET_LOG_LINES = 5_000
LOSS_POINTS = 2_000


_LINK_STATUS = {"down": NodeStatus.DOWN, "refused": NodeStatus.REFUSED}
_LINK_QUIET = frozenset({"down", "refused", "stale"})  # links whose node is not live, whatever its frames
# What the fleet's counts hold for a node: (live, GPUs in its newest reading, its interval, its role).
_Counted = tuple[bool, int, float, str]
_UNCOUNTED: _Counted = (False, 0, 0.0, "")
_K = TypeVar("_K")


def _uncount(counter: Counter[_K], key: _K) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]  # so min() and truthiness see only what is there


# --------------------------------------------------------------------------- store


def job_cell(node: NodeState) -> str:
    """What the fleet table's JOB column shows: the scheduler's job ids on the node, else its trainer's job."""
    if node.jobs:
        return ",".join(str(j.id) for j in node.jobs)
    trainer = node.trainer
    return str(trainer.job) if trainer is not None and trainer.job else ""


class StateStore:
    """The newest state of every node, fed frame by frame, read on the UI's tick."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or SystemClock()
        self.nodes: dict[str, NodeState] = {}
        self.events: deque[EventRecord] = deque(maxlen=FLEET_EVENTS)
        self.logs: deque[LogRecord] = deque(maxlen=FLEET_LOG_LINES)
        self.loss: deque[tuple[int, float]] = deque(maxlen=LOSS_POINTS)
        self.generation = 0  # bumped on every change, so a view can skip an idle tick
        # Bumped on a change that is news rather than a reading: an event, a link's state, a hello, a gap, an
        # error, a relay up or down. A fleet view redrawn at the summaries' cadence redraws at once for it.
        self.news = 0
        self._seq = 0
        self._names: dict[str, str] = {}  # agent-given name -> key, so lookups by name stay O(1)
        self._majority: str | None = None
        self._stack_dirty = True
        self._by_name_order: list[NodeState] | None = None
        # What the views read is kept up to date from the nodes touched since the last read (see _touch),
        # so a tick costs O(rows drawn + nodes changed), not O(fleet).
        self._dirty: dict[str, NodeState] = {}  # for the fleet's counts
        self._dirty_marks: dict[str, NodeState] = {}  # for the status order
        self._touches = 0
        self._framed: HeardOrder[str, NodeState] = HeardOrder()  # nodes by their last frame, oldest first
        self._counted: dict[str, _Counted] = {}
        self._live = 0  # nodes whose link is up and that sent a frame: ok unless their last frame is too old
        self._gpus = 0
        self._hearsay: set[str] = set()  # keys of nodes whose hello came from Prometheus, not an agent
        self._intervals: Counter[float] = Counter()  # of the live nodes
        self._roles: Counter[str] = Counter()
        self._apart: dict[str, tuple[int, bool]] = {}  # status order: the nodes not plainly ok, by (status, marked)
        self._marks_for: tuple[str | None, int] | None = None  # (majority stack, unexplained changes) they were made with
        self._marks_at = float("-inf")
        self._orders: dict[tuple[str, bool, str], Order] = {}
        # The heatmap's nodes in order of first sight: (order by name it was made with, only, nodes, names).
        self._first_sight: tuple[list[NodeState], frozenset[str] | None, list[NodeState], list[str]] | None = None

    # ------------------------------------------------------------------ writing

    def node(self, key: str, name: str | None = None) -> NodeState:
        """The node called ``key``, created on first sight."""
        state = self.nodes.get(key)
        if state is None:
            state = self.nodes[key] = NodeState(key=key, name=name or key)
            self._names[state.name] = key
            self._by_name_order = None
        return state

    def _rename(self, node: NodeState, name: str) -> None:
        if name and name != node.name:
            self._names.pop(node.name, None)
            node.name = name
            self._names[name] = node.key
            self._by_name_order = None

    def _name_order(self) -> list[NodeState]:
        """Every node by name, sorted again only when a node comes or is renamed (not every tick)."""
        if self._by_name_order is None:
            self._by_name_order = sorted(self.nodes.values(), key=lambda n: n.name)
        return self._by_name_order

    def set_link(
        self, key: str, state: str, *, name: str | None = None, error: str | None = None, role: str | None = None,
        foreign_frames: int | None = None,
    ) -> None:
        """Record a link change from the fleet (connecting, connected, stale, down, refused)."""
        node = self.node(key, name)
        self._touch(node)
        if name:
            self._rename(node, name)
        if node.link != str(state):
            self.news += 1
        node.link = str(state)
        # Errors can quote what a peer sent (an SSH banner, a reason): cleaned like any node text.
        node.link_error = clean_text(error, 300) if error else None
        if role is not None:
            node.role = role
        if foreign_frames is not None:
            node.foreign_frames = foreign_frames
        self.generation += 1

    def apply(self, frame: Frame, key: str | None = None) -> None:
        """Take one frame from a node. ``key`` names the connection; it defaults to the frame's node."""
        # A known connection is one lookup: the frame's name is read only for a node seen the first time.
        node = self.nodes.get(key) if key else None
        if node is None:
            node = self.node(key or str(frame.node), str(frame.node) or None)
        self._touch(node)
        now = self.clock.now()
        node.last_frame_at = now
        self._framed.heard(node.key, node, now)
        self.generation += 1
        if isinstance(frame, Summary):  # the common frame at scale: asked first
            # Read as a sample (what it lacks is N/A); its cadence sets when the node counts as stale.
            hello = node.hello
            node.interval = max(hello.interval if hello and hello.interval > 0 else 1.0, frame.every)
            self._apply_sample(node, frame, now)
            return
        if isinstance(frame, Sample):
            if node.hello is not None and node.hello.interval > 0:
                node.interval = node.hello.interval  # back from summaries: one a tick again
            self._apply_sample(node, frame, now)
            return
        if isinstance(frame, LogLine):
            self.add_log(node.name, frame, node)
            return
        self.news += 1  # not a reading nor a log line: something happened
        if isinstance(frame, Event):
            self._apply_event(node, frame, now)
        elif isinstance(frame, Hello):
            self._apply_hello(node, frame)
        elif isinstance(frame, Gap):
            node.gaps += max(frame.to_seq - frame.from_seq + 1, 0)
            # An empty range is a loss of unknown size (an agent restarted): the reason says it.
            node.last_gap = str(frame.reason) if frame.to_seq < frame.from_seq \
                else f"frames {frame.from_seq}-{frame.to_seq} lost: {frame.reason}"
        elif isinstance(frame, Error):
            node.last_error = f"{frame.code}: {frame.message}" if frame.message else str(frame.code)
        elif isinstance(frame, ActionResult) and not frame.ok and frame.action not in VIEWER_ACTIONS:
            # A query that found nothing (RAS not configured, no trainer records) says nothing wrong of the
            # node, and a failed pre-flight is a verdict kept in ``preflight``: neither is the node's error.
            node.last_error = f"{frame.action} failed: {frame.message}"

    def _apply_hello(self, node: NodeState, hello: Hello) -> None:
        node.hello = hello
        if hello.node:
            self._rename(node, str(hello.node))
        node.role = str(hello.role)
        node.interval = hello.interval if hello.interval > 0 else 1.0
        node.isolated = hello.isolated
        self._stack_dirty = True
        # Read from Prometheus, no agent: the footer says how the fleet is read, not "connected".
        if str(hello.agent_version) == HEARSAY_VERSION:
            self._hearsay.add(node.key)
        else:
            self._hearsay.discard(node.key)

    @staticmethod
    def _patrol_from_sample(node: NodeState, failing: list[str] | None, now: float) -> None:
        """Samples say whether the patrol passes, so a healthy node reads ok, not unknown.

        The reasons arrive with the patrol_failed event; a sample only fills in
        what the console has not seen (it connected after the transition).
        """
        if failing is None:
            return
        if not failing and node.patrol.status is not PatrolStatus.OK:
            node.patrol = PatrolState(PatrolStatus.OK, [], now)
        elif failing and node.patrol.status is not PatrolStatus.FAILING:
            node.patrol = PatrolState(PatrolStatus.FAILING, [CheckVerdict(str(n), False, "failing since before the console connected") for n in failing], now)

    def _apply_sample(self, node: NodeState, sample: Sample | Summary, now: float) -> None:
        """A sample, or a summary kept as it came (no sample is made of it unless a view asks)."""
        cpu: float | None
        used: float | None
        total: float | None
        if isinstance(sample, Summary):
            node.summary, node._sample = sample, None
            cpu, used, total, rx, tx = sample.cpu_percent, sample.mem_used_mb, sample.mem_total_mb, sample.rx_bps, sample.tx_bps
        else:
            node.sample = sample
            host = sample.host
            cpu, used, total = host.cpu_percent, host.mem_used_mb, host.mem_total_mb
            rx, tx = host_traffic(host)  # HCA ports too, as a summary's rx/tx count them
        node.agg = None  # summed when a view first reads it: most nodes' rows are never drawn
        node.last_sample_at = now
        node.isolated = sample.isolated
        if sample.patrol_failing is not None:
            self._patrol_from_sample(node, sample.patrol_failing, now)
        mem_pct = 100.0 * used / total if used is not None and total else None
        node.history = node.history.push((cpu, mem_pct, rx, tx), sample.gpus)
        trainer = sample.trainer
        if trainer is not None and trainer.step is not None and trainer.loss is not None:
            if not self.loss or trainer.step > self.loss[-1][0]:
                self.loss.append((trainer.step, trainer.loss))

    def _apply_event(self, node: NodeState, event: Event, now: float) -> None:
        self._seq += 1
        record = EventRecord(self._seq, node.name, now, event)
        node.events.append(record)
        self.events.append(record)
        if event.kind == "xid" and event.gpu is not None:
            node.xids[event.gpu] += 1
            node.agg = None
        if event.kind == "isolated":
            node.isolated = True
        elif event.kind == "unisolated":
            node.isolated = False
        elif event.kind == "patrol_failed":
            node.patrol = PatrolState(PatrolStatus.FAILING, patrol_failures(event), now)
        elif event.kind == "patrol_recovered":
            node.patrol = PatrolState(PatrolStatus.OK, [], now)

    def set_preflight(self, key: str, result: PreflightResult) -> None:
        """Record a node's pre-flight result (by connection key or agent name); kept for the session."""
        node = self.nodes.get(key) or self.by_name(key)
        if node is None:
            return
        self._touch(node)
        node.preflight = result
        self.generation += 1
        self.news += 1

    def add_log(self, name: str, line: LogLine, node: NodeState | None = None) -> None:
        """Append a streamed log line to the node's tail and the fleet's."""
        self._seq += 1
        record = LogRecord(self._seq, name, line)
        target = node or self.by_name(name)
        if target is not None:
            target.logs.append(record)
        self.logs.append(record)
        self.generation += 1

    # ------------------------------------------------------------------ reading

    def by_name(self, name: str) -> NodeState | None:
        """The node whose agent calls itself ``name`` (or whose key is ``name``)."""
        key = self._names.get(name, name)
        return self.nodes.get(key)

    def majority_stack(self) -> str | None:
        """The software stack hash most nodes report (None on a tie, as pre-flight judges); recomputed only after a Hello."""
        if self._stack_dirty:
            top, clear = majority_hash(n.stack_hash for n in self.nodes.values() if n.stack_hash)
            self._majority = top if clear else None
            self._stack_dirty = False
        return self._majority

    def stack_mismatch(self, node: NodeState) -> bool:
        majority = self.majority_stack()
        return bool(majority and node.stack_hash and node.stack_hash != majority)

    def status(self, node: NodeState, now: float | None = None) -> NodeStatus:
        """Down and refused come from the link; stale means no frame within three intervals."""
        status = self._link_status(node)
        last = node.last_frame_at
        if status is not NodeStatus.OK or last is None:
            return status
        now = self.clock.now() if now is None else now
        return NodeStatus.STALE if now - last > STALE_AFTER_INTERVALS * node.interval else NodeStatus.OK

    def hearsay(self, node: NodeState) -> bool:
        """The node is read from Prometheus and no agent speaks for it: nothing can be sent to it."""
        return node.key in self._hearsay

    def health(self, node: NodeState, now: float | None = None, agg: GpuAggregate | None = None) -> NodeStatus:
        """What the views call the node: its link's status, or, live, its worst health (a lost GPU is not ok)."""
        status = self.status(node, now)
        agg = agg if agg is not None else node.agg
        return NodeStatus.DEGRADED if status is NodeStatus.OK and agg is not None and agg.bad else status

    @staticmethod
    def _link_status(node: NodeState) -> NodeStatus:
        """The status the link and the frames seen say, before the clock is asked (OK: live, unless gone quiet)."""
        status = _LINK_STATUS.get(node.link)
        if status is not None:
            return status
        if node.last_frame_at is None:
            return NodeStatus.CONNECTING
        return NodeStatus.STALE if node.link == "stale" else NodeStatus.OK

    # -------------------------------------------- what the views read, kept from the nodes touched

    def _touch(self, node: NodeState) -> None:
        """``node`` is about to change; the views fold it in when they next read.

        O(1) a frame: it only notes the node, so a tick costs O(rows drawn + nodes changed), not O(fleet).
        """
        key = node.key
        self._dirty[key] = node
        self._dirty_marks[key] = node
        self._touches += 1

    def _fold(self) -> None:
        """Count the nodes touched since the last read again (link up, GPUs, cadence, role): O(nodes touched)."""
        dirty = self._dirty
        if not dirty:
            return
        counted, intervals, roles = self._counted, self._intervals, self._roles
        for key, node in dirty.items():
            reading = node.reading
            new = (node.link not in _LINK_QUIET and node.last_frame_at is not None,
                   len(reading.gpus) if reading is not None else 0, node.interval, node.role or "")
            old = counted.get(key, _UNCOUNTED)
            if new == old:
                continue
            counted[key] = new
            self._gpus += new[1] - old[1]
            if old[0]:
                self._live -= 1
                _uncount(intervals, old[2])
            if new[0]:
                self._live += 1
                intervals[new[2]] += 1
            if old[3]:
                _uncount(roles, old[3])
            if new[3]:
                roles[new[3]] += 1
        dirty.clear()

    def _gone_quiet(self, now: float) -> list[NodeState]:
        """Live nodes whose last frame is older than three intervals: O(nodes not heard from lately), oldest first."""
        self._fold()
        if not self._intervals:
            return []
        # Past this age a node may be stale; younger ones (all after the first such in frame order) are not.
        floor = STALE_AFTER_INTERVALS * min(self._intervals)
        return [node for node in self._framed.quiet(now, floor)
                if node.link not in _LINK_QUIET and node.last_frame_at is not None
                and now - node.last_frame_at > STALE_AFTER_INTERVALS * node.interval]

    def role_counts(self) -> dict[str, int]:
        """How many nodes gave this console each role (nodes not heard from yet count in none)."""
        self._fold()
        return dict(self._roles)

    def age(self, node: NodeState, now: float | None = None) -> float | None:
        if node.last_frame_at is None:
            return None
        return max((self.clock.now() if now is None else now) - node.last_frame_at, 0.0)

    def summary(self) -> FleetSummary:
        """The footer's counts: from counters kept per node touched, O(nodes changed + nodes gone quiet)."""
        now = self.clock.now()
        quiet = self._gone_quiet(now)  # counts the nodes touched first
        connected = self._live - len(quiet)
        first = self._framed.oldest()
        oldest = None if first is None else now - first[0]
        total = len(self.nodes)
        hearsay = sum(1 for key in self._hearsay if key in self.nodes)
        return FleetSummary(connected, total, oldest, self._gpus, total - connected, hearsay)

    def node_row(self, node: NodeState, now: float) -> NodeRow:
        agg = node.agg or GpuAggregate(gpus=len(node.hello.gpus) if node.hello else 0)
        status = self.health(node, now, agg)
        return NodeRow(
            name=node.name,
            status=status,
            isolated=node.isolated,
            mismatch=self.stack_mismatch(node),
            gpus=agg.gpus,
            gpu_bad=agg.bad,
            util=agg.util,
            temp_max=agg.temp_max,
            power_w=agg.power_w,
            mem_pct=agg.mem_pct,
            rx_bps=agg.rx_bps,
            tx_bps=agg.tx_bps,
            step_time_s=agg.step_time_s,
            age_s=None if node.last_frame_at is None else max(now - node.last_frame_at, 0.0),
            error=node.link_error or node.last_error,
            patrol_failing=node.patrol.status is PatrolStatus.FAILING,
            preflight_failed=node.preflight is not None and not node.preflight.ok,
            job=job_cell(node),
            every_s=node.interval,
        )

    def jobs(self) -> list[JobRow]:
        """Every scheduler job an agent reports, with the nodes it runs on; worst first, then by job id."""
        now = self.clock.now()
        found: dict[tuple[str, str], JobRow] = {}
        for node in self.nodes.values():
            for job in node.jobs:
                key = (str(job.scheduler), str(job.id))
                row = found.get(key)
                status = self.status(node, now)
                if row is None:
                    row = found[key] = JobRow(scheduler=key[0], id=key[1], user=str(job.user), name=str(job.name),
                                              nodes=str(job.nodes), on=[], worst=status, pids=0)
                row.on.append(node.name)
                row.pids += job.pids
                row.nodes = row.nodes or str(job.nodes)
                if STATUS_ORDER[status] < STATUS_ORDER[row.worst]:
                    row.worst = status
        for row in found.values():
            row.on.sort()
        return sorted(found.values(), key=lambda r: (STATUS_ORDER[r.worst], r.scheduler, len(r.id), r.id))

    def node_rows(self, sort: str = "name", reverse: bool = False, filter_text: str = "") -> LazyRows[NodeRow]:
        """The node table: filtered by a case-insensitive substring of name, status or flags.

        Rows are made when read (a view reads a page), always from the newest state. The order by
        name is kept until a node comes or is renamed, and the order by status is brought up to date
        from the nodes changed since the last read. An order by a value is made again at most every
        VALUE_ORDER_EVERY_S and a filter's matches every FILTER_EVERY_S (at once for a new filter):
        ``as_of`` on the result says when such an order was made.
        """
        now = self.clock.now()
        needle = filter_text.strip().lower()
        if needle:
            order = self._filtered(sort, reverse, needle, now)
        elif sort == "name":
            order = self._by_name(reverse, now)
        elif sort == "status":
            order = self._by_status(reverse, now)
        else:
            order = self._by_value(sort, reverse, now)
        as_of = order.made_at if needle or sort not in ("name", "status") else None
        return LazyRows(order.nodes, lambda n: self.node_row(n, now), order.names, as_of)

    def _cached(self, key: tuple[str, bool, str], base: list[NodeState], now: float, every: float) -> Order | None:
        """The order kept under ``key`` while it may still be shown: the same nodes, and nothing changed or young enough."""
        order = self._orders.get(key)
        if order is None or order.base is not base:
            return None
        return order if order.generation == self.generation or now - order.made_at < every else None

    def _keep(self, key: tuple[str, bool, str], order: Order) -> Order:
        if len(self._orders) >= 16:
            self._orders.clear()  # filters typed a letter at a time: keep only what is in use
        self._orders[key] = order
        return order

    def _by_name(self, reverse: bool, now: float) -> Order:
        base = self._name_order()
        order = self._orders.get(("name", reverse, ""))
        if order is not None and order.base is base:
            return order
        nodes = base[::-1] if reverse else base
        return self._keep(("name", reverse, ""), Order(nodes, [n.name for n in nodes], now, self.generation, base))

    def _by_value(self, sort: str, reverse: bool, now: float) -> Order:
        key = (sort, reverse, "")
        base = self._name_order()
        order = self._cached(key, base, now, VALUE_ORDER_EVERY_S)
        if order is not None:
            return order
        field_name = SORT_FIELDS[sort]

        def value(node: NodeState) -> float | None:
            if sort == "age":
                last = node.last_frame_at
                return None if last is None else seen_age(max(now - last, 0.0), node.interval)
            agg = node.agg
            return None if agg is None else getattr(agg, field_name)

        keyed = [(value_key(value(n), n.name), n) for n in base]
        keyed.sort(key=lambda kn: kn[0], reverse=reverse)
        if reverse:
            keyed.sort(key=lambda kn: kn[0][0])  # keep N/A at the bottom when the order flips
        nodes = [n for _, n in keyed]
        return self._keep(key, Order(nodes, [n.name for n in nodes], now, self.generation, base))

    def _filtered(self, sort: str, reverse: bool, needle: str, now: float) -> Order:
        """The nodes whose name, status or flags hold ``needle``, in the sort asked: O(fleet), once a second at most."""
        key = (sort, reverse, needle)
        base = self._name_order()
        order = self._cached(key, base, now, FILTER_EVERY_S)
        if order is not None:
            return order
        matched = []
        for node in base:
            row = self.node_row(node, now)
            if needle in f"{row.name} {row.status} {row.flags}".lower():
                matched.append((row, node))
        matched.sort(key=lambda rn: sort_value(rn[0], sort), reverse=reverse)
        if reverse:
            matched.sort(key=lambda rn: sort_value(rn[0], sort)[0])  # keep N/A at the bottom when the order flips
        nodes = [n for _, n in matched]
        return self._keep(key, Order(nodes, [n.name for n in nodes], now, self.generation, base))

    def _by_status(self, reverse: bool, now: float) -> Order:
        """Problems first: the few nodes not plainly ok sorted, then the rest by name; O(nodes changed)."""
        base = self._name_order()
        majority = self.majority_stack()
        outside = self.generation - self._touches  # changes made other than by a frame or a link (a pre-flight)
        if self._marks_for is None or self._marks_for[0] != majority or (
                self._marks_for[1] != outside and now - self._marks_at >= FILTER_EVERY_S):
            # Every node again: the majority stack moved (so may any node's stack mark), or something
            # changed that no frame told (checked at most once a second).
            self._dirty_marks = dict(self.nodes)
            self._marks_for, self._marks_at = (majority, outside), now
        apart = self._apart
        self._place(self._dirty_marks, majority)
        self._dirty_marks.clear()
        places = dict(apart)
        stale = STATUS_ORDER[NodeStatus.STALE]
        for node in self._gone_quiet(now):
            places[node.key] = (stale, apart.get(node.key, (stale, False))[1])
        key = ("status", reverse, "")
        order = self._orders.get(key)
        if order is not None and order.base is base and order.places == places:
            return order
        head = sorted((self.nodes[k] for k in places), key=lambda n: status_key(*places[n.key], n.name))
        nodes = head + [n for n in base if n.key not in places]
        if reverse:
            nodes.reverse()
        return self._keep(key, Order(nodes, [n.name for n in nodes], now, self.generation, base, places))

    def _place(self, nodes: dict[str, NodeState], majority: str | None) -> None:
        """Put each of ``nodes`` apart from the plainly ok ones (by its link status and whether it is marked), or not.

        Marked as the row's flags mark it: isolated, stack, failing GPUs, patrol, pre-flight. This runs
        for every node changed since the last read (12,500 a tick when all send a summary a second):
        written as one loop with the checks cheapest first.
        """
        apart, ok, failing, degraded = self._apart, NodeStatus.OK, PatrolStatus.FAILING, NodeStatus.DEGRADED
        link_status = self._link_status
        for key, node in nodes.items():
            preflight = node.preflight
            marked = (node.isolated or node.patrol.status is failing or (preflight is not None and not preflight.ok)
                      or bool(majority and node.hello is not None and node.stack_hash and node.stack_hash != majority))
            status = link_status(node)
            if not marked or status is ok:
                reading = node.reading
                if reading is not None and gpus_failing(reading.gpus, node.xids):
                    marked = True
                    if status is ok:
                        status = degraded  # live with a failing GPU: what :meth:`health` calls it
            if status is ok and not marked:
                apart.pop(key, None)
            else:
                apart[key] = (STATUS_ORDER[status], marked)

    def heatmap(self, metric: Metric, only: Collection[str] | None = None) -> LazyRows[HeatmapNode]:
        """Cells for the heatmap in order of first sight, limited to the names in ``only`` when given.

        Each node's cells are made when first read: only the lines on screen are drawn. The list of
        nodes is kept until a node comes or is renamed (or ``only`` changes).
        """
        now = self.clock.now()
        base = self._name_order()  # made again when a node comes or is renamed
        kept = self._first_sight
        if kept is None or kept[0] is not base or kept[1] != only:
            wanted = None if only is None else frozenset(only)
            nodes = [n for n in self.nodes.values() if wanted is None or n.name in wanted]
            kept = self._first_sight = (base, wanted, nodes, [n.name for n in nodes])
        return LazyRows(kept[2], lambda n: HeatmapNode(n, self.status(n, now), self.stack_mismatch(n), metric), kept[3])

    def worst_node(self, metric: Metric) -> str | None:
        """The name of the node whose worst GPU is hottest on ``metric`` (health: failing first), or None."""
        best: tuple[float, str] | None = None
        for node in self.nodes.values():
            agg = node.agg
            if agg is None:
                continue
            value = worst_of(agg, metric)
            if value is not None and (best is None or value > best[0]):
                best = (value, node.name)
        return best[1] if best else None

    def training(self) -> TrainingSummary | None:
        """The most advanced trainer status across nodes, or None when no trainer is attached."""
        best: tuple[NodeState, TrainerStatus] | None = None
        reporting = 0
        for node in self.nodes.values():
            status = node.trainer
            if status is None:
                continue
            reporting += 1
            if best is None or (status.step or -1) > (best[1].step or -1):
                best = (node, status)
        if best is None:
            return None
        node, status = best
        return TrainingSummary(node.name, status, self.age(node), list(self.loss), reporting)

    def log_entries(self, query: LogQuery, limit: int = 2000) -> list[LogEntry]:
        """Events and streamed log lines matching ``query``, oldest first, newest ``limit`` kept."""
        now = self.clock.now()
        nodes = set(query.nodes) if query.nodes else None
        min_rank = severity_rank(query.min_severity) if query.min_severity else None
        since, until = query.window(now)
        out: list[LogEntry] = []
        for rec in self.events:
            ev = rec.event
            ts = ev.ts or rec.received_at
            entry = LogEntry(ts, rec.node, str(ev.severity), str(ev.source) or "event", event_text(ev), True)
            if matches(entry, nodes, min_rank, since, until, query.pattern):
                out.append(entry)
        # Raw log lines carry no severity: a severity filter keeps events only.
        if min_rank is None:
            for log_rec in self.logs:
                line = log_rec.line
                entry = LogEntry(line.line_ts or line.ts, log_rec.node, "", str(line.source), str(line.line), False)
                if matches(entry, nodes, None, since, until, query.pattern):
                    out.append(entry)
        out.sort(key=lambda e: e.ts)
        return out[-limit:]


__all__ = ["Clock", "ManualClock", "StateStore", "SystemClock"]
