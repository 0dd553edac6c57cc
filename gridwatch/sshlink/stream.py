"""One gridwatch channel read by callback: each chunk that arrives is split into lines and handed over at once.

asyncssh's process streams buffer a chunk, set a future and wake the task awaiting ``read()``:
a future, a task step and a coroutine resumed per message, on a console that receives a message per node
every few seconds from thousands of nodes. Here the channel's own ``data_received`` feeds the line buffer
and calls the handler in the same call, and the coroutine that owns the link waits only for its end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import asyncssh

from gridwatch.wire.framing import LineBuffer

STDERR_KEPT = 4096  # what the far end said on stderr, for the sentence when it closes before its hello


class Channel(Protocol):
    """What a stream writes to and closes: asyncssh's channel, or a libssh2 link (gridwatch.sshlink.lean)."""

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class LineStream(asyncssh.SSHClientSession[bytes]):
    """A channel's stdout as lines to ``handler``; ``closed`` ends when the channel does.

    The first lines wait in :attr:`early` until a handler is set (the caller reads the hello from them).
    ``closed`` ends with None when the far end closed the channel, or raises why it was lost; a handler
    that raises closes the channel, and ``closed`` raises what it raised: the owner's coroutine sees the
    failure as it would have from a read.
    """

    def __init__(self) -> None:
        self.lines = LineBuffer()
        self.early: list[bytes] = []
        self.stderr = bytearray()
        self.handler: Callable[[bytes], None] | None = None
        self.on_oversized: Callable[[int], None] | None = None
        self.on_chunk: Callable[[], None] | None = None  # each chunk received, once a handler is set
        self.channel: Channel | None = None
        loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = loop.create_future()
        self._first: asyncio.Future[None] = loop.create_future()

    # ------------------------------------------------------------ asyncssh's callbacks

    def connection_made(self, chan: Channel) -> None:
        self.channel = chan

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if datatype is not None:
            room = STDERR_KEPT - len(self.stderr)
            if room > 0:
                self.stderr += data[:room]
            return
        received = self.lines.feed(data)
        if self.lines.oversized:
            count, self.lines.oversized = self.lines.oversized, 0
            if self.on_oversized is not None:
                self.on_oversized(count)
        if not received:
            return
        handler = self.handler
        if handler is None:
            self.early += received
            if not self._first.done():
                self._first.set_result(None)
            return
        if self.on_chunk is not None:
            self.on_chunk()
        try:
            for line in received:
                handler(line)
        except Exception as exc:  # noqa: BLE001 - the link's owner handles it, as it would a failed read
            self._end(exc)
            if self.channel is not None:
                self.channel.close()

    def eof_received(self) -> bool:
        return False  # the far end is done: close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc)

    # ------------------------------------------------------------ the owner's side

    async def first_lines(self) -> list[bytes]:
        """The first lines the far end sent (they stay in :attr:`early` until :meth:`start`, as do any that come
        after); none when it closed before any (``closed`` raises why, if it was lost rather than closed)."""
        await asyncio.wait({self._first, self.closed}, return_when=asyncio.FIRST_COMPLETED)
        if not self.early and self.closed.done():
            self.closed.result()
        return self.early

    def start(self, handler: Callable[[bytes], None]) -> None:
        """Hand every line to ``handler`` from now on, first those that came early and were not taken."""
        early, self.early = self.early, []
        self.handler = handler
        for line in early:
            handler(line)

    def write(self, data: bytes) -> None:
        if self.channel is None:
            raise ConnectionError("the stream is not open")
        self.channel.write(data)

    def _end(self, exc: BaseException | None) -> None:
        if not self.closed.done():
            if exc is None:
                self.closed.set_result(None)
            else:
                self.closed.set_exception(exc)
                self.closed.exception()  # retrieved: an owner that stopped waiting leaves no "never retrieved" warning
        if not self._first.done():
            self._first.set_result(None)
