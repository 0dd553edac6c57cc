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
    known = [v for v in points if not math.isnan(v)]
    if not known:
        return " " * width
    low = min(known) if lo is None else lo
    high = max(known) if hi is None else hi
    span = high - low
    top = len(BLOCKS) - 1
    chars = []
    for v in points:
        if math.isnan(v):
            chars.append(" ")
        elif span <= 0:
            chars.append(BLOCKS[0])
        else:
            chars.append(BLOCKS[min(max(int((v - low) / span * top + 0.5), 0), top)])
    return " " * (width - len(chars)) + "".join(chars)
