"""Durations as operators write them in playbooks: ``90``, ``500ms``, ``60s``, ``5m``, ``1h``, ``2d``."""

from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")


def parse_duration(text: str | int | float) -> float:
    """Seconds in ``text``; raises ValueError with a one-line reason."""
    if isinstance(text, bool):
        raise ValueError("expected a duration such as 60s, 5m or 1h")
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError("a duration cannot be negative")
        return float(text)
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a duration: write it as 500ms, 60s, 5m, 1h or 2d")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def format_duration(seconds: float) -> str:
    """The shortest readable form: ``90s`` -> ``1m30s``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    whole = int(round(seconds))
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if whole >= size:
            parts.append(f"{whole // size}{unit}")
            whole %= size
    return "".join(parts) or "0s"
