"""The names that travel in frames: severities, event kinds, agent actions and action result codes.

Every end keys on these; none spells them again (DESIGN.md: names that travel are enums in the wire).
"""

from __future__ import annotations

from enum import StrEnum


class Severity(StrEnum):
    """How bad an event is, mildest first: what playbooks rank and the Logs view filters by."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


SEVERITIES: tuple[str, ...] = tuple(s.value for s in Severity)


def severity_rank(severity: str) -> int:
    """Higher is worse; a severity this version does not know ranks below every known one."""
    return SEVERITIES.index(severity) if severity in SEVERITIES else -1


EVENT_KINDS: frozenset[str] = frozenset(
    {
        "xid",
        "ecc_sbe",
        "ecc_dbe",
        "row_remap_failure",
        "nvlink_error",
        "fell_off_bus",
        "gpu_hang",
        "thermal",
        "power_throttle",
        "nccl_error",
        "nccl_timeout",
        "traceback",
        "oom",
        "nan_loss",
        "cuda_error",
        "worker_failed",
        "process_crash",  # a C++ abort, or a crash inside NCCL or CUDA
        "loss_spike",
        "straggler",
        "trainer_exit",
        "trainer_left",
        "trainer_kept_out",  # an isolated node's trainer found in the job again, told to leave
        "trainer_restarted",
        "trainer_rejoined",  # a trainer that had left the job (its node out) started again: a return, not a crash
        "trainer_hang",
        "membership",
        "checkpoint",
        "isolated",
        "unisolated",
        "action",
        "patrol_failed",
        "patrol_recovered",
        "fault_injected",
        "source_failed",
        "source_recovered",
        # HCA ports (gridwatch/agent/sources/ib/).
        "ib_link_down",  # a port left ACTIVE, or its link_downed counter grew
        "ib_link_up",
        "ib_link_flap",  # down 25 s or more and back, three times (gpud's rule)
        "ib_errors",  # an error counter grows faster than the configured rate
        "ib_unreadable",  # a sysfs file of a port vanished or holds garbage
        # From the kernel and driver log (agents/detectors/kernel.py).
        "gsp_error",
        "nvswitch_sxid",
        "fabric_manager",
        "gpu_init_failure",
        "peermem_error",
        "nic_link_down",
        "pcie_aer",
        "edac_memory",
        "hung_task",
        "soft_lockup",
        "oom_killer",
        "kernel_panic",
        "disk_io_error",
        "machine_check",
        "nic_error",
        # A metric condition a console asked the agent to watch (Subscribe.watches).
        "condition_held",
        "condition_cleared",
    }
)


class AgentAction(StrEnum):
    """What a console may ask an agent to do (an Action frame's ``action``); each member equals its name on the wire.

    The frame's field stays text: an agent answers a name it does not know with a failed ActionResult
    that says so, rather than the frame being refused whole.
    """

    INJECT_FAULT = "inject_fault"
    CLEAR_FAULTS = "clear_faults"
    ISOLATE = "isolate"
    UNISOLATE = "unisolate"
    RESET_GPU = "reset_gpu"
    CHECKPOINT_NOW = "checkpoint_now"
    PAUSE = "pause"
    RESUME = "resume"
    LEAVE = "leave"
    RESTART_FROM = "restart_from"
    CAPTURE_SCENE = "capture_scene"
    PREFLIGHT = "preflight"
    PING = "ping"
    DUMP_COLLECTIVES = "dump_collectives"
    RAS_STATUS = "ras_status"
    READ_SCENE = "read_scene"


# Plain strings, as an Action frame's text field holds them.
ACTIONS: frozenset[str] = frozenset(a.value for a in AgentAction)
# Actions a viewer may send: they read, they change nothing (a viewer's collective dump is shorter).
VIEWER_ACTIONS: frozenset[str] = frozenset(
    a.value for a in (AgentAction.PING, AgentAction.PREFLIGHT, AgentAction.DUMP_COLLECTIVES, AgentAction.RAS_STATUS)
)
# Reads an operator's key alone may send (a scene holds logs and stacks): they change nothing, so no fencing
# token or step key applies, and a copy's many chunk reads are not counted against the request budget.
READ_ACTIONS: frozenset[str] = frozenset({AgentAction.READ_SCENE.value})


class ResultCode(StrEnum):
    """Why an action failed, where a caller acts on the reason (the message is for people)."""

    TRAINER_ABSENT = "trainer_absent"  # no trainer listens on the node's control socket (yet): retry while it starts
    NOT_SENT = "not_sent"  # a watch-only run (a baseline) sends no step that acts: nothing was tried
    # The caller's key is over the agent's request budget: nothing was done; data["retry_after_s"] says when a
    # request is admitted again.
    OVER_BUDGET = "over_budget"
