"""The control vector: the controls one rank took at a step boundary, and the ones every rank then applies.

Every rank all-reduces its :class:`Controls` with MAX at each step boundary, so
all of them apply the same controls at the same step. :class:`Controls` owns
the vector's layout: one float64 slot per field, in :data:`SLOTS` order, then
one "leave" slot per rank. Each field's slot is written so that MAX merges it
as the job needs (the latest exact step asked for, the earliest "before" bound,
the newest generation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gridwatch.wire.control import ControlCommand, ControlRequest, restart_target

if TYPE_CHECKING:
    import torch

NO_BOUND = float(2**52)  # a "before" bound no checkpoint reaches: none asked for

SLOTS = ("pause", "resume", "checkpoint", "restart", "restart_step", "restart_below", "restart_newest", "generation",
         "paused")
_LEAVE0 = len(SLOTS)  # the first rank's "leave" slot


@dataclass
class Controls:
    """One rank's controls at a step boundary, or, decoded from the all-reduced vector, the job's."""

    pause: bool = False
    resume: bool = False
    checkpoint: bool = False  # checkpoint_now
    restart: bool = False  # restart_from
    restart_step: int | None = None  # the exact step asked for (slot: step + 1, 0 for none)
    restart_below: int | None = None  # the newest valid step below this (slot: -bound, -NO_BOUND for none)
    restart_newest: bool = False  # the newest valid step (below ``restart_below``, if any) when no exact one
    generation: int = 0  # the newest generation rank 0 saw: every rank changes group at the same step
    paused: bool = False  # a rank is paused: a node joining a paused job pauses with it
    leaving: list[int] = field(default_factory=list)  # the ranks asked to leave

    def ask(self, req: ControlRequest, rank: int) -> None:
        """Add one control request taken on ``rank``; anything but a control is ignored."""
        match req.cmd:
            case ControlCommand.PAUSE:
                self.pause = True
            case ControlCommand.RESUME:
                self.resume = True
            case ControlCommand.CHECKPOINT_NOW:
                self.checkpoint = True
            case ControlCommand.LEAVE:
                if rank not in self.leaving:
                    self.leaving.append(rank)
            case ControlCommand.RESTART_FROM:
                target = restart_target(req.args)
                self.restart = True
                if target.newest:
                    self.restart_newest = True
                if target.step is not None:
                    self.restart_step = target.step if self.restart_step is None else max(self.restart_step, target.step)
                if target.below is not None:
                    self.restart_below = target.below if self.restart_below is None else min(self.restart_below, target.below)

    @property
    def acts(self) -> bool:
        """A control that changes the job's state (a checkpoint, a restart, a node leaving)."""
        return self.checkpoint or self.restart or bool(self.leaving)

    @property
    def pauses(self) -> bool:
        """Whether these controls pause the job (a pause or a paused rank, and no resume)."""
        return (self.pause or self.paused) and not self.resume

    def to_tensor(self, world: int) -> torch.Tensor:
        """The vector to all-reduce with MAX, with a "leave" slot for each of ``world`` ranks."""
        import torch  # here, not above: a user's loop reads its controls through this class without a group

        head = {
            "pause": float(self.pause), "resume": float(self.resume), "checkpoint": float(self.checkpoint),
            "restart": float(self.restart),
            "restart_step": 0.0 if self.restart_step is None else float(self.restart_step + 1),
            "restart_below": -NO_BOUND if self.restart_below is None else max(-NO_BOUND, -float(self.restart_below)),
            "restart_newest": float(self.restart_newest), "generation": float(self.generation),
            "paused": float(self.paused),
        }
        vec = torch.zeros(_LEAVE0 + world, dtype=torch.float64)
        for i, name in enumerate(SLOTS):
            vec[i] = head[name]
        for rank in self.leaving:
            vec[_LEAVE0 + rank] = 1
        return vec

    @classmethod
    def from_tensor(cls, vec: torch.Tensor) -> Controls:
        """The controls an all-reduced vector carries (its length says the world size)."""
        slot = dict(zip(SLOTS, (float(v) for v in vec[:_LEAVE0]), strict=True))
        step, bound = slot["restart_step"], -slot["restart_below"]
        return cls(
            pause=slot["pause"] > 0, resume=slot["resume"] > 0, checkpoint=slot["checkpoint"] > 0,
            restart=slot["restart"] > 0,
            restart_step=int(step) - 1 if step > 0 else None,
            restart_below=int(bound) if bound < NO_BOUND else None,
            restart_newest=slot["restart_newest"] > 0,
            generation=int(slot["generation"]), paused=slot["paused"] > 0,
            leaving=[r for r in range(len(vec) - _LEAVE0) if vec[_LEAVE0 + r] > 0],
        )
