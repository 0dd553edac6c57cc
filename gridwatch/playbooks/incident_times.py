"""An incident's times: to detect (from the fault to the incident) and to recover (to the job training past it),
and the phase of its life they put it in."""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    """Where an incident is in its life: open -> acting -> recovered -> resolved.

    Derived from what the store records (a step that changed something done, the job training past the fault,
    the incident closed), never kept apart from it, so the views, ``/metrics`` and the alerts cannot disagree.
    An operator's acknowledgement or silence is a mark beside it, not a phase.
    """

    OPEN = "open"  # detected; nothing has changed anything yet
    ACTING = "acting"  # a step that changes something ran (isolate, drain, requeue, restart...)
    RECOVERED = "recovered"  # the job trains past the step it was at when the fault came
    RESOLVED = "resolved"  # closed: by a person, by the plan, or taken over by a more severe incident


def incident_phase(state: str, acted_at: float | None, recovered_at: float | None) -> Phase:
    """The phase of an incident whose store state is ``state`` (open | acknowledged | silenced | resolved)."""
    if state == "resolved":
        return Phase.RESOLVED
    if recovered_at is not None:
        return Phase.RECOVERED
    if acted_at is not None:
        return Phase.ACTING
    return Phase.OPEN


def time_to_detect(fault_at: float | None, detected_at: float) -> float | None:
    """TTD: from the fault to the incident; None while the fault's time is unknown."""
    return None if fault_at is None else max(detected_at - fault_at, 0.0)


def time_to_recover(fault_at: float | None, recovered_at: float | None) -> float | None:
    """TTR: from the fault to the job training past the step it was at; None until both are known."""
    if fault_at is None or recovered_at is None:
        return None
    return max(recovered_at - fault_at, 0.0)
