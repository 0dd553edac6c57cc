"""The patrol: the agent repeats the cheap pre-flight checks and says when the node turns sub-healthy."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gridwatch.agent.preflight import (
    CheckOutcome,
    NicCounters,
    NicLink,
    PreflightArgs,
    check_gpus,
    check_storage,
    judge_nics,
    read_nic_counters,
    read_nic_links,
)

if TYPE_CHECKING:
    from gridwatch.agent.agent import Agent  # a type only: the agent imports these modules

# Cheap enough to run every minute beside a training job: no writes, no sleeps, no torch.
PATROL_CHECKS = ("gpus", "network", "storage")


@dataclass
class PatrolResult:
    """One patrol round: when (patrol clock) and each check's outcome."""

    at: float
    outcomes: dict[str, CheckOutcome] = field(default_factory=dict)

    @property
    def failures(self) -> dict[str, str]:
        """Check name -> one-line reason, for the checks that failed."""
        return {name: o.detail for name, o in self.outcomes.items() if not o.ok}

    @property
    def ok(self) -> bool:
        return not self.failures


class Patrol:
    """Runs the cheap checks every ``interval`` seconds of ``clock``; publishes transitions as events.

    A node that starts failing publishes ``patrol_failed`` (again whenever the set
    of failing checks changes); one that passes again publishes ``patrol_recovered``.
    """

    def __init__(
        self,
        agent: Agent,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
        args: PreflightArgs | None = None,
        nic_counters: Callable[[], dict[str, NicCounters]] = read_nic_counters,
        nic_links: Callable[[], dict[str, NicLink]] = read_nic_links,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"patrol interval must be positive, got {interval}")
        self.agent = agent
        self.interval = interval
        self.clock = clock
        # During training the GPUs are busy by design: only faults count, not load.
        self.args = args or PreflightArgs(idle=False, write_test_mb=0.0)
        self._nic_counters = nic_counters
        self._nic_links = nic_links
        self._next_at: float | None = None
        self._last_counters: tuple[float, dict[str, NicCounters]] | None = None
        self.failing: frozenset[str] = frozenset()
        self.last: PatrolResult | None = None
        self.task: asyncio.Task[None] | None = None

    def step(self, now: float) -> PatrolResult | None:
        """Run a round if one is due at ``now``; the result, or ``None`` when not due."""
        if self._next_at is not None and now < self._next_at:
            return None
        self._next_at = now + self.interval
        result = self.check(now)
        self._announce(result)
        self.last = result
        return result

    def check(self, now: float) -> PatrolResult:
        cfg = self.agent.config
        result = PatrolResult(at=now)
        result.outcomes["gpus"] = check_gpus(self.agent, self.args, self.agent.clock())
        counters = self._nic_counters()
        before_at, before = self._last_counters if self._last_counters is not None else (now, counters)
        result.outcomes["network"] = judge_nics(
            list(cfg.nics), self._nic_links(), before, counters, now - before_at, self.args.nic_speed_mbps
        )
        self._last_counters = (now, counters)
        result.outcomes["storage"] = check_storage(list(cfg.checkpoint_paths), self.args.checkpoint_gb, 0.0, 0.0)
        return result

    def _announce(self, result: PatrolResult) -> None:
        failures = result.failures
        failing = frozenset(failures)
        if failing and failing != self.failing:
            reasons = "; ".join(f"{name}: {detail}" for name, detail in sorted(failures.items()))
            self.agent.event(
                "patrol_failed", f"patrol: node sub-healthy: {reasons}", severity="error", checks=",".join(sorted(failing)), **failures,  # type: ignore[arg-type]  # check names: never gpu or code
            )
        elif not failing and self.failing:
            self.agent.event(
                "patrol_recovered",
                f"patrol: checks pass again (were failing: {', '.join(sorted(self.failing))})",
                severity="info",
                checks=",".join(sorted(self.failing)),
            )
        self.failing = failing

    async def run(self) -> None:
        """Step on schedule until cancelled; a failing round is logged, never fatal to the agent."""
        while True:
            try:
                self.step(self.clock())
            except Exception:  # a check bug must not end the patrol or the agent
                self.agent.log.exception("patrol round failed")
                self._next_at = self.clock() + self.interval
            await asyncio.sleep(max((self._next_at or 0.0) - self.clock(), 0.01))

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()


def start_patrol(agent: Agent) -> Patrol | None:
    """Start the patrol when ``patrol_interval`` is set (in a running loop); ``None`` when it is 0."""
    interval = float(agent.config.patrol_interval or 0.0)
    if interval <= 0:
        return None
    patrol = Patrol(agent, interval)
    patrol.start()
    agent.log.info("patrol every {:g} s: {}", interval, ", ".join(PATROL_CHECKS))
    return patrol
