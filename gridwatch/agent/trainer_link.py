"""The agent's side of the local trainer's control socket: status in, controls out.

Polled in the background so a slow or stuck trainer never delays a tick; the
sampler reads the newest status it has.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loguru import logger

from gridwatch.agent.exit_watch import ExitWatch
from gridwatch.agent.sources import Reading
from gridwatch.wire import protocol as p

if TYPE_CHECKING:
    from gridwatch.wire.control import CollectiveRecord

# What a trainer_exit's ``process`` detail says, in words.
PROCESS_WORDS = {"alive": "its process is still there: frozen", "gone": "its process is gone: it exited or was killed",
                 "unknown": "its process is not known"}
VIEWER_DUMP_ENTRIES = 64  # a viewer's read stays small: the newest few steps of every group


class TrainerLink:
    """Polls the trainer; says ``trainer_exit`` once it has been silent for ``grace`` seconds.

    The grace keeps a planned re-formation (workers restarting after a node
    left, a few seconds) from paging; a crash that torchrun does not heal, a
    frozen trainer or a re-formation that hangs outlasts it.
    """

    name = "trainer"
    blocking = False  # the newest status is already in memory: polling happens in the background

    def __init__(self, socket_path: str, interval: float = 1.0, timeout: float = 2.0, grace: float = 15.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.socket_path = socket_path
        self.interval = interval
        self.timeout = timeout
        self.grace = grace
        self.clock = clock
        self._silent_since: float | None = None
        self.status: p.TrainerStatus | None = None
        self.attached = False
        self._events: list[p.Event] = []
        self._seen_event_seq = 0
        self._task: asyncio.Task[None] | None = None
        self.last_ok: float | None = None
        self.leaving = False  # asked to leave the job: its going away is no fault
        self.leave_sent = 0  # leave requests sent and not answered yet: the node's own keep-out waits for them
        self.leave_ended_at = float("-inf")  # (this link's clock) when the last leave was answered or given up on
        # The node is isolated (its agent says): a worker kept out of the job that dies and is started again
        # cost the job nothing, and is no crash of a training worker.
        self.node_out = False
        # The node was out (isolated) at some answer of the trainer's current life: a life kept out that dies
        # while it waits to join is the node's return under way, even when the node was returned just before.
        self._life_was_out = False
        # What the previous life left behind, kept for the new life's report of its restart, which may come
        # in a later answer than its first (it says so once torch is up, or once it joins): whether that life
        # had left or was kept out (a return, not a crash), and when it last answered (the crash's time).
        self._previous_left = False
        self._previous_last_ok: float | None = None
        # When each life's process exited, read from the kernel: a crash is dated at the death itself, not at
        # the life's last answer up to a poll earlier.
        self.exits = ExitWatch()

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self.exits.close()

    def read(self) -> Reading:
        """The sampler's view: the newest status and the events since the last read."""
        return Reading(trainer=self.status, events=self.take_events())

    def take_events(self) -> list[p.Event]:
        events, self._events = self._events, []
        return events

    async def control(self, command: str, args: dict[str, Any]) -> dict[str, Any]:
        """Send one control; the reply is a dict with ``ok`` and ``message`` or ``error``."""
        from gridwatch.wire.controlsock import TrainerUnavailable, request

        leave = command == "leave"
        self.leave_sent += leave
        try:
            reply = await request(self.socket_path, command, args, timeout=max(self.timeout, 10.0))
        except (OSError, TimeoutError, ValueError) as exc:
            absent = isinstance(exc, TrainerUnavailable) and exc.absent
            return {"ok": False, "error": f"trainer control socket {self.socket_path}: {exc or type(exc).__name__}",
                    **({"code": p.ResultCode.TRAINER_ABSENT} if absent else {})}
        finally:
            self.leave_sent -= leave
            if leave:
                # One that timed out may still be acted on (a trainer queues controls): the keep-out waits a while.
                self.leave_ended_at = self.clock()
        if leave and reply.ok:
            self.leaving = True
        return {"ok": reply.ok, "message": str(reply.message)}

    def told_to_leave_within(self, seconds: float) -> bool:
        """Whether a leave is on its way to the trainer now, or ended (answered or given up on) within ``seconds``."""
        return self.leave_sent > 0 or self.clock() - self.leave_ended_at < seconds

    async def collectives(self, viewer: bool, limit: int | None = None) -> tuple[CollectiveRecord | None, str]:
        """The trainer's collective record (a viewer gets the newest ``VIEWER_DUMP_ENTRIES`` at most), or why not."""
        from gridwatch.wire.control import MAX_DUMP_ENTRIES
        from gridwatch.wire.controlsock import TrainerUnavailable, read_collectives

        cap = VIEWER_DUMP_ENTRIES if viewer else MAX_DUMP_ENTRIES
        want = min(max(1, limit), cap) if limit is not None else cap
        try:
            return await read_collectives(self.socket_path, want, timeout=self.timeout), ""
        except TrainerUnavailable as exc:
            return None, str(exc)

    async def _poll_forever(self) -> None:
        from gridwatch.wire.controlsock import read_status

        while True:
            try:
                status = await read_status(self.socket_path, timeout=self.timeout)
            except (OSError, TimeoutError, ValueError) as exc:
                self.unanswered(str(exc) or type(exc).__name__, late=getattr(exc, "late", False))
            else:
                self.answered(status)
            await asyncio.sleep(self.interval)

    def unanswered(self, why: str, late: bool = False) -> None:
        """One poll got no status; ``late``: the trainer's socket took it and no answer came in time."""
        now = self.clock()
        if self._silent_since is None:
            self._silent_since = now
        if self.attached and self.leaving and late and now - self._silent_since < self.grace \
                and self._process() == "alive":
            # Still on its way out (a trainer saving or tearing its group down answers late): not left yet. Had it
            # been called left, its next answer would have made it a member again and its real exit a fault.
            return
        if self.attached and self.leaving:
            self.attached = False
            logger.info("trainer at {} left the job on request", self.socket_path)
            self._events.append(
                p.Event(kind=p.Text("trainer_left"), severity=p.Text("info"), source=p.Text("trainer"),
                        message=p.Text("the local trainer left the job on request"))
            )
            if self.status is not None:
                self.status.phase = p.TrainerPhase.LEFT
            return
        if self.attached and now - self._silent_since >= self.grace:
            self.attached = False
            process = self._process()
            # It began to fail when it went silent, not when the grace ran out; when its process is gone and
            # the kernel said when, that is the time.
            began = time.time() - (now - self._silent_since)
            died = self.exits.exited_at(self.status.pid if self.status is not None else None)
            if died is not None and died <= began:
                began = died
            logger.warning("trainer at {} stopped answering for {:.0f} s ({}): {}", self.socket_path,
                           now - self._silent_since, PROCESS_WORDS[process], why)
            self._events.append(
                p.Event(kind=p.Text("trainer_exit"), severity=p.Text("error"), source=p.Text("trainer"),
                        message=p.Text(f"the local trainer stopped answering for {now - self._silent_since:.0f} s "
                                       f"({PROCESS_WORDS[process]}: {why})"),
                        details={p.Text("process"): p.Text(process),
                                 p.Text(p.FAULT_AT): p.Text(f"{began:.3f}")})
            )
            if self.status is not None:
                self.status.phase = p.TrainerPhase.GONE

    def _process(self) -> str:
        """Whether the trainer's process is still there: "alive" (frozen: the evidence is about this node),
        "gone" (it exited or was killed: torchrun restarts it), or "unknown" (it never said its pid)."""
        from gridwatch.wire.control import pid_alive

        pid = self.status.pid if self.status is not None else None
        if not pid:
            return "unknown"
        return "alive" if pid_alive(pid) else "gone"

    def answered(self, status: p.TrainerStatus) -> None:
        """One poll got a status: relay it, and its new events once."""
        from gridwatch.wire.control import events_after

        self._silent_since = None
        if not self.attached:
            self.leaving = False  # a trainer (again): its next silence is a fault
            logger.info("trainer attached at {}", self.socket_path)
        self.attached = True
        before, self.last_ok = self.last_ok, time.time()
        previous_pid = self.status.pid if self.status is not None else None
        # Kept out is judged by the previous life's whole life, not by the node now: the node may have been
        # returned before that life died, or between its death and the next life's first answer (a repair
        # that clears the fault and unisolates while the worker waits to join, or torchrun starts it again).
        if before is not None and previous_pid and previous_pid != status.pid:  # a new life
            kept_out = self.node_out or self._life_was_out
            assert self.status is not None
            self._previous_left = self.status.phase == p.TrainerPhase.LEFT or (
                kept_out and self.status.phase in (p.TrainerPhase.JOINING, p.TrainerPhase.STARTING))
            died = self.exits.exited_at(previous_pid)
            self._previous_last_ok = died if died is not None and died >= before else before
            self._life_was_out = self.node_out
            # The leave was the previous life's: this one is a member until told, and the keep-out tells it.
            self.leaving = False
        else:
            self._life_was_out = self._life_was_out or self.node_out
        fresh = events_after(status, self._seen_event_seq)
        if fresh:
            self._seen_event_seq = max(e.seq for e in fresh)
            # The life's first report of its restart, in whichever answer it comes: after a life that had left
            # (or was kept out) it is the node's return; else a crash, dated at the previous life's last answer.
            if any(e.kind == "trainer_restarted" for e in fresh):
                if self._previous_left:
                    _as_return(fresh)
                elif self._previous_last_ok is not None:
                    _date_restart(fresh, self._previous_last_ok)
                self._previous_left, self._previous_last_ok = False, None
            # Re-numbered when the agent publishes them into its own stream.
            self._events.extend(fresh)
        status.events = []  # relayed once as events, not again in every sample
        self.status = status
        if status.pid:
            self.exits.watch(status.pid)


def _as_return(events: list[p.Event]) -> None:
    """A trainer whose previous life had left the job, or was kept out of it on an isolated node, and is
    started again is the node's return to the job, not a crash: told as ``trainer_rejoined``, which no
    playbook answers as a fault."""
    for event in events:
        if event.kind == "trainer_restarted":
            event.kind = p.Text("trainer_rejoined")
            event.severity = p.Text("info")
            event.message = p.Text(f"{event.message} (its previous life had left the job: this is its return, "
                                   "not a crash)")


def _date_restart(events: list[p.Event], last_heard: float) -> None:
    """A restarted trainer's report of its restart dates the fault at its previous life's death.

    The new process says it was restarted only once it is up again (torch imported, seconds later); the
    previous one died when the kernel said its process exited or, where that cannot be read, after it last
    answered this link, the nearest measured time of the crash then.
    """
    for event in events:
        if event.kind == "trainer_restarted" and p.FAULT_AT not in event.details:
            event.details = {**event.details, p.Text(p.FAULT_AT): p.Text(f"{last_heard:.3f}")}
