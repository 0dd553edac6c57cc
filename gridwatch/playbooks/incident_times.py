"""An incident's times: to detect (from the fault to the incident) and to recover (to the job training past it)."""

from __future__ import annotations


def time_to_detect(fault_at: float | None, detected_at: float) -> float | None:
    """TTD: from the fault to the incident; None while the fault's time is unknown."""
    return None if fault_at is None else max(detected_at - fault_at, 0.0)


def time_to_recover(fault_at: float | None, recovered_at: float | None) -> float | None:
    """TTR: from the fault to the job training past the step it was at; None until both are known."""
    if fault_at is None or recovered_at is None:
        return None
    return max(recovered_at - fault_at, 0.0)
