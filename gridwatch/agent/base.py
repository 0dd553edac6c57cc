"""The agent's state, which its parts share, and the stream it numbers: frames stamped, kept in the ring, announced.

The tick (:mod:`gridwatch.agent.tick`), the clients' streams (:mod:`gridwatch.agent.clients`) and the log
search (:mod:`gridwatch.agent.searches`) build on it; :class:`gridwatch.agent.agent.Agent` puts them together.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from gridwatch.agent.actions import HANDLERS
from gridwatch.agent.config import AgentConfig
from gridwatch.agent.durable import _write_durably
from gridwatch.agent.footprint import Footprint
from gridwatch.agent.ringbuffer import FrameRing
from gridwatch.agent.sources import GuardedSource
from gridwatch.agent.sources.batch import BatchedReads
from gridwatch.agent.sources.ib.source import IbSource
from gridwatch.agent.watch import Watcher
from gridwatch.sshlink.ratelimit import KeyedBuckets, LogLimiter
from gridwatch.sshlink.server import Caller
from gridwatch.wire import protocol as p
from gridwatch.wire.protocol import AGENT_VERSION

if TYPE_CHECKING:  # for the annotations only: the runner builds these and hands them in
    from gridwatch.agent.agent import Agent  # the whole agent, built on this module (as are its clients)
    from gridwatch.agent.clients import ClientStream
    from gridwatch.agent.logs import LogTailer
    from gridwatch.agent.metrics import MetricsExporter
    from gridwatch.agent.patrol import Patrol
    from gridwatch.agent.sources import GpuSource
    from gridwatch.agent.sources.host import HostSource
    from gridwatch.agent.trainer_link import TrainerLink


ActionHandler = Callable[["Agent", Caller, p.Action], Awaitable[p.ActionResult]]


class AgentBase:
    """Everything one node reports, and the actions it takes: the state the agent's parts share."""

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
        self._xids_told: dict[tuple[int | None, int], tuple[float, str]] = {}  # (gpu, code) -> (when, source)
        self.folded_xids = 0  # XIDs a second source reported within XID_FOLD_S of the first
        self._background: set[asyncio.Task[Any]] = set()
        self._trainer_seen_at = float("-inf")  # monotonic: when gridwatch's trainer last answered its socket
        self.jobs: list[p.SchedulerJob] = []  # the scheduler's jobs on this node, read every config.jobs_every
        self.job_pids: dict[tuple[str, str], list[int]] = {}  # (scheduler, id) -> its processes here, for scenes
        self.log_job_names: dict[str, str] = {}  # a progress log -> the scheduler job last seen writing it
        # A progress log -> the life of its job (scheduler, id, restarts) and when this agent first saw it; a
        # line read before then was the previous life's (a requeued job's old ranks dying, still printing).
        self.log_lives: dict[str, tuple[tuple[str, str, int], float]] = {}
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
        if self.trainer is not None:
            self.trainer.node_out = self.isolated
        self.net_cut = False  # injected fault: the agent stays up but says nothing
        self.dropped_frames = 0  # frames evicted from the ring before a client read them, each counted once
        self._lost_to = 0  # highest seq already counted in dropped_frames
        self.dropped_replies = 0  # replies that closed sessions could not be sent
        self.refused_requests = 0  # actions and searches refused for a key over its budget
        self.budgets = KeyedBuckets(config.action_rate, config.action_burst, monotonic)
        self._monotonic = monotonic
        self._guards: dict[str, tuple[object, GuardedSource]] = {}
        self._readers = BatchedReads()  # the blocking sources' reads, one shared thread a tick
        self._refusal_log = LogLimiter(clock=monotonic)
        self.searches = 0  # search workers running now
        self._searching: set[str] = set()  # client keys with a search running
        self.preflight_running: str | None = None  # id of the pre-flight this node is running
        self.gpu_info: list[p.GpuInfo] = gpus.info() if gpus is not None else []
        self._footprint = Footprint()  # the agent's own CPU and memory, for each sample
        self._tick_ms: float | None = None
        self._stop = asyncio.Event()
        self.jobs_wake = asyncio.Event()  # read the node's jobs now, not at the next jobs_every
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
        if self.trainer is not None:
            self.trainer.node_out = value

    # ----------------------------------------------------------------- frames

    def publish(self, frame: p.Frame) -> int:
        """Number, stamp, store and announce one stream frame."""
        frame.seq = self.ring.last_seq + 1
        now = self.clock()
        if isinstance(frame, p.Event) and 0 < frame.ts < now and p.FAULT_AT not in frame.details:
            # The source's own time of it (NVML's event, the kernel's stamp) is when the fault was seen, not
            # this tick: kept, so the console counts detection from it.
            frame.details = {**frame.details, p.Text(p.FAULT_AT): p.Text(f"{frame.ts:.3f}")}
        frame.ts = now
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
