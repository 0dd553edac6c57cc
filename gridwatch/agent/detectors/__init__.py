"""Detectors: one log line in, the event it reports (XID, NCCL, CUDA, kernel, ...) or None out.

Each module holds the detectors of one family of writers, a ``PREFILTER``
pattern of the words its lines must contain, and its ``DETECTORS`` in order.
"""

from __future__ import annotations

import re

from gridwatch.agent.detectors import kernel, trainer
from gridwatch.agent.detectors.common import MESSAGE_CHARS, Detector
from gridwatch.wire.protocol import Event

__all__ = ["MESSAGE_CHARS", "detect"]

# Kernel and driver lines first: a driver line quoted by a trainer is the driver's fault.
_FAMILIES = (kernel, trainer)  # the kernel family first (and only from kernel sources: see detect)


def kernel_kind(line: str) -> bool:
    """Whether ``line`` reads as a kernel or driver fault (an application log that quotes one is not one)."""
    prefilter, detectors = _GATED[0]
    return bool(prefilter.search(line)) and any(d(line, "", 0.0) is not None for d in detectors)

# Most lines match nothing; each family's alternation of plain words rejects them
# before any specific pattern runs. Searched one family at a time: measured faster
# than one joined alternation, whose branches no longer start with a plain character.
# A family's detectors run only on lines its own prefilter let through.
_GATED: tuple[tuple[re.Pattern[str], tuple[Detector, ...]], ...] = tuple(
    (re.compile(family.PREFILTER), tuple(family.DETECTORS)) for family in _FAMILIES
)


def detect(line: str, source: str = "", ts: float = 0.0, kernel: bool = True) -> Event | None:
    """The event a log line reports, or ``None`` for an ordinary line.

    ``source`` is the log's path (the event's source becomes ``log:<path>``);
    ``ts`` is when the line was read. The event's ``seq`` and ``node`` are left
    for the sampler to fill in. ``kernel`` says the source is the kernel's own
    (kmsg, the journal's kernel transport, a named unit, a root-only kernel log
    file): only then may a line report a kernel, driver or NVSwitch fault, the
    kinds that take a node out. Any other log gives application kinds alone.
    """
    for prefilter, detectors in _GATED if kernel else _GATED[1:]:
        if not prefilter.search(line):
            continue
        for detector in detectors:
            event = detector(line, source, ts)
            if event is not None:
                return event
    return None
