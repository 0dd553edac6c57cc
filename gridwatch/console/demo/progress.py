"""Training progress as the demo sees it: rank 0's metrics file, tailed across the trainer's rewrites."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class StepPoint:
    at: float  # when rank 0 finished the step (its "time"), else when the demo read the line
    step: int
    world: int | None = None  # how many nodes trained that step


@dataclass
class TrainingWatch:
    """Reads new lines of ``metrics.jsonl`` on each ``poll``; a missing or partial file is waited for.

    The trainer rewrites the file when it restores a checkpoint (later steps are
    dropped, to be recomputed); the watch notices the new file and keeps the
    history it already had, so redone steps show as a step going back.
    """

    path: Path
    clock: Callable[[], float]
    points: list[StepPoint] = field(default_factory=list)
    _offset: int = 0
    _inode: int | None = None
    _partial: bytes = b""

    def poll(self) -> list[StepPoint]:
        try:
            with self.path.open("rb") as fh:
                st = os.fstat(fh.fileno())
                if st.st_ino != self._inode or st.st_size < self._offset:
                    self._inode, self._offset, self._partial = st.st_ino, 0, b""
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            return []
        if not data:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # the last piece has no newline yet (or is empty)
        last_at = self.points[-1].at if self.points else float("-inf")
        now = self.clock()
        new = []
        for line in lines:
            try:
                record = json.loads(line)
                step = int(record["step"])
                at = float(record.get("time", now))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a line cut short by a kill, or a format we do not know: not progress
            if at <= last_at and "time" in record:
                continue  # kept from before a rewrite: already seen
            world = record.get("world_size")
            new.append(StepPoint(at, step, int(world) if isinstance(world, int) else None))
            last_at = max(last_at, at)
        self.points.extend(new)
        return new

    @property
    def last_step(self) -> int | None:
        return self.points[-1].step if self.points else None
