"""The agent's recent frames, numbered, so a reconnecting console loses nothing."""

from __future__ import annotations

from collections import deque


class FrameRing:
    """A bounded buffer of encoded frames keyed by consecutive ``seq``.

    Frames are stored encoded: a frame is serialised once, however many
    clients read it.
    """

    def __init__(self, capacity: int = 3600) -> None:
        if capacity < 1:
            raise ValueError("ring capacity must be at least 1")
        self.capacity = capacity
        self._frames: deque[bytes] = deque(maxlen=capacity)
        self._first = 1  # seq of _frames[0]
        self.last_seq = 0

    @property
    def first_seq(self) -> int:
        """Oldest seq still held (``last_seq + 1`` when empty)."""
        return self._first if self._frames else self.last_seq + 1

    def append(self, data: bytes) -> int:
        """Store one encoded frame that already carries seq ``last_seq + 1``."""
        if len(self._frames) == self.capacity:
            self._first += 1
        self._frames.append(data)
        self.last_seq += 1
        return self.last_seq

    def since(self, seq: int, limit: int | None = None) -> tuple[list[bytes], tuple[int, int] | None]:
        """Frames after ``seq``; and the (from, to) range lost if ``seq`` fell off the end."""
        gap = None
        first = self.first_seq
        if seq + 1 < first:
            gap = (seq + 1, first - 1)
            seq = first - 1
        start = seq + 1 - first
        if start >= len(self._frames):
            return [], gap
        end = len(self._frames) if limit is None else min(len(self._frames), start + limit)
        return [self._frames[i] for i in range(start, end)], gap
