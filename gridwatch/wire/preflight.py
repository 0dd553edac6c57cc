"""The ``preflight`` action's contract: which checks there are, what a request may make a node spend, the args
and one check's outcome (the agent runs the checks, the console judges the fleet)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

ALL_CHECKS = ("gpus", "stack", "network", "storage", "time", "comm")
DEFAULT_CHECKS = ("gpus", "stack", "network", "storage", "time")
_MIB = 1024 * 1024
# What a request may make the node spend. A viewer gets the defaults at most; an
# operator up to the caps; the all-reduce (a torch process and a socket to a peer)
# only for an operator, with the peers the console chose.
VIEWER_WRITE_TEST_MB = 16.0
MAX_WRITE_TEST_MB = 64.0
VIEWER_NET_SAMPLE_S = 0.5
MAX_NET_SAMPLE_S = 5.0
MAX_COMM_BYTES = 64 * _MIB
MAX_COMM_ITERS = 50
MAX_COMM_TIMEOUT_S = 300.0
MAX_COMM_WORLD = 4096


class CommArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where this node's rank joins the all-reduce test."""

    master_addr: str
    master_port: int
    rank: int
    world: int
    size_bytes: int = 1 << 20
    iters: int = 5
    timeout_s: float = 30.0
    pairs: bool = True  # full-mesh pairwise test; the console turns it off past a few nodes


class PreflightArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``preflight`` action's args; every field has a safe default."""

    checks: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_CHECKS))
    gpus: int | None = None  # expected GPU count; None: whatever the node had at start
    idle: bool = True  # before a launch GPUs should be free; a patrol during training sets False
    fault_window_s: float = 600.0  # GPU fault events this recent (and not cleared) fail the check
    max_mem_used_fraction: float = 0.05
    nic_speed_mbps: float | None = None
    net_sample_s: float = 0.5
    checkpoint_gb: float = 0.0  # space one checkpoint needs on each checkpoint path
    write_test_mb: float = 16.0
    min_write_mbps: float = 0.0
    comm: CommArgs | None = None


@dataclass
class CheckOutcome:
    """One check's verdict and the numbers behind it."""

    ok: bool
    detail: str
    values: dict[str, Any] = field(default_factory=dict)

    def to_data(self) -> dict[str, Any]:
        return {**self.values, "ok": self.ok, "detail": self.detail}
