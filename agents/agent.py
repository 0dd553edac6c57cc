"""The node agent's core: sample every tick, number frames, fan them out to clients.

Transport-free: :mod:`agents.server` connects it to SSH sessions, tests may
drive it directly. Sampling never waits on a client: frames go into the ring,
and each client's writer reads from the ring at its own pace.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from loguru import logger

from agents import protocol as p
from agents.config import AgentConfig
from agents.ringbuffer import FrameRing

AGENT_VERSION = "0.1.0"
# A client's private replies (action results, log lines) beyond this are dropped
# and counted: a console that never reads must not grow the agent's memory.
MAX_REPLIES = 2000
# Frames written per wake-up, so one client catching up does not starve others.
WRITE_BATCH = 256


@dataclass(frozen=True)
class Caller:
    """Who is on the other end of a session: the key the agent accepted."""

    username: str
    role: str  # viewer | operator
    key: str  # SHA256 fingerprint of the client key

    def __str__(self) -> str:
        return f"{self.username} ({self.role}, {self.key})"


@dataclass(eq=False)  # identity, not value: clients live in a set
class ClientStream:
    """One connected console: a cursor into the ring plus its private replies."""

    caller: Caller
    cursor: int = 0
    subscribed: bool = False
    logs: bool = False
    replies: deque[bytes] = field(default_factory=lambda: deque(maxlen=MAX_REPLIES))
    dropped: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False

    def reply(self, data: bytes) -> None:
        if len(self.replies) == self.replies.maxlen:
            self.dropped += 1
        self.replies.append(data)
        self.wake.set()


ActionHandler = Callable[["Agent", Caller, p.Action], Awaitable[p.ActionResult]]


class Agent:
    """Everything one node reports, and the actions it takes."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        gpus: object | None = None,
        host: object | None = None,
        tailer: object | None = None,
        metrics: object | None = None,
        trainer: object | None = None,
        stack: p.StackFingerprint | None = None,
        notes: list[str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.node = p.Text(p.clean_text(config.node_name, 200))
        self.gpus = gpus
        self.host = host
        self.tailer = tailer
        self.metrics = metrics
        self.trainer = trainer
        self.patrol: object | None = None  # set by the runner when patrol_interval is on
        self.stack = stack or p.StackFingerprint()
        self.notes = [p.Text(n) for n in (notes or [])]
        self.clock = clock
        self.ring = FrameRing(config.ring_frames)
        self.clients: set[ClientStream] = set()
        self.isolated = self._load_isolated()
        self.net_cut = False  # injected fault: the agent stays up but says nothing
        self.dropped_frames = 0
        self.gpu_info: list[p.GpuInfo] = gpus.info() if gpus is not None else []  # type: ignore[attr-defined]
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)
        self._tick_ms: float | None = None
        self._stop = asyncio.Event()
        self.log = logger.bind(node=str(self.node))
        self.actions: dict[str, ActionHandler] = {}
        from agents.actions import HANDLERS  # late: actions import this module

        self.actions.update(HANDLERS)

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
        """Isolation survives an agent restart: a node taken out stays out until returned."""
        self.isolated = value
        if not self.config.state_file:
            return
        path = Path(self.config.state_file)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"isolated": value}))
            os.replace(tmp, path)
        except OSError as exc:
            self.log.error("could not persist isolation to {}: {}", path, exc.strerror or exc)

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

    def event(self, kind: str, message: str, severity: str = "warning", **extra: object) -> None:
        """Publish an event the agent itself raises (actions, isolation, faults)."""
        details = {k: p.Text(str(v)) for k, v in extra.items() if v is not None and k not in ("gpu", "code")}
        self.publish(
            p.Event(
                kind=p.Text(kind),
                severity=p.Text(severity),
                message=p.Text(p.clean_text(message)),
                gpu=extra.get("gpu"),  # type: ignore[arg-type]
                code=extra.get("code"),  # type: ignore[arg-type]
                source=p.Text("agent"),
                details=details,
            )
        )

    def hello(self, role: str) -> bytes:
        frame = p.Hello(
            agent_version=p.Text(AGENT_VERSION),
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

    def tick(self) -> None:
        """Read every source once and publish what they said."""
        t0 = time.perf_counter()
        gpu_samples: list[p.GpuSample] = []
        events: list[p.Event] = []
        if self.gpus is not None:
            gpu_samples = self.gpus.sample()  # type: ignore[attr-defined]
            events.extend(self.gpus.poll_events())  # type: ignore[attr-defined]
        host = self.host.sample() if self.host is not None else p.HostSample()  # type: ignore[attr-defined]
        if self.tailer is not None:
            lines, log_events = self.tailer.poll()  # type: ignore[attr-defined]
            events.extend(log_events)
            if lines:
                self._send_log_lines(lines)
        trainer_status = None
        if self.trainer is not None:
            trainer_status = self.trainer.status  # type: ignore[attr-defined]
            events.extend(self.trainer.take_events())  # type: ignore[attr-defined]
        stats = p.AgentStats(
            cpu_percent=self._proc.cpu_percent(None),
            rss_mb=self._proc.memory_info().rss / 2**20,
            clients=len(self.clients),
            dropped_frames=self.dropped_frames,
            tick_ms=self._tick_ms,
        )
        patrol_failing = None
        if self.patrol is not None and getattr(self.patrol, "last", None) is not None:
            patrol_failing = [p.Text(name) for name in sorted(self.patrol.failing)]  # type: ignore[attr-defined]
        self.publish(p.Sample(gpus=gpu_samples, host=host, agent=stats, trainer=trainer_status, isolated=self.isolated,
                              patrol_failing=patrol_failing))
        for ev in events:
            self.publish(ev)
            if self.metrics is not None:
                self.metrics.record_event(ev)  # type: ignore[attr-defined]
        if self.metrics is not None:
            self.metrics.update(str(self.node), self.gpu_info, gpu_samples, host, stats)  # type: ignore[attr-defined]
        self._tick_ms = (time.perf_counter() - t0) * 1000

    def _send_log_lines(self, lines: list[tuple[str, str, float]]) -> None:
        subscribers = [c for c in self.clients if c.logs]
        if not subscribers:
            return
        for source, line, ts in lines:
            data = self.reply_frame(p.LogLine(source=p.Text(source), line=p.Text(line), line_ts=ts))
            for client in subscribers:
                client.reply(data)

    async def run(self) -> None:
        """Tick on a fixed schedule until :meth:`stop`; a slow tick is logged, not stacked."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        overruns, warned_at = 0, -60.0
        while not self._stop.is_set():
            try:
                self.tick()
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

    def stop(self) -> None:
        self._stop.set()
        for client in self.clients:
            client.closed = True
            client.wake.set()

    # ----------------------------------------------------------------- clients

    def handle_request(self, client: ClientStream, line: bytes) -> Awaitable[None] | None:
        """Act on one line a client sent; returns a coroutine for slow work (actions)."""
        try:
            frame = p.decode_client_frame(line)
        except p.FrameError as exc:
            client.reply(self.reply_frame(p.Error(code=p.Text(exc.code), message=p.Text(str(exc)))))
            return None
        if isinstance(frame, p.Subscribe):
            client.logs = frame.logs
            if not client.subscribed:
                client.subscribed = True
                # No resume point: start live, from the newest sample on.
                client.cursor = frame.resume_from if frame.resume_from is not None else max(self.ring.last_seq - 1, 0)
            client.wake.set()
            return None
        if isinstance(frame, p.Search):
            client.reply(self.reply_frame(self.search(frame)))
            return None
        if isinstance(frame, p.Action):
            return self._run_action(client, frame)
        return None

    def search(self, req: p.Search) -> p.SearchResult:
        if self.tailer is None:
            return p.SearchResult(id=req.id)
        try:
            found = self.tailer.search(req.pattern, req.since, req.until, min(max(req.limit, 1), 5000) + 1)  # type: ignore[attr-defined]
        except ValueError as exc:
            return p.SearchResult(id=req.id, error=p.Text(f"bad pattern: {exc}"))
        truncated = len(found) > req.limit
        lines = [
            p.LogLine(source=p.Text(src), line=p.Text(text), line_ts=ts, node=self.node) for src, text, ts in found[-req.limit :]
        ]
        return p.SearchResult(id=req.id, lines=lines, truncated=truncated)

    async def _run_action(self, client: ClientStream, action: p.Action) -> None:
        result = await self.act(client.caller, action)
        client.reply(self.reply_frame(result))

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
        if name not in p.VIEWER_ACTIONS:
            self.event(
                "action",
                f"{name} by {caller.username} ({caller.role}): {'ok' if result.ok else 'failed'}: {result.message}",
                severity="info" if result.ok else "warning",
                action=name,
                by=caller.username,
                reason=str(action.reason),
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
                write(client.replies.popleft())
            if client.subscribed:
                frames, gap = self.ring.since(client.cursor, WRITE_BATCH)
                if gap is not None:
                    lost = gap[1] - gap[0] + 1
                    self.dropped_frames += lost
                    self.log.warning("client {} fell behind: {} frames lost", client.caller, lost)
                    write(self.reply_frame(p.Gap(from_seq=gap[0], to_seq=gap[1], reason=p.Text("client fell behind the agent's buffer"))))
                    client.cursor = gap[1]
                if frames:
                    for data in frames:
                        write(data)
                    client.cursor += len(frames)
                    if client.cursor < self.ring.last_seq:
                        client.wake.set()
            await drain()

