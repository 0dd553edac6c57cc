"""Split a byte stream into frame lines without ever buffering an oversized one."""

from __future__ import annotations

from gridwatch.wire.protocol import MAX_FRAME_BYTES


class LineBuffer:
    """Feed bytes, get complete lines back.

    A line longer than ``limit`` is counted in ``oversized`` and dropped up to
    its newline, or with ``keep_prefix`` cut to its first ``limit`` bytes (a log
    line is worth keeping clipped; a frame is not). Memory held never exceeds
    ``limit`` plus one chunk.
    """

    def __init__(self, limit: int = MAX_FRAME_BYTES, keep_prefix: bool = False) -> None:
        self.limit = limit
        self.keep_prefix = keep_prefix
        self.oversized = 0
        self._buf = bytearray()
        self._skipping = False

    def feed(self, data: bytes) -> list[bytes]:
        lines: list[bytes] = []
        start = 0
        while True:
            nl = data.find(b"\n", start)
            end = len(data) if nl < 0 else nl
            if self._skipping:
                self._skipping = nl < 0
            else:
                self._buf += data[start:end]
                if len(self._buf) > self.limit:
                    self.oversized += 1
                    if self.keep_prefix:
                        lines.append(bytes(self._buf[: self.limit]))
                    self._buf.clear()
                    self._skipping = nl < 0  # the rest of this line is still to come
                elif nl >= 0:
                    lines.append(bytes(self._buf))
                    self._buf.clear()
            if nl < 0:
                return lines
            start = nl + 1

    def flush(self) -> list[bytes]:
        """The unfinished last line, if any (its writer is gone), and a fresh start."""
        tail = [bytes(self._buf)] if self._buf and not self._skipping else []
        self._buf.clear()
        self._skipping = False
        return tail

    @property
    def pending(self) -> int:
        """Bytes of an unfinished line (a peer that died mid-frame leaves some)."""
        return len(self._buf)
