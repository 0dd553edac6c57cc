"""Random faults from the simulated catalogue at a set rate, each through the operator action."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gridwatch.wire.protocol import ActionResult


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    code: int | None = None

    def args(self, gpu: int) -> dict[str, object]:
        args: dict[str, object] = {"kind": self.kind, "gpu": gpu}
        if self.code is not None:
            args["code"] = self.code
        return args

    @property
    def label(self) -> str:
        return f"xid {self.code}" if self.code is not None else self.kind


# What --chaos picks from: hardware XIDs that take a node out, application XIDs
# that must not, and faults of the node's software.
CATALOGUE: tuple[FaultSpec, ...] = (
    FaultSpec("xid", 79), FaultSpec("xid", 48), FaultSpec("xid", 13), FaultSpec("xid", 31),
    FaultSpec("ecc-dbe"), FaultSpec("thermal"), FaultSpec("trainer-crash"), FaultSpec("agent-kill"),
)

Inject = Callable[[str, FaultSpec, int], Awaitable[ActionResult]]
Candidates = Callable[[], list[str]]


class Chaos:
    """Every ``every`` seconds (jittered), one fault on one node still in service."""

    def __init__(self, inject: Inject, candidates: Candidates, every: float, gpus: int,
                 rng: random.Random | None = None, catalogue: tuple[FaultSpec, ...] = CATALOGUE,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.inject = inject
        self.candidates = candidates
        self.every = every
        self.gpus = max(gpus, 1)
        self.rng = rng or random.Random()
        self.catalogue = catalogue
        self.sleep = sleep

    def pick(self) -> tuple[str, FaultSpec, int] | None:
        nodes = self.candidates()
        if not nodes:
            return None
        return self.rng.choice(nodes), self.rng.choice(self.catalogue), self.rng.randrange(self.gpus)

    async def run(self) -> None:
        while True:
            await self.sleep(self.every * self.rng.uniform(0.75, 1.25))
            choice = self.pick()
            if choice is not None:
                await self.inject(*choice)
