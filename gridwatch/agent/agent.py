"""The node agent's core: sample every tick, number frames, fan them out to clients.

Transport-free: :mod:`gridwatch.sshlink.server` connects it to SSH sessions, tests may
drive it directly. Sampling never waits on a client: frames go into the ring,
and each client's writer reads from the ring at its own pace.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import psutil
from loguru import logger

from gridwatch.agent.actions import HANDLERS
from gridwatch.agent.config import AgentConfig
from gridwatch.agent.jobs import jobs_on_node
from gridwatch.agent.logs import PROGRESS_FRESH_S, LogEntry
from gridwatch.agent.logsearch import SearchRefused, SearchTimeout, search_entries
from gridwatch.agent.ringbuffer import FrameRing
from gridwatch.agent.sources import GuardedSource, Outcome
from gridwatch.agent.sources.ib.source import IbReading, IbSource
from gridwatch.agent.sources.logs import LogsSource
from gridwatch.agent.watch import Watcher, watch_text
from gridwatch.sshlink.ratelimit import KeyedBuckets, LogLimiter
from gridwatch.sshlink.server import Caller
from gridwatch.wire import protocol as p
from gridwatch.wire.protocol import AGENT_VERSION

if TYPE_CHECKING:  # for the annotations only: the runner builds these and hands them in
    from gridwatch.agent.logs import LogTailer
    from gridwatch.agent.metrics import MetricsExporter
    from gridwatch.agent.patrol import Patrol
    from gridwatch.agent.sources import GpuSource
    from gridwatch.agent.sources.host import HostSource
    from gridwatch.agent.trainer_link import TrainerLink

# A client's private replies (action results, log lines) waiting to be sent. A
# console that lets more pile up is not reading: its session is closed with a
# reason (and the replies it missed are counted) rather than losing one silently
# or growing the agent's memory.
MAX_REPLIES = 2000
# ... and in bytes: a few replies can be large (a search answer is up to a frame, 1 MB).
MAX_REPLY_BYTES = 8 * p.MAX_FRAME_BYTES
# Actions and searches one session may have running at once.
MAX_PENDING = 16
# NVML and the kernel log report one XID each; within this many seconds on one GPU they are one event.
XID_FOLD_S = 10.0
# An isolated node's trainer found in the job again is told to leave at most this often.
KEEP_OUT_S = 5.0
# The phases of a trainer that is a member of the job (or about to be): an isolated node's must leave.
IN_THE_JOB: frozenset[str] = frozenset({p.TrainerPhase.STARTING, p.TrainerPhase.TRAINING, p.TrainerPhase.PAUSED,
                                        p.TrainerPhase.CHECKPOINTING, p.TrainerPhase.RESTARTING,
                                        p.TrainerPhase.REFORMING, p.TrainerPhase.JOINING})
# Search workers running at once on a node, whoever asked.
MAX_SEARCHES = 2
# Frames written per wake-up, so one client catching up does not starve others.
WRITE_BATCH = 256


@dataclass(eq=False)  # identity, not value: clients live in a set
class ClientStream:
    """One connected console: a cursor into the ring plus its private replies."""

    caller: Caller
    cursor: int = 0
    subscribed: bool = False
    logs: bool = False
    mode: p.StreamMode = p.StreamMode.FULL
    every: float = 0.0  # summary mode: seconds between summaries (0: every sample)
    last_sent: int = 0  # seq of the last stream frame written to it
    sent: int = 0  # stream frames written (summaries, samples, events, gaps)
    folded: int = 0  # samples folded into a later summary on purpose (``every``)
    since_summary: float | None = None  # agent time of the last summary written
    members_sent: list[p.Text] | None = None  # the trainer membership its last summary carried
    replies: deque[bytes] = field(default_factory=deque)
    dropped: int = 0
    queued_bytes: int = 0  # the size of ``replies``
    pending: int = 0  # actions and searches admitted and not yet answered
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    # Called once when the replies overflow; the agent closes the session with a reason there.
    on_overflow: Callable[[ClientStream], None] | None = None

    def reply(self, data: bytes) -> bool:
        """Queue a private reply; False (and counted) when the session is closed or overflowing."""
        if self.closed:
            self.dropped += 1
            return False
        if len(self.replies) >= MAX_REPLIES or self.queued_bytes + len(data) > MAX_REPLY_BYTES:
            self.dropped += 1
            if self.on_overflow is not None:
                overflow, self.on_overflow = self.on_overflow, None
                overflow(self)
            return False
        self.replies.append(data)
        self.queued_bytes += len(data)
        self.wake.set()
        return True

    def next_reply(self) -> bytes:
        """The oldest queued reply, taken off the queue."""
        data = self.replies.popleft()
        self.queued_bytes -= len(data)
        return data


ActionHandler = Callable[["Agent", Caller, p.Action], Awaitable[p.ActionResult]]


class Agent:
    """Everything one node reports, and the actions it takes."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        gpus: GpuSource | None = None,
        host: HostSource | None = None,
        tailer: LogTailer | None = None,
        metrics: MetricsExporter | None = None,
        trainer: TrainerLink | None = None,
        infiniband: IbSource | None = None,
        stack: p.StackFingerprint | None = None,
        notes: list[str] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.node = p.Text(p.clean_text(config.node_name, 200))
        self.gpus = gpus
        self.host = host
        self.tailer = tailer
        self.metrics = metrics
        self.trainer = trainer
        self._asked_out_at = float("-inf")  # when an isolated node's trainer was last told to leave again
        self._xids_told: dict[tuple[int | None, int], tuple[float, str]] = {}  # (gpu, code) -> (when, source)
        self.folded_xids = 0  # XIDs a second source reported within XID_FOLD_S of the first
        self._background: set[asyncio.Task[Any]] = set()
        self._trainer_seen_at = float("-inf")  # monotonic: when gridwatch's trainer last answered its socket
        self.jobs: list[p.SchedulerJob] = []  # the scheduler's jobs on this node, read every config.jobs_every
        self.infiniband = infiniband  # HCA ports (real or simulated); None on a node without any
        self.patrol: Patrol | None = None  # set by the runner when patrol_interval is on
        self.stack = stack or p.StackFingerprint()
        self.notes = [p.Text(n) for n in (notes or [])]
        self.clock = clock
        # New on every start: a console that sees it change knows the seq numbering restarted.
        self.boot_id = uuid.uuid4().hex
        self.ring = FrameRing(config.ring_frames)
        self.clients: set[ClientStream] = set()
        self.watcher = Watcher()
        # seq -> the summary of the sample with that seq, for subscribers in summary mode; as deep as the ring.
        self._summaries: dict[int, p.Summary] = {}
        self._summary_seqs: deque[int] = deque()
        self.isolated = self._load_isolated()
        self.net_cut = False  # injected fault: the agent stays up but says nothing
        self.dropped_frames = 0  # frames evicted from the ring before a client read them, each counted once
        self._lost_to = 0  # highest seq already counted in dropped_frames
        self.dropped_replies = 0  # replies that closed sessions could not be sent
        self.refused_requests = 0  # actions and searches refused for a key over its budget
        self.budgets = KeyedBuckets(config.action_rate, config.action_burst, monotonic)
        self._monotonic = monotonic
        self._guards: dict[str, tuple[object, GuardedSource]] = {}
        self._refusal_log = LogLimiter(clock=monotonic)
        self.searches = 0  # search workers running now
        self._searching: set[str] = set()  # client keys with a search running
        self.preflight_running: str | None = None  # id of the pre-flight this node is running
        self.gpu_info: list[p.GpuInfo] = gpus.info() if gpus is not None else []
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)
        self._tick_ms: float | None = None
        self._stop = asyncio.Event()
        self.log = logger.bind(node=str(self.node))
        self.actions: dict[str, ActionHandler] = dict(HANDLERS)

    # ------------------------------------------------------------------ state

    def _load_isolated(self) -> bool:
        if not self.config.state_file:
            return False
        try:
            return bool(json.loads(Path(self.config.state_file).read_text()).get("isolated", False))
        except FileNotFoundError:
            return False
        except (OSError, ValueError, AttributeError) as exc:
            logger.warning("state file {} unreadable ({}); starting not isolated", self.config.state_file, exc)
            return False

    def set_isolated(self, value: bool) -> None:
        """Isolation survives an agent restart: a node taken out stays out until returned.

        The state file is written (and synced) first; raises OSError, with the
        node's state unchanged, when it cannot be.
        """
        if self.config.state_file:
            path = Path(self.config.state_file)
            try:
                _write_durably(path, json.dumps({"isolated": value}).encode())
            except OSError as exc:
                self.log.error("could not persist isolation to {}: {}; the node stays as it was", path, exc.strerror or exc)
                raise
        self.isolated = value

    # ----------------------------------------------------------------- frames

    def publish(self, frame: p.Frame) -> int:
        """Number, stamp, store and announce one stream frame."""
        frame.seq = self.ring.last_seq + 1
        frame.ts = self.clock()
        frame.node = self.node
        self.ring.append(p.encode(frame))
        for client in self.clients:
            if client.subscribed:
                client.wake.set()
        return frame.seq

    def event(self, kind: str, message: str, severity: str = "warning", *, gpu: int | None = None,
              code: int | None = None, **extra: object) -> None:
        """Publish an event the agent itself raises (actions, isolation, faults)."""
        details = {k: p.Text(str(v)) for k, v in extra.items() if v is not None}
        self.publish(
            p.Event(
                kind=p.Text(kind),
                severity=p.Text(severity),
                message=p.Text(p.clean_text(message)),
                gpu=gpu,
                code=code,
                source=p.Text("agent"),
                details=details,
            )
        )

    def hello(self, role: str) -> bytes:
        frame = p.Hello(
            agent_version=p.Text(AGENT_VERSION),
            boot_id=p.Text(self.boot_id),
            role=p.Text(role),
            interval=self.config.interval,
            first_seq=self.ring.first_seq,
            last_seq=self.ring.last_seq,
            gpus=self.gpu_info,
            simulated=bool(getattr(self.gpus, "simulated", False)),
            isolated=self.isolated,
            stack=self.stack,
            notes=self.notes,
            seq=self.ring.last_seq,
            ts=self.clock(),
            node=self.node,
        )
        return p.encode(frame)

    def reply_frame(self, frame: p.Frame) -> bytes:
        """Encode a per-client frame (not part of the numbered stream: seq 0)."""
        frame.seq = 0
        frame.ts = self.clock()
        frame.node = self.node
        return p.encode(frame)

    # ---------------------------------------------------------------- sampling

    def sources(self) -> list[GuardedSource]:
        """The sources a tick reads (GPUs, host, logs, trainer), each behind its guard.

        A guard is made once per source object; one assigned later (a trainer
        link attached after start) gets its own on the next tick.
        """
        guards: list[GuardedSource] = []
        for slot in ("gpus", "host", "tailer", "trainer", "infiniband"):
            obj = getattr(self, slot)
            if obj is None:
                self._guards.pop(slot, None)
                continue
            held = self._guards.get(slot)
            if held is None or held[0] is not obj:
                source = LogsSource(obj) if slot == "tailer" else obj
                held = (obj, GuardedSource(source, self.config.source_timeout, self._monotonic))
                self._guards[slot] = held
            guards.append(held[1])
        return guards

    async def stop_readers(self) -> None:
        """End the threads the sources are read in, each once its read in hand answers (at most the deadline).

        :meth:`run` ends with this, so that no reader thread outlives the agent
        (one hung past the deadline is left to its daemon thread).
        """
        await asyncio.gather(*(guard.stop_reading() for _, guard in self._guards.values()))

    def close_sources(self) -> None:
        """Close what the sources hold open (NVML, log files); a source still hung at its deadline is left alone."""
        for _, guard in self._guards.values():
            guard.close()
        self._guards.clear()

    def tick(self) -> None:
        """Read every source once, inline and without deadlines, and publish: for callers that drive an agent by hand."""
        t0 = time.perf_counter()
        guards = self.sources()
        self._publish_tick(guards, [g.read_now() for g in guards], t0)

    async def tick_async(self) -> None:
        """One tick of :meth:`run`: every source read at once, each within its deadline, then published."""
        t0 = time.perf_counter()
        guards = self.sources()
        if any(g.blocking for g in guards):
            outcomes = list(await asyncio.gather(*(g.read() for g in guards)))
        else:  # nothing to wait for (simulated GPUs, a trainer link): no task per tick
            outcomes = [g.read_now() for g in guards]
        self._publish_tick(guards, outcomes, t0)

    def _told_already(self, ev: p.Event) -> bool:
        """An XID another source of this node reported moments ago (NVML's event and the driver's kernel log
        line are one fault): one event, not two; the second is counted on the agent, not sent."""
        if ev.kind != "xid" or ev.code is None:
            return False
        gpu = ev.gpu if ev.gpu is not None else self._gpu_at(str(ev.details.get("pci_bus_id", "")))
        now, source = time.monotonic(), str(ev.source)
        seen = self._xids_told.get((gpu, ev.code))
        if seen is not None and seen[1] != source and now - seen[0] <= XID_FOLD_S:
            self.folded_xids += 1
            self.log.debug("XID {} on gpu {} from {} folded into the one {} reported", ev.code, gpu, source, seen[1])
            return True
        if len(self._xids_told) > 4096:  # bounded: old entries fold nothing
            self._xids_told = {k: v for k, v in self._xids_told.items() if now - v[0] <= XID_FOLD_S}
        self._xids_told[(gpu, ev.code)] = (now, source)
        return False

    def _gpu_at(self, bus: str) -> int | None:
        """The index of the GPU at PCI address ``bus`` (as the kernel names it), None when unknown."""
        if not bus:
            return None
        from gridwatch.agent.sources.pci import pci_key

        key = pci_key(bus)
        return next((i.index for i in self.gpu_info if pci_key(str(i.pci_bus_id or "")) == key), None)

    def _status_from_log(self) -> p.TrainerStatus | None:
        """A job gridwatch did not write, as its own log tells it (step, loss, step time): what the console's
        training view, goodput and recovery read; named after the scheduler's job on the node when there is one."""
        found = self.tailer.job_progress() if self.tailer is not None else None
        if found is None:
            return None
        path, job = found
        name = f"{self.jobs[0].scheduler}-{self.jobs[0].id}" if self.jobs else os.path.basename(path)
        return p.TrainerStatus(job=p.Text(name), phase=p.TrainerPhase.TRAINING, step=job.step, loss=job.loss,
                               step_time_s=job.step_time_s, tokens_per_s=job.tokens_per_s, read_from=p.Text(path))

    def _keep_out(self, status: p.TrainerStatus) -> None:
        """The node is isolated and its trainer is (back) in the job: one torchrun restarted, or one that was
        not listening when the node was isolated. It is told to leave again, at most every KEEP_OUT_S."""
        if status.phase not in IN_THE_JOB or self.trainer is None or self.trainer.leaving:
            return  # leaving already (told when the node was isolated): not told again
        now = time.monotonic()
        if now - self._asked_out_at < KEEP_OUT_S:
            return
        self._asked_out_at = now
        self.log.warning("the node is isolated and its trainer is {} again: told to leave the job", str(status.phase))
        self.event("trainer_kept_out", f"the node is isolated; its trainer ({status.phase}) was told to leave the job",
                   severity="warning")
        task = asyncio.get_running_loop().create_task(self.trainer.control("leave", {}))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _publish_tick(self, guards: list[GuardedSource], outcomes: list[Outcome], t0: float) -> None:
        """One sample from what the sources said, then their events; a source that failed is N/A in it."""
        gpu_samples: list[p.GpuSample] = []
        host = p.HostSample()
        ib_ports: list[p.IbPortSample] = []
        trainer_status = None
        events: list[p.Event] = []
        lines: list[LogEntry] = []
        for guard, outcome in zip(guards, outcomes):
            events.extend(outcome.events)
            reading = outcome.reading
            if reading is None:
                if guard.source is self.gpus:  # the GPUs are still there, their readings are not
                    gpu_samples = [p.GpuSample(index=info.index) for info in self.gpu_info]
                continue
            if reading.gpus is not None:
                gpu_samples = reading.gpus
            if reading.host is not None:
                host = reading.host
            if isinstance(reading, IbReading):
                ib_ports = reading.ib
            if reading.trainer is not None:
                trainer_status = reading.trainer
            events.extend(reading.events)
            lines.extend(reading.lines)
        host.ib = ib_ports  # read by their own source, shown beside the host's NICs
        if trainer_status is not None:
            self._trainer_seen_at = time.monotonic()
        elif self.tailer is not None and time.monotonic() - self._trainer_seen_at > PROGRESS_FRESH_S:
            # Only for a job with no trainer of gridwatch's: a trainer of ours that died is not "training"
            # because of the lines it printed before.
            trainer_status = self._status_from_log()
        if trainer_status is not None and self.isolated and trainer_status.read_from is None:
            self._keep_out(trainer_status)
        if lines:
            self._send_log_lines(lines)
        stats = p.AgentStats(
            cpu_percent=self._proc.cpu_percent(None),
            rss_mb=self._proc.memory_info().rss / 2**20,
            clients=len(self.clients),
            dropped_frames=self.dropped_frames,
            dropped_replies=self.dropped_replies,
            refused_requests=self.refused_requests,
            tick_ms=self._tick_ms,
        )
        patrol_failing = None
        if self.patrol is not None and getattr(self.patrol, "last", None) is not None:
            patrol_failing = [p.Text(name) for name in sorted(self.patrol.failing)]
        sample = p.Sample(gpus=[_for_the_wire(g) for g in gpu_samples], host=host, agent=stats,
                          trainer=trainer_status, isolated=self.isolated, patrol_failing=patrol_failing, jobs=self.jobs)
        self.publish(sample)
        self._keep_summary(p.summarize(sample))
        if self.watcher:
            self._report_watches(gpu_samples, sample.ts)
        for ev in events:
            if self._told_already(ev):
                continue
            self.publish(ev)
            if self.metrics is not None:
                self.metrics.record_event(ev)
        if self.metrics is not None:
            self.metrics.update(str(self.node), self.gpu_info, gpu_samples, host, stats)
            self.metrics.record_sources([g.health() for g in guards])
        self._tick_ms = (time.perf_counter() - t0) * 1000

    def _keep_summary(self, summary: p.Summary) -> None:
        self._summaries[summary.seq] = summary
        self._summary_seqs.append(summary.seq)
        first = self.ring.first_seq
        while self._summary_seqs and self._summary_seqs[0] < first:
            self._summaries.pop(self._summary_seqs.popleft(), None)

    def _report_watches(self, gpus: list[p.GpuSample], now: float) -> None:
        """An event per condition that began (its window full) or stopped holding on a GPU."""
        for change in self.watcher.evaluate(gpus, now):
            w = change.watch
            value = "N/A" if change.value is None else f"{change.value:g}"
            text = watch_text(w)
            if change.held:
                self.event("condition_held", f"{text} holds on gpu {change.gpu} ({w.metric} = {value}, "
                           f"held {now - change.since:.0f} s)", "warning", gpu=change.gpu, playbook=str(w.name),
                           condition=text, value=value, held_s=f"{now - change.since:.0f}")
            else:
                self.event("condition_cleared", f"{text} no longer holds on gpu {change.gpu} ({w.metric} = {value})",
                           "info", gpu=change.gpu, playbook=str(w.name), condition=text, value=value)

    def _send_log_lines(self, lines: list[tuple[str, str, float]]) -> None:
        subscribers = [c for c in self.clients if c.logs]
        if not subscribers:
            return
        for source, line, ts in lines:
            data = self.reply_frame(p.LogLine(source=p.Text(source), line=p.Text(line), line_ts=ts))
            for client in subscribers:
                client.reply(data)

    async def run(self) -> None:
        """Tick on a fixed schedule until :meth:`stop`; a slow tick is logged, not stacked; the reader threads end with it."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        overruns, warned_at = 0, -60.0
        jobs = loop.create_task(self._read_jobs()) if self.config.jobs_every > 0 else None
        while not self._stop.is_set():
            try:
                await self.tick_async()
            except Exception:  # a source bug must not stop the heartbeat
                self.log.exception("tick failed")
            next_at += self.config.interval
            delay = next_at - loop.time()
            if delay < 0:
                overruns += 1
                # Once a minute at most: a loaded node must not also flood its own log.
                if loop.time() - warned_at >= 60:
                    self.log.warning("tick overran its interval by {:.0f} ms ({} overruns so far)", -delay * 1000, overruns)
                    warned_at = loop.time()
                next_at = loop.time()
                delay = 0
            try:
                await asyncio.wait_for(self._stop.wait(), delay)
            except TimeoutError:
                pass
        if jobs is not None:
            jobs.cancel()
            await asyncio.gather(jobs, return_exceptions=True)
        await self.stop_readers()

    async def _read_jobs(self) -> None:
        """Which scheduler jobs run here, every ``jobs_every`` seconds, read off the loop (a /proc walk)."""
        while not self._stop.is_set():
            try:
                found = await asyncio.to_thread(jobs_on_node, "/proc", self.config.node_name)
            except Exception:  # noqa: BLE001 - the samples go on without jobs; the log says why
                self.log.exception("reading the node's jobs failed")
                found = []
            jobs = [p.SchedulerJob(scheduler=p.Text(j.scheduler), id=p.Text(j.id), user=p.Text(j.user),
                                   name=p.Text(j.name), nodes=p.Text(j.nodes), pids=len(j.pids)) for j in found]
            if [(j.scheduler, j.id) for j in jobs] != [(j.scheduler, j.id) for j in self.jobs]:
                self.log.info("jobs on the node: {}", ", ".join(f"{j.scheduler} {j.id} ({j.user})" for j in jobs)
                              or "none")
            self.jobs = jobs
            try:
                await asyncio.wait_for(self._stop.wait(), self.config.jobs_every)
            except TimeoutError:
                pass

    def stop(self) -> None:
        self._stop.set()
        for client in self.clients:
            client.closed = True
            client.wake.set()

    # ----------------------------------------------------------------- clients

    def connect(self, caller: Caller, close: Callable[[bytes], None] | None = None) -> ClientStream:
        """A new client; ``close`` ends its session with a last frame when it stops reading."""
        client = ClientStream(caller=caller)
        if close is not None:
            client.on_overflow = lambda c: self._overflowed(c, close)
        self.clients.add(client)
        return client

    def forget(self, client: ClientStream) -> None:
        """The client's session ended; what it never got is counted."""
        client.closed = True
        client.wake.set()
        self.watcher.forget(id(client))
        if client in self.clients:
            self.clients.discard(client)
            self.dropped_replies += client.dropped

    def _overflowed(self, client: ClientStream, close: Callable[[bytes], None]) -> None:
        reason = (f"more than {MAX_REPLIES} replies or {MAX_REPLY_BYTES >> 20} MB waiting: "
                  "this console is not reading them; closing the session")
        self.log.warning("closing the session of {}: {}", client.caller, reason)
        # What was queued still goes out, then the reason; only the reply that overflowed is lost (and counted).
        data = b"".join(client.replies) + self.reply_frame(p.Error(code=p.Text("overloaded"), message=p.Text(reason)))
        client.replies.clear()
        client.queued_bytes = 0
        self.forget(client)
        close(data)

    def handle_request(self, client: ClientStream, line: bytes) -> Awaitable[None] | None:
        """Act on one line a client sent; returns a coroutine for slow work (actions, searches)."""
        try:
            frame = p.decode_client_frame(line)
        except p.FrameError as exc:
            client.reply(self.reply_frame(p.Error(code=p.Text(exc.code), message=p.Text(str(exc)))))
            return None
        if isinstance(frame, p.Subscribe):
            client.logs = frame.logs
            client.mode, client.every = frame.mode, max(frame.every, 0.0)
            refused = self.watcher.set(id(client), frame.watches)
            if refused:
                client.reply(self.reply_frame(p.Error(code=p.Text("bad_watch"), message=p.Text("; ".join(refused)))))
            if not client.subscribed:
                client.subscribed = True
                client.cursor = client.last_sent = self.resume_cursor(frame.resume_from)
            client.wake.set()
            return None
        if isinstance(frame, (p.Search, p.Action)):
            # Behind a relay, the console it forwards for: never more than the relay's own role. Taken from an
            # operator's key only (a relay's is one): a viewer could otherwise mint a budget per request.
            relayed = frame.behalf is not None and client.caller.role == "operator"
            caller = client.caller.behind(str(frame.behalf.key), str(frame.behalf.role)) \
                if relayed and frame.behalf is not None else client.caller
        if isinstance(frame, p.Search):
            refusal = self._admit(client, caller, "search")
            if refusal is not None:
                client.reply(self.reply_frame(p.SearchResult(id=frame.id, error=p.Text(refusal))))
                return None
            return self._answer(client, self.search(frame, caller.key))
        if isinstance(frame, p.Action):
            refusal = self._admit(client, caller, "action")
            if refusal is not None:
                client.reply(self.reply_frame(p.ActionResult(id=frame.id, action=frame.action, ok=False, message=p.Text(refusal))))
                return None
            return self._answer(client, self.act(caller, frame))
        if isinstance(frame, (p.RelaySubscribe, p.Relayed)):
            client.reply(self.reply_frame(p.Error(code=p.Text("not_a_relay"), message=p.Text(
                "this is a gridwatch agent, not a relay: list it as a node, not under [[relay]]"))))
        return None

    def resume_cursor(self, resume_from: int | None) -> int:
        """Where a subscription starts: live without a resume point, else within what this agent has sent."""
        if resume_from is None:
            return max(self.ring.last_seq - 1, 0)
        # A client cannot claim frames that were never sent, nor ones before the first.
        return min(max(resume_from, 0), self.ring.last_seq)

    def _admit(self, client: ClientStream, caller: Caller, what: str) -> str | None:
        """None if ``caller``'s request may run now, else why not (one sentence for the client)."""
        if client.pending >= MAX_PENDING:
            return f"{what} refused: {MAX_PENDING} requests from this session are still running; wait for their answers"
        if not self.budgets.take(caller.key):
            self.refused_requests += 1
            held = self._refusal_log.allow()
            if held is not None:
                more = f" ({held} more refused since the last such line)" if held else ""
                self.log.warning("refused a {} from {}: over its request budget{}", what, caller, more)
            wait = self.budgets.bucket(caller.key).retry_after()
            return (
                f"{what} refused: this key is over its budget of {self.config.action_burst:g} requests at once "
                f"and {self.config.action_rate:g} a second; try again in {wait:.1f} s"
            )
        client.pending += 1
        return None

    async def _answer(self, client: ClientStream, work: Awaitable[p.Frame]) -> None:
        try:
            result = await work
        finally:
            client.pending -= 1
        client.reply(self.reply_frame(result))

    async def search(self, req: p.Search, key: str = "") -> p.SearchResult:
        """Search the buffered log lines in a worker process: the event loop only waits for it.

        One search at a time per client ``key``, so one viewer cannot hold every worker.
        """
        if self.tailer is None:
            return p.SearchResult(id=req.id)
        if key and key in self._searching:
            return p.SearchResult(id=req.id, error=p.Text("busy: this key's previous search is still running; wait for its answer"))
        if self.searches >= MAX_SEARCHES:
            return p.SearchResult(id=req.id, error=p.Text(f"busy: {MAX_SEARCHES} searches are running on this node; try again shortly"))
        limit = min(max(req.limit, 1), 5000)
        self.searches += 1
        self._searching.add(key)
        try:
            # The whole buffer in one copy, filtered here: the logs source appends to it from its own thread.
            entries = [e for e in self.tailer.entries() if (req.since is None or e[2] >= req.since)
                       and (req.until is None or e[2] <= req.until)]
            found = await search_entries(entries, str(req.pattern), limit + 1, self.config.search_timeout)
        except SearchRefused as exc:
            return p.SearchResult(id=req.id, error=p.Text(f"refused pattern: {exc}"))
        except SearchTimeout as exc:
            self.log.warning("a search for {!r} was stopped at its deadline", p.clean_text(str(req.pattern), 100))
            return p.SearchResult(id=req.id, error=p.Text(f"search timed out: {exc}"))
        except ValueError as exc:
            return p.SearchResult(id=req.id, error=p.Text(f"bad pattern: {exc}"))
        finally:
            self.searches -= 1
            self._searching.discard(key)
        truncated = len(found) > limit
        lines = [p.LogLine(source=p.Text(src), line=p.Text(text), line_ts=ts, node=self.node) for src, text, ts in found[-limit:]]
        kept = _fit_frame(lines)
        return p.SearchResult(id=req.id, lines=lines[len(lines) - kept:], truncated=truncated or kept < len(lines))

    async def act(self, caller: Caller, action: p.Action) -> p.ActionResult:
        """Check the role, run the handler, log who asked and what came of it."""
        name = str(action.action)
        handler = self.actions.get(name)
        if handler is None:
            return p.ActionResult(id=action.id, action=action.action, ok=False, message=p.Text(f"unknown action {name!r}"))
        if caller.role != "operator" and name not in p.VIEWER_ACTIONS:
            self.log.warning("refused action {} from {}: viewer role", name, caller)
            return p.ActionResult(
                id=action.id,
                action=action.action,
                ok=False,
                message=p.Text(f"action {name!r} needs the operator role; this key is a {caller.role}"),
            )
        self.log.info("action {} {} by {} because {!r}", name, dict(action.args), caller, str(action.reason))
        try:
            result = await handler(self, caller, action)
        except Exception as exc:  # an action bug is reported to the operator, not fatal to the agent
            self.log.exception("action {} failed", name)
            result = p.ActionResult(id=action.id, action=action.action, ok=False, message=p.Text(f"{name} failed: {exc}"))
        self.log.info("action {} by {}: {} {}", name, caller, "ok" if result.ok else "FAILED", str(result.message))
        # An action that changed nothing (isolating an isolated node) is not news.
        if name not in p.VIEWER_ACTIONS and result.data.get("changed", True) is not False:
            self.event(
                "action",
                f"{name} by {caller.username} ({caller.role}): {'ok' if result.ok else 'failed'}: {result.message}",
                severity="info" if result.ok else "warning",
                action=name,
                by=caller.username,
                reason=str(action.reason),
                ok="true" if result.ok else "false",  # whoever reads the event back never parses the sentence
            )
        return result

    async def write_loop(self, client: ClientStream, write: Callable[[bytes], None], drain: Callable[[], Awaitable[None]]) -> None:
        """Send a client its replies and, once subscribed, the stream from its cursor."""
        while not client.closed:
            await client.wake.wait()
            client.wake.clear()
            if self.net_cut:
                continue
            while client.replies:
                write(client.next_reply())
            if client.subscribed:
                frames, gap = self.ring.since(client.cursor, WRITE_BATCH)
                if gap is not None:
                    lost = gap[1] - gap[0] + 1
                    # Frames lost to several clients (or asked for again) are counted once.
                    self.dropped_frames += max(0, gap[1] - max(gap[0] - 1, self._lost_to))
                    self._lost_to = max(self._lost_to, gap[1])
                    self.log.warning("client {} fell behind: {} frames lost", client.caller, lost)
                    write(self.reply_frame(p.Gap(from_seq=gap[0], to_seq=gap[1], reason=p.Text("client fell behind the agent's buffer"))))
                    client.cursor = client.last_sent = gap[1]
                    client.sent += 1
                if frames:
                    if client.mode is p.StreamMode.SUMMARY:
                        self._write_summarised(client, frames, write)
                    else:
                        for data in frames:
                            write(data)
                        client.sent += len(frames)
                        client.last_sent = client.cursor + len(frames)
                    client.cursor += len(frames)
                    if client.cursor < self.ring.last_seq:
                        client.wake.set()
            await drain()


    def _write_summarised(self, client: ClientStream, frames: list[bytes], write: Callable[[bytes], None]) -> None:
        """Frames from the client's cursor with each sample as its summary; samples inside ``every`` are folded."""
        seq = client.cursor
        for data in frames:
            seq += 1
            summary = self._summaries.get(seq)
            if summary is None:  # an event, or a sample older than its summary: as it is
                write(data)
            else:
                # Within ``every`` of the last summary it got, a sample is folded into the next one.
                # Ticks jitter: "due" allows a tenth of the agent's interval early.
                slack = 0.1 * self.config.interval
                due = client.since_summary is None or summary.ts - client.since_summary >= client.every - slack
                if not due:
                    client.folded += 1
                    continue
                summary.after, summary.every = client.last_sent, client.every
                last = client.since_summary
                # On the cadence's own schedule, not the sample's: every 2.5 s at 1 s ticks comes 3, 2, 3, 2 s
                # apart (2.5 on average), not 3 s each; after a long silence the schedule starts again.
                client.since_summary = summary.ts if last is None or summary.ts - last >= 2 * client.every \
                    else last + client.every
                members = summary.members
                if members is not None:
                    # The membership only when this subscriber does not have it yet (the first, or a change).
                    summary.members = None if members == client.members_sent else members
                    client.members_sent = members
                write(p.encode(summary))
                summary.members = members  # the summary is shared by every subscriber
            client.last_sent = seq
            client.sent += 1


def _fit_frame(lines: list[p.LogLine]) -> int:
    """How many of the newest ``lines`` fit in one frame the console accepts (``MAX_FRAME_BYTES``)."""
    room = p.MAX_FRAME_BYTES - 4096  # the result's own fields
    kept = 0
    for line in reversed(lines):
        room -= len(p.encode(line)) + 1
        if room < 0:
            break
        kept += 1
    return kept


def _write_durably(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that either the old or the new content survives a crash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _for_the_wire(gpu: p.GpuSample) -> p.GpuSample:
    """The GPU's sample as frames carry it: per-link NVLink rates stay on /metrics."""
    if not gpu.nvlink_link_tx_bps and not gpu.nvlink_link_rx_bps:
        return gpu
    return msgspec.structs.replace(gpu, nvlink_link_tx_bps=[], nvlink_link_rx_bps=[])
