"""Training progress as the demo sees it: rank 0's metrics file, tailed and stamped on arrival."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class StepPoint:
    at: float  # when the demo saw the line
    step: int


@dataclass
class TrainingWatch:
    """Reads new lines of ``metrics.jsonl`` on each ``poll``; a missing or partial file is waited for."""

    path: Path
    clock: Callable[[], float]
    points: list[StepPoint] = field(default_factory=list)
    _offset: int = 0
    _partial: bytes = b""

    def poll(self) -> list[StepPoint]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            return []
        if not data:
            return []
        self._offset += len(data)
        data, self._partial = self._partial + data, b""
        lines = data.split(b"\n")
        self._partial = lines.pop()  # the last piece has no newline yet (or is empty)
        now = self.clock()
        new = []
        for line in lines:
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue  # a line rank 0 did not finish or a format we do not know: not progress
            new.append(StepPoint(now, step))
        self.points.extend(new)
        return new

    @property
    def last_step(self) -> int | None:
        return self.points[-1].step if self.points else None
