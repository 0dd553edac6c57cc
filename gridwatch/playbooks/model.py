"""What a playbook is once loaded: a trigger, a scope, an ordered plan and its guards."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from gridwatch.playbooks.metrics import MetricCondition
from gridwatch.wire.protocol import STALE_AFTER_INTERVALS

Scope = Literal["gpu", "node", "job"]
SCOPES: tuple[str, ...] = ("gpu", "node", "job")


# Steps a plan may hold, in the operator's words. The executor maps each to an
# agent action (gridwatch.wire.protocol.ACTIONS), a scheduler command or a notification.
STEP_NAMES: tuple[str, ...] = (
    "capture_scene",
    "checkpoint_now",
    "reset_gpu",
    "isolate_node",
    "drain_node",
    "requeue_job",
    "restart_from_checkpoint",
    "pause_training",
    "notify",
    "wait_for",
    "escalate",
)
# Steps that take a node out of the job: they count against the blast radius.
REMOVING_STEPS: frozenset[str] = frozenset({"isolate_node", "drain_node"})
# Steps that change something; a guard that stops a plan stops these and lets
# the harmless ones (keeping the scene, telling people) go ahead.
ACTING_STEPS: frozenset[str] = frozenset(
    {"checkpoint_now", "isolate_node", "drain_node", "requeue_job", "restart_from_checkpoint", "pause_training",
     "reset_gpu"}
)
# Steps the workload scheduler runs (gridwatch.playbooks.scheduler, gridwatch.playbooks.jobs), not an agent.
SCHEDULER_STEPS: frozenset[str] = frozenset({"drain_node", "requeue_job"})
# Steps that act on one GPU, the incident's: their playbook must have scope gpu.
GPU_STEPS: frozenset[str] = frozenset({"reset_gpu"})
# Steps that act on the whole job: sent to every live node that is not isolated.
JOB_STEPS: frozenset[str] = frozenset({"checkpoint_now", "restart_from_checkpoint", "pause_training"})


class SchedulerKind(StrEnum):
    """Which workload scheduler ``drain_node`` tells (``scheduler =`` in cluster.toml, ``--scheduler``)."""

    NONE = "none"
    SLURM = "slurm"
    KUBERNETES = "kubernetes"


SCHEDULERS: tuple[str, ...] = tuple(kind.value for kind in SchedulerKind)
CONDITIONS: tuple[str, ...] = ("heartbeat_lost", "stack_mismatch")
WAIT_CONDITIONS: tuple[str, ...] = ("heartbeat", "isolated", "training", "checkpoint")
TARGETS: tuple[str, ...] = ("self", "cause")


@dataclass(frozen=True)
class EventTrigger:
    """Fires on agent events of ``kinds`` that pass every matcher, ``count`` times within ``within``.

    Counting is per target scope (the node a ``detail:`` target names, not the
    node that reported it). ``distinct`` names a details key: reports with the
    same value count once (every rank reports the same slow step). ``hold``
    (``for:``) asks that the counted reports span at least that long, and
    ``share`` that they cover at least that fraction of the ``distinct`` values
    (training steps) between the first and the last: persistent, not a burst.
    """

    kinds: frozenset[str]
    codes: frozenset[int] = frozenset()
    severities: frozenset[str] = frozenset()
    message: re.Pattern[str] | None = None
    details: tuple[tuple[str, re.Pattern[str]], ...] = ()
    count: int = 1
    within: float = 0.0
    distinct: str | None = None
    hold: float = 0.0
    share: float | None = None
    # An XID's resolution (gridwatch.wire.xid.XidResolution names) and blame (XidBlame), per NVIDIA's catalogue.
    resolutions: frozenset[str] = frozenset()
    blames: frozenset[str] = frozenset()


@dataclass(frozen=True)
class MetricTrigger:
    """Fires when a metric condition has held for its window."""

    condition: MetricCondition


@dataclass(frozen=True)
class LogTrigger:
    """Fires on a log line (or an event message) matching ``pattern``."""

    pattern: re.Pattern[str]
    source: re.Pattern[str] | None = None
    count: int = 1
    within: float = 0.0


@dataclass(frozen=True)
class ConditionTrigger:
    """Conditions the console computes itself: a lost heartbeat, a stack that differs."""

    condition: str
    missed: float = STALE_AFTER_INTERVALS  # heartbeat lost after this many hello intervals without a frame


Trigger = EventTrigger | MetricTrigger | LogTrigger | ConditionTrigger


@dataclass(frozen=True)
class Step:
    """One step of a plan. Only the fields its ``action`` uses are set."""

    action: str
    confirm: bool = False
    timeout: float = 60.0
    continue_on_failure: bool = False
    line: int = 0
    # drain_node
    scheduler: str | None = None  # None: the executor's configured backend
    # restart_from_checkpoint: "newest", or "before" the incident's first event
    checkpoint: str = "newest"
    # notify / escalate
    channel: str = "console"  # console | webhook | command
    url: str | None = None
    command: tuple[str, ...] = ()
    message: str = ""
    # wait_for
    condition: str | None = None


class HistoryRuleName(StrEnum):
    """Rules over a node's and a GPU's history (``guards.history``; gridwatch.playbooks.history decides them)."""

    SAME_GPU = "same_gpu"  # the same GPU failing again within the window: hardware, keep it out
    SAME_XID = "same_xid"  # the same XID on different GPUs of one node: software or the application
    REMEDIATIONS = "remediations"  # this many remediations of one node within the window: no return by itself


@dataclass(frozen=True)
class HistoryRule:
    """One history rule of a playbook; ``shadow`` records what it would decide and changes nothing."""

    name: HistoryRuleName
    times: int  # same_gpu: incidents on the GPU; same_xid: distinct GPUs; remediations: remediations
    window: float
    shadow: bool = False
    then: tuple[Step, ...] = ()  # same_gpu: the plan instead (the hardware inspection plan by default)


@dataclass(frozen=True)
class Guards:
    """What keeps a playbook from doing harm when it fires too often or too widely."""

    cooldown: float = 0.0  # per scope: no new action on the same GPU/node/job within this
    blast_max_nodes: int | None = None  # at most this many nodes removed within the window
    blast_max_fraction: float | None = None  # ... or this fraction of the job's nodes
    blast_window: float = 3600.0
    rate_max: int | None = None  # at most this many acting incidents of this playbook ...
    rate_window: float = 3600.0  # ... within this window
    repeat_max: int | None = None  # the same fix on the same scope this many times: escalate
    repeat_window: float = 86400.0
    # The same XID back on the same scope after ``repeat_max`` earlier plans let this step act
    # (a reset_gpu): plan ``repeat_then`` instead (hardware inspection), not the fix again.
    repeat_after: str | None = None
    repeat_then: tuple[Step, ...] = ()
    history: tuple[HistoryRule, ...] = ()  # rules over the node's and GPU's history (gridwatch.playbooks.history)


@dataclass(frozen=True)
class Playbook:
    name: str
    trigger: Trigger
    plan: tuple[Step, ...]
    scope: str = "node"
    severity: str = "warning"
    description: str = ""
    guards: Guards = field(default_factory=Guards)
    target: str = "self"  # self | cause | detail:<key>
    settle: float = 0.0  # gather symptoms this long before planning
    dedup_window: float = 600.0  # an open incident absorbs new symptoms until quiet this long
    replaces: str | None = None  # the shipped playbook this one is used instead of
    # ``consequence_of: {events: [...], within: 2m}``: this symptom on a node where an incident of one of
    # these event kinds opened that recently is that fault's consequence (a worker killed by its XID): it
    # joins that incident rather than opening one of its own.
    consequence_of: tuple[str, ...] = ()
    consequence_within: float = 120.0
    # ``blame: collectives``: the ranks' collective records, when they name a culprit, decide the node
    # acted on (before the "one silent node" rule), and ``on_blame`` (if given) is the plan then.
    blame: bool = False
    blame_plan: tuple[Step, ...] = ()
    source: str = ""
    line: int = 0

    @property
    def removes_nodes(self) -> bool:
        """A node-fault playbook: its incidents are causes other symptoms attach to."""
        return any(s.action in REMOVING_STEPS for s in self.plan)

    @property
    def kind(self) -> str:
        trig = self.trigger
        if isinstance(trig, EventTrigger):
            return "/".join(sorted(trig.kinds))
        if isinstance(trig, MetricTrigger):
            return trig.condition.metric
        if isinstance(trig, LogTrigger):
            return "log"
        return trig.condition
