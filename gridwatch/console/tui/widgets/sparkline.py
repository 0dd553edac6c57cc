"""Sparklines as plain strings of block characters, for history rings."""

from __future__ import annotations

import math

BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int, lo: float | None = None, hi: float | None = None) -> str:
    """The newest ``width`` values as block characters; N/A (NaN) is a blank, padded on the left.

    ``lo``/``hi`` fix the scale (0..100 for percentages) so two sparklines compare;
    without them the scale follows the data.
    """
    if width <= 0:
        return ""
    points = values[-width:]
    # Only finite readings are drawn: a node may send 1e308, whose span overflows to infinity.
    known = [v for v in points if math.isfinite(v)]
    if not known:
        return " " * width
    low = min(known) if lo is None else lo
    high = max(known) if hi is None else hi
    span = high - low
    top = len(BLOCKS) - 1
    chars = []
    for v in points:
        level = (v - low) / span * top + 0.5 if math.isfinite(v) and math.isfinite(span) and span > 0 else None
        if not math.isfinite(v):
            chars.append(" ")
        elif level is None or not math.isfinite(level):
            chars.append(BLOCKS[0] if span <= 0 or not math.isfinite(span) else BLOCKS[top if v > low else 0])
        else:
            chars.append(BLOCKS[min(max(int(level), 0), top)])
    return " " * (width - len(chars)) + "".join(chars)
