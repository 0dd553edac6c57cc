"""Detectors: one log line in, the event it reports (XID, NCCL, CUDA, kernel, ...) or None out.

Each module holds the detectors of one family of writers, a ``PREFILTER``
pattern of the words its lines must contain, and its ``DETECTORS`` in order.
"""

from __future__ import annotations

import re

from agents.detectors import kernel, trainer
from agents.detectors.common import MESSAGE_CHARS, Detector
from agents.protocol import Event

__all__ = ["MESSAGE_CHARS", "detect"]

# Kernel and driver lines first: a driver line quoted by a trainer is the driver's fault.
_FAMILIES = (kernel, trainer)

# Most lines match nothing; each family's alternation of plain words rejects them
# before any specific pattern runs. Searched one family at a time: measured faster
# than one joined alternation, whose branches no longer start with a plain character.
_PREFILTERS = tuple(re.compile(family.PREFILTER) for family in _FAMILIES)
_DETECTORS: tuple[Detector, ...] = tuple(d for family in _FAMILIES for d in family.DETECTORS)


def detect(line: str, source: str = "", ts: float = 0.0) -> Event | None:
    """The event a log line reports, or ``None`` for an ordinary line.

    ``source`` is the log's path (the event's source becomes ``log:<path>``);
    ``ts`` is when the line was read. The event's ``seq`` and ``node`` are left
    for the sampler to fill in.
    """
    if not any(prefilter.search(line) for prefilter in _PREFILTERS):
        return None
    for detector in _DETECTORS:
        event = detector(line, source, ts)
        if event is not None:
            return event
    return None
