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


@dataclass(frozen=True)
class ScriptedFault:
    """One fault of a drill: on ``node``, ``after_s`` seconds into the run (``--fault node-2:xid:79@30``)."""

    node: str
    spec: FaultSpec
    after_s: float
    gpu: int = 0


def parse_fault(text: str, kinds: tuple[str, ...]) -> ScriptedFault:
    """``NODE:KIND[:CODE]@SECONDS[/GPU]``, e.g. ``node-2:xid:79@30/1``; ValueError says what is wrong."""
    what, at, when = text.partition("@")
    if not at:
        raise ValueError(f"{text!r}: expected NODE:KIND[:CODE]@SECONDS, e.g. node-2:xid:79@30")
    seconds, _, gpu_text = when.partition("/")
    parts = what.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise ValueError(f"{text!r}: expected NODE:KIND[:CODE] before the @")
    node, kind = parts[0], parts[1]
    if kind not in kinds:
        raise ValueError(f"{text!r}: unknown fault kind {kind!r} (one of: {', '.join(kinds)})")
    code = parts[2] if len(parts) == 3 else None
    if (kind == "xid") != (code is not None) or (code is not None and not code.isdigit()):
        raise ValueError(f"{text!r}: an xid takes a numeric code (node-2:xid:79@30), no other kind takes one")
    try:
        after = float(seconds)
    except ValueError:
        raise ValueError(f"{text!r}: {seconds!r} is not a number of seconds") from None
    if after < 0 or (gpu_text and not gpu_text.isdigit()):
        raise ValueError(f"{text!r}: expected seconds of at least 0 and a GPU index after the /")
    return ScriptedFault(node, FaultSpec(kind, int(code) if code is not None else None), after, int(gpu_text or 0))


async def run_script(faults: tuple[ScriptedFault, ...], inject: Inject, elapsed: Callable[[], float],
                     sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
    """Inject each fault at its time, in time order; one that fails is said by ``inject`` and the drill goes on."""
    for fault in sorted(faults, key=lambda f: f.after_s):
        wait = fault.after_s - elapsed()
        if wait > 0:
            await sleep(wait)
        await inject(fault.node, fault.spec, fault.gpu)


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
