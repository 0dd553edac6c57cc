"""What every detector shares: the event it builds from a line, the rank a line names, and a log's open report."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

from gridwatch.wire.protocol import Event, Text

MESSAGE_CHARS = 300

# One detector: (line, source, ts) -> the event the line reports, or None.
Detector = Callable[[str, str, float], Event | None]

# "[rank3]:", "[Rank 3]", "[PG 1 Rank 3]", "[PG ID 0 PG GUID 0(default_pg) Rank 3]", "rank=3", "Rank 3 Skipping".
_RANK = re.compile(r"\[(?:[^\]\[]*\s)?[Rr]ank ?(\d+)\]|\b[Rr]ank[ =:](\d+)\b")


def by_first_character(prefilter: str) -> str:
    """``prefilter``'s top-level alternatives grouped by their first character: "NCCL WARN|NVRM|..." becomes
    "N(?:CCL WARN|VRM)|...". It matches the same lines; the engine tries one branch per first character
    instead of every branch at every position (measured twice as fast on ordinary lines)."""
    branches: list[str] = []
    depth, in_class, start, i = 0, False, 0, 0
    while i < len(prefilter):
        char = prefilter[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "|" and depth == 0:
            branches.append(prefilter[start:i])
            start = i + 1
        i += 1
    branches.append(prefilter[start:])
    groups: dict[str, list[str]] = {}
    for branch in branches:
        # A branch that starts with an escape keeps it whole ("\]"); one that starts with a class, a group or
        # a quantified character (none should: see the families' notes) is left as it is.
        first = branch[:2] if branch.startswith("\\") else branch[:1]
        if first in ("", "(", "[", ".") or branch[len(first) : len(first) + 1] in ("?", "*", "+", "{"):
            first = ""
        groups.setdefault(first, []).append(branch[len(first):])
    parts = []
    for first, rests in groups.items():
        if not first:
            parts.extend(rests)
        else:
            parts.append(first + (rests[0] if len(rests) == 1 else "(?:" + "|".join(rests) + ")"))
    return "|".join(parts)


# A report that spans lines (a torchelastic failure table, a C++ abort and its what()) is
# one event: the detector remembers, per log, what the earlier lines said until the line
# that completes it. Bounded, so logs that open reports and never finish them cannot grow it.
OPEN_REPORTS_MAX = 1024
V = TypeVar("V")


def remember(memory: dict[str, V], source: str, value: V) -> None:
    """Keep ``value`` for ``source``'s open report; past the bound the oldest logs are forgotten."""
    if source not in memory and len(memory) >= OPEN_REPORTS_MAX:
        memory.pop(next(iter(memory)))
    memory[source] = value


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
