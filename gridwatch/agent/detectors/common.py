"""What every detector shares: the event it builds from a line, and the rank a line names."""

from __future__ import annotations

import re
from collections.abc import Callable

from gridwatch.wire.protocol import Event, Text

MESSAGE_CHARS = 300

# One detector: (line, source, ts) -> the event the line reports, or None.
Detector = Callable[[str, str, float], Event | None]

# "[rank3]:", "[Rank 3]", "[PG 1 Rank 3]", "[PG ID 0 PG GUID 0(default_pg) Rank 3]", "rank=3", "Rank 3 Skipping".
_RANK = re.compile(r"\[(?:[^\]\[]*\s)?[Rr]ank ?(\d+)\]|\b[Rr]ank[ =:](\d+)\b")


def make_event(kind: str, severity: str, line: str, source: str, ts: float, **details: str) -> Event:
    """An event of ``kind`` for ``line`` read from ``source``; empty details are left out."""
    return Event(
        kind=Text(kind),
        severity=Text(severity),
        message=Text(line.strip()[:MESSAGE_CHARS]),
        source=Text(f"log:{source}"),
        ts=ts,
        details={k: Text(v) for k, v in details.items() if v},
    )


def rank_of(line: str) -> str:
    """The (global) rank a trainer line names (``[Rank 3]``, ``rank=3``), or ``""``; ``local_rank`` is not it."""
    match = _RANK.search(line)
    return (match.group(1) or match.group(2)) if match else ""
