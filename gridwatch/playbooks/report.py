"""Plain-text and JSON renderings of plans and incidents, for dry-run and replay."""

from __future__ import annotations

from typing import Any

import msgspec

from gridwatch.playbooks.plans import Incident, Plan, PlannedStep
from gridwatch.playbooks.replay import ReplayResult


def step_json(step: PlannedStep, start: float | None = None) -> dict[str, Any]:
    """One planned step as replay --json prints it."""
    row: dict[str, Any] = {
        "incident": step.incident, "playbook": step.playbook, "step": step.step, "index": step.index,
        "target": step.target, "nodes": step.nodes, "at": step.at, "decision": step.decision,
    }
    if start is not None:
        row["offset"] = round(step.at - start, 3)
    if step.reason:
        row["reason"] = step.reason
    if step.confirm:
        row["confirm"] = True
    if step.step == "restart_from_checkpoint":
        row["checkpoint"] = step.checkpoint
        if step.checkpoint == "before":
            row["before_ts"], row["before_step"] = step.before_ts, step.before_step
        if step.checkpoint_step is not None:
            row["checkpoint_step"] = step.checkpoint_step
    return row


def json_lines(result: ReplayResult) -> list[str]:
    return [msgspec.json.encode(step_json(s, result.start)).decode() for p in result.plans for s in p.steps]


def _when(at: float, start: float | None) -> str:
    return f"+{at - start:.1f}s" if start is not None else f"{at:.3f}"


def plan_text(plan: Plan, start: float | None = None) -> list[str]:
    inc = plan.incident
    lines = [f"{_when(inc.opened_at, start)}  incident {inc.id} [{inc.severity}] {inc.summary}"]
    if plan.steps:
        lines[-1] += f"  (planned at {_when(plan.steps[0].at, start)})"
    width = max((len(s.step) for s in plan.steps), default=0)
    for s in plan.steps:
        where = s.target + (f" ({', '.join(s.nodes)})" if s.target == "job" else "")
        line = f"    {s.index + 1}. {s.step:<{width}}  {where:<20} {s.decision}"
        if s.step == "restart_from_checkpoint":
            line += "  (newest valid checkpoint)" if s.checkpoint == "newest" else (
                f"  (last checkpoint before {_when(s.before_ts or 0.0, start)}"
                + (f", step {s.before_step})" if s.before_step is not None else ")"))
            if s.checkpoint_step is not None:
                line += f" -> step {s.checkpoint_step}"
        if s.reason:
            line += f"  - {s.reason}"
        lines.append(line)
    return lines


def incident_text(inc: Incident, start: float | None = None) -> str:
    text = f"  {inc.id}: {inc.state}, {inc.symptoms} symptom{'s' if inc.symptoms != 1 else ''}"
    if inc.reporters:
        text += f" from {', '.join(sorted(inc.reporters))}"
    if inc.merged_into:
        text += f"; merged into {inc.merged_into}"
    if inc.recovered_at is not None:
        text += f"; recovered at {_when(inc.recovered_at, start)}"
    return text


def replay_text(result: ReplayResult, source: str) -> list[str]:
    stats = result.stats
    lines = [f"replayed {result.replayed} frames of {stats.lines} lines from {source}; {stats.describe()}"]
    if result.start is not None and result.end is not None:
        lines.append(f"trace time {result.start:.3f} to {result.end:.3f} ({result.end - result.start:.1f}s)")
    for plan in result.plans:
        lines.extend(plan_text(plan, result.start))
    if not result.plans:
        lines.append("no playbook fired")
    if result.incidents:
        lines.append(f"incidents ({len(result.incidents)}):")
        lines.extend(incident_text(i, result.start) for i in result.incidents)
    return lines
