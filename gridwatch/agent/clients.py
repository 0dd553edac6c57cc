"""The agent's clients: each connected console's stream, its private replies, and the requests it may have running.

Sampling never waits on a client: frames go into the ring, and each client's writer reads from the ring at
its own pace; a client that stops reading its replies has its session closed with a reason.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from gridwatch.agent.base import AgentBase
from gridwatch.sshlink.server import Caller
from gridwatch.wire import protocol as p

# A client's private replies (action results, log lines) waiting to be sent. A
# console that lets more pile up is not reading: its session is closed with a
# reason (and the replies it missed are counted) rather than losing one silently
# or growing the agent's memory.
MAX_REPLIES = 2000
# ... and in bytes: a few replies can be large (a search answer is up to a frame, 1 MB).
MAX_REPLY_BYTES = 8 * p.MAX_FRAME_BYTES
# Actions and searches one session may have running at once.
MAX_PENDING = 16
# Frames written per wake-up, so one client catching up does not starve others.
WRITE_BATCH = 256


class Refusal(NamedTuple):
    """A request not run: why, in one sentence, and for a key over its budget when a token is back."""

    message: str
    retry_after: float | None = None


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


class Serving(AgentBase):
    """Clients connected and forgotten, their requests admitted, their streams written."""

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

    def resume_cursor(self, resume_from: int | None) -> int:
        """Where a subscription starts: live without a resume point, else within what this agent has sent."""
        if resume_from is None:
            return max(self.ring.last_seq - 1, 0)
        # A client cannot claim frames that were never sent, nor ones before the first.
        return min(max(resume_from, 0), self.ring.last_seq)

    def _admit(self, client: ClientStream, caller: Caller, what: str, budgeted: bool = True) -> Refusal | None:
        """None if ``caller``'s request may run now, else why not (one sentence for the client) and, when it is
        the key's budget, in how many seconds a token is back.

        A request not ``budgeted`` (a scene copy's chunk read, the copy's listing having paid) is held
        only by the session's running requests and its reply queue.
        """
        if client.pending >= MAX_PENDING:
            return Refusal(f"{what} refused: {MAX_PENDING} requests from this session are still running; "
                           "wait for their answers")
        if budgeted and not self.budgets.take(caller.key):
            self.refused_requests += 1
            held = self._refusal_log.allow()
            if held is not None:
                more = f" ({held} more refused since the last such line)" if held else ""
                self.log.warning("refused a {} from {}: over its request budget{}", what, caller, more)
            wait = self.budgets.bucket(caller.key).retry_after()
            return Refusal(
                f"{what} refused: this key is over its budget of {self.config.action_burst:g} requests at once "
                f"and {self.config.action_rate:g} a second; try again in {wait:.1f} s", wait)
        client.pending += 1
        return None

    async def _answer(self, client: ClientStream, work: Awaitable[p.Frame]) -> None:
        try:
            result = await work
        finally:
            client.pending -= 1
        client.reply(self.reply_frame(result))

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

