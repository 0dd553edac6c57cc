"""Scheduler backends for drain_node: the argv that takes a node out of the scheduler's pool.

Commands are argv lists run without a shell; a node name that is not a plain
hostname is refused, because it came from the node and could pose as an option.
"""

from __future__ import annotations

import re

from playbooks.model import SCHEDULERS

_HOSTNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


class DrainRefused(ValueError):
    """The drain command could not be built; the message says why."""


def drain_argv(backend: str, node: str, reason: str) -> list[str] | None:
    """The command that drains ``node`` on ``backend``; None for backend ``none``."""
    if backend not in SCHEDULERS:
        raise DrainRefused(f"unknown scheduler {backend!r}; use one of {', '.join(SCHEDULERS)}")
    if backend == "none":
        return None
    if not _HOSTNAME.match(node):
        raise DrainRefused(f"refusing to drain {node!r}: not a plain host name")
    reason = " ".join(reason.split())[:120] or "gridwatch"
    if backend == "slurm":
        return ["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason=gridwatch: {reason}"]
    return ["kubectl", "cordon", node]
