"""Times in the logs query: a duration back from now (``10m``) or a clock time or date in the console's time zone.

Durations are the playbooks' grammar (:mod:`gridwatch.playbooks.durations`). Absolute
times are ISO 8601: ``03:10``, ``03:10:30``, ``2026-12-01``,
``2026-12-01T03:10``, ``"2026-12-01 03:10:00"`` (quoted, for the space), and
any of those with an offset (``Z``, ``+01:00``). Without an offset a time is in
the console's zone: ``TZ`` when set, else the machine's. A time without a date
is today, or yesterday when today's would still be in the future.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from gridwatch.playbooks import durations

_CLOCK = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2})(\.\d+)?)?$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")
TIME_FORMS = '10m, 03:10, 2026-12-01T03:10 or "2026-12-01 03:10:00"'


class TimeError(ValueError):
    """A time the logs query cannot use; the message says what was written and how to write it."""


@dataclass(frozen=True, slots=True)
class TimeBound:
    """One end of a time range: ``ago_s`` seconds before now (moves with the clock), or the fixed time ``at``."""

    ago_s: float | None = None
    at: float | None = None

    def resolve(self, now: float) -> float:
        """Seconds since the epoch at ``now``."""
        if self.at is not None:
            return self.at
        return now - (self.ago_s or 0.0)


def console_zone() -> tzinfo:
    """The zone the console shows and reads times in: ``TZ`` when it names a zone, else the machine's."""
    name = os.environ.get("TZ", "").lstrip(":")
    if name:
        try:
            return ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            pass  # a POSIX rule such as "CET-1" is not a zone name: the C library's reading stands
    local = datetime.now().astimezone().tzinfo
    return local if local is not None else UTC


def zone_label(zone: tzinfo, at: float) -> str:
    """``UTC``, ``UTC+01:00`` or ``UTC-05:30``: the zone's offset at ``at``, as the screen says it."""
    offset = datetime.fromtimestamp(at, zone).utcoffset() or timedelta(0)
    if not offset:
        return "UTC"
    minutes = int(offset.total_seconds() // 60)
    sign = "+" if minutes >= 0 else "-"
    return f"UTC{sign}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"


def parse_time(text: str, now: float, zone: tzinfo) -> TimeBound:
    """``10m`` back from now, or the absolute time ``text`` names in ``zone``; :class:`TimeError` otherwise."""
    text = text.strip()
    if not text:
        raise TimeError(f"an empty time: write {TIME_FORMS}")
    if text[0].isdigit() and ":" not in text and "-" not in text:
        try:
            return TimeBound(ago_s=durations.parse_duration(text))
        except ValueError:
            raise TimeError(f"{text!r} is not a duration or a time: write {TIME_FORMS}") from None
    clock = _CLOCK.match(text)
    if clock:
        return TimeBound(at=_today_or_yesterday(clock, now, zone, text))
    if _DATE.match(text):
        try:
            when = datetime.fromisoformat(text.replace("z", "Z"))
        except ValueError:
            raise TimeError(f"{text!r} is not a date and time: write {TIME_FORMS}") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=zone)
        return TimeBound(at=when.timestamp())
    raise TimeError(f"{text!r} is not a duration or a time: write {TIME_FORMS}")


def _today_or_yesterday(match: re.Match[str], now: float, zone: tzinfo, text: str) -> float:
    hour, minute = int(match.group(1)), int(match.group(2))
    second = int(match.group(3) or 0)
    micro = int(float(match.group(4) or 0) * 1_000_000)
    try:
        at = time(hour, minute, second, micro)
    except ValueError:
        raise TimeError(f"{text!r} is not a time of day: write it as 03:10 or 03:10:30") from None
    today: date = datetime.fromtimestamp(now, zone).date()
    when = datetime.combine(today, at, tzinfo=zone).timestamp()
    # An operator at 00:20 asking for 23:50 means last night, not tonight.
    return when if when <= now else datetime.combine(today - timedelta(days=1), at, tzinfo=zone).timestamp()


def format_time(ts: float, zone: tzinfo) -> str:
    """``2026-12-01T03:10:00``: how the console writes an absolute time back into a query."""
    return datetime.fromtimestamp(ts, zone).strftime("%Y-%m-%dT%H:%M:%S")
