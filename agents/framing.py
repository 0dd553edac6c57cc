"""Split a byte stream into frame lines without ever buffering an oversized one."""

from __future__ import annotations

from agents.protocol import MAX_FRAME_BYTES


class LineBuffer:
    """Feed bytes, get complete lines back.

    A line longer than ``limit`` is dropped whole (up to its newline) and
    counted in ``oversized``; memory held never exceeds ``limit`` plus one chunk.
    """

    def __init__(self, limit: int = MAX_FRAME_BYTES) -> None:
        self.limit = limit
        self.oversized = 0
        self._buf = bytearray()
        self._skipping = False

    def feed(self, data: bytes) -> list[bytes]:
        lines: list[bytes] = []
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            if self._skipping:
                self._skipping = False
            elif len(self._buf) + (nl - start) > self.limit:
                self.oversized += 1
            else:
                self._buf += data[start:nl]
                lines.append(bytes(self._buf))
            self._buf.clear()
            start = nl + 1
        rest = data[start:]
        if not self._skipping:
            if len(self._buf) + len(rest) > self.limit:
                self.oversized += 1
                self._skipping = True
                self._buf.clear()
            else:
                self._buf += rest
        return lines

    @property
    def pending(self) -> int:
        """Bytes of an unfinished line (a peer that died mid-frame leaves some)."""
        return len(self._buf)
