"""What the engine hands out: incidents, and the planned steps of each with their guard decisions."""

from __future__ import annotations

from typing import Literal

import msgspec

Decision = Literal["act", "skip", "escalate", "needs_confirmation"]
DECISIONS: tuple[str, ...] = ("act", "skip", "escalate", "needs_confirmation")
# A job-wide step names this as its target; ``nodes`` says where it is sent.
JOB_TARGET = "job"


class Incident(msgspec.Struct, kw_only=True):
    """One fault, however many symptoms it showed. ``node`` is the node acted on (the cause)."""

    id: str
    playbook: str
    kind: str
    severity: str
    scope: str
    node: str
    gpu: int | None = None
    job: str = ""
    summary: str = ""
    opened_at: float
    last_seen_at: float
    symptoms: int = 1
    reporters: list[str] = []  # nodes that reported a symptom of it
    state: str = "open"  # pending (gathering symptoms) | open | merged | closed
    merged_into: str | None = None
    supersedes: list[str] = []  # milder incidents on the same node this one took over; their plans stop
    recovered_at: float | None = None
    closed_at: float | None = None
    notes: list[str] = []  # what the engine decided about it, in order (for people: nothing parses them)
    symptom_step: int | None = None  # the training step its first symptom named, when it named one
    # The nodes the ranks' collective records name as the cause (the ranks that never entered the
    # collective the others wait in), and the sentence saying so; empty when no record was read.
    blamed: list[str] = []
    blame_why: str = ""


class PlannedStep(msgspec.Struct, kw_only=True):
    """One step of a plan with its target and the guards' decision."""

    id: str  # "<incident>/<index>": stable, so an executor never runs it twice
    incident: str
    playbook: str
    index: int
    step: str
    target: str  # node name as its agent reports it, or "job"
    nodes: list[str] = []  # where the step's action is sent
    at: float
    decision: str = "act"
    reason: str = ""
    confirm: bool = False
    timeout: float = 60.0
    continue_on_failure: bool = False
    scheduler: str | None = None
    checkpoint: str = "newest"
    before_ts: float | None = None  # restart from the last checkpoint before this time ...
    before_step: int | None = None  # ... or before this training step
    # A checkpoint step every node in ``nodes`` reported holding when planned
    # (newest, or newest below ``before_step``); None when they named none in common.
    checkpoint_step: int | None = None
    channel: str = "console"
    url: str | None = None
    command: list[str] = []
    message: str = ""
    condition: str | None = None


class Plan(msgspec.Struct, kw_only=True):
    """An incident and the steps planned for it, in order."""

    incident: Incident
    steps: list[PlannedStep] = []
