"""The log query language: the Logs view's one-line query, parsed, and the lines it keeps."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import tzinfo

from gridwatch.console.fleet import logtime
from gridwatch.sshlink.hostlist import HostlistError, expand
from gridwatch.wire.protocol import SEVERITIES, Severity
from gridwatch.wire.protocol import severity_rank as _known_rank

# ------------------------------------------------------------------------ log query


class QueryError(ValueError):
    """A logs query that cannot be used; the message says which part and why."""


@dataclass(slots=True)
class LogQuery:
    """``node:node[01-04] sev:error since:10m until:2m <regex>`` parsed; since/until may be absolute times too."""

    nodes: list[str] | None = None
    min_severity: str | None = None
    since_s: float | None = None  # seconds back from now
    until_s: float | None = None
    pattern: re.Pattern[str] | None = None
    since_at: float | None = None  # an absolute time (``since:03:10``), seconds since the epoch
    until_at: float | None = None

    @property
    def regex(self) -> str:
        return self.pattern.pattern if self.pattern else ""

    def window(self, now: float) -> tuple[float | None, float | None]:
        """(since, until) in seconds since the epoch at ``now``; None where the query sets no bound."""
        since = self.since_at if self.since_at is not None else (
            now - self.since_s if self.since_s is not None else None)
        until = self.until_at if self.until_at is not None else (
            now - self.until_s if self.until_s is not None else None)
        return since, until


_QUERY_TOKEN = re.compile(r'(\w+):"([^"]*)"|\S+')  # key:"a value with spaces", or a word


def parse_log_query(text: str, now: float | None = None, zone: tzinfo | None = None) -> LogQuery:
    """Parse the Logs view's one-line query; raises :class:`QueryError` with a one-line reason.

    ``since``/``until`` take a duration back from now or an absolute time in
    ``zone`` (default: the console's), read against ``now`` (default: the wall clock).
    """
    query = LogQuery()
    words: list[str] = []
    for found in _QUERY_TOKEN.finditer(text):
        token = found.group(0)
        key, sep, value = token.partition(":")
        if found.group(1) is not None:
            value = found.group(2)
        if sep and key in ("since", "until"):
            try:
                bound = logtime.parse_time(value, time.time() if now is None else now,
                                           zone or logtime.console_zone())
            except logtime.TimeError as exc:
                raise QueryError(f"{key}: {exc}") from None
            if key == "since":
                query.since_s, query.since_at = bound.ago_s, bound.at
            else:
                query.until_s, query.until_at = bound.ago_s, bound.at
            continue
        if sep and key in ("node", "nodes"):
            try:
                query.nodes = expand(value)
            except HostlistError as exc:
                raise QueryError(f"node set: {exc}") from None
        elif sep and key in ("sev", "severity"):
            if value not in SEVERITIES:
                raise QueryError(f"severity {value!r} is not one of {', '.join(SEVERITIES)}")
            query.min_severity = value
        else:
            words.append(token)
    since, until = query.window(time.time() if now is None else now)
    if since is not None and until is not None and until < since:
        raise QueryError("until is before since: the range holds no time")
    if words:
        try:
            query.pattern = re.compile(" ".join(words), re.IGNORECASE)
        except re.error as exc:
            raise QueryError(f"bad regular expression: {exc}") from None
    return query


def severity_rank(severity: str) -> int:
    """The playbooks' ranking, except that an unknown severity from a newer agent ranks as a warning: shown, not dropped."""
    rank = _known_rank(severity)
    return rank if rank >= 0 else _known_rank(Severity.WARNING)


@dataclass(slots=True)
class LogEntry:
    """One line of the Logs view: an event or a log line, merged by time."""

    ts: float
    node: str
    severity: str
    source: str
    text: str
    is_event: bool


def matches(
    entry: LogEntry,
    nodes: set[str] | None,
    min_rank: int | None,
    since: float | None,
    until: float | None,
    pattern: re.Pattern[str] | None,
) -> bool:
    if nodes is not None and entry.node not in nodes:
        return False
    if min_rank is not None and severity_rank(entry.severity) < min_rank:
        return False
    if since is not None and entry.ts < since:
        return False
    if until is not None and entry.ts > until:
        return False
    return pattern is None or bool(pattern.search(entry.text) or pattern.search(entry.source))
