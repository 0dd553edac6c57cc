"""Your own training loop under the console: status out; pause, leave, checkpoint-now and restart-from in.

The loop stays yours. It calls :meth:`Supervised.step` once per iteration; the
console's controls reach it through the same control socket (and the same
server) as the reference trainer's, and act through the ``save`` and ``load``
functions you pass::

    with Supervised(save=save, load=load) as sup:
        step = 0
        while step < steps:
            loss = train_one_step()
            step += 1
            todo = sup.step(step, loss)
            if todo.leave:
                break
            step = todo.step  # a restart_from loaded an earlier step

In a job of several ranks (``torch.distributed`` initialised), every rank
all-reduces its controls at each call, as the reference trainer's ranks do, so
all of them save, load, pause and stop at the same step; only local rank 0
serves the node's socket. No torch is imported unless such a group exists.
"""

from __future__ import annotations

import os
import socket as _socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, SupportsFloat

from loguru import logger

from gridwatch.trainer.control_server import ControlServer
from gridwatch.trainer.controls import Controls
from gridwatch.trainer.eventlog import EventLog
from gridwatch.wire.control import ControlCommand
from gridwatch.wire.controlsock import SOCKET_ENV
from gridwatch.wire.protocol import Text, TrainerPhase, TrainerStatus

# Where the agent's ``trainer_socket`` points in the shipped agent.toml; GRIDWATCH_TRAINER_SOCKET wins.
DEFAULT_SOCKET = "/run/gridwatch/trainer.sock"
NODE_ENV = "GRIDWATCH_NODE"
# A paused loop wakes this often with nothing to do: a resume wakes it at once, this only bounds how long a
# KeyboardInterrupt (or, in a group, a peer's control) waits.
PAUSE_WAKE_S = 0.2
# The user's saves are reported under this tier in the status: whatever they write, it outlives the process.
USER_TIER = "1"


class SaveFn(Protocol):
    def __call__(self, step: int, /) -> object:
        """Write a checkpoint of the loop's state at ``step``, in your own format."""


class LoadFn(Protocol):
    def __call__(self, step: int, /) -> object:
        """Load the checkpoint of ``step`` into the model and optimizer; raise if there is none that loads."""


@dataclass(frozen=True)
class Next:
    """What the loop does after :meth:`Supervised.step`."""

    step: int  # the step to go on from: the one just reported, or the one a restart_from loaded
    leave: bool = False  # stop the loop: this node was asked to leave (a checkpoint was written first)
    restored: bool = False  # ``load`` ran: the model and optimizer now hold ``step``


def _local_rank_zero() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0"


class Supervised:
    """Supervision of one process of a training loop someone else wrote.

    ``save(step)`` and ``load(step)`` are yours; ``steps()`` lists the steps
    ``load`` can load, for a ``restart_from`` that asks for the newest one (or
    the newest before a step): without it, the steps ``save`` wrote in this
    process. ``socket`` defaults to ``GRIDWATCH_TRAINER_SOCKET``, else
    :data:`DEFAULT_SOCKET` (where the agent looks: its ``trainer_socket``).
    ``group`` may use the socket besides this user and root. ``serve`` says
    whether this process serves the socket (default: local rank 0).
    """

    def __init__(self, save: SaveFn, load: LoadFn, *, steps: Callable[[], Iterable[int]] | None = None,
                 socket: str | None = None, node: str | None = None, job: str | None = None, group: str = "",
                 serve: bool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._save_fn = save
        self._load_fn = load
        self._steps_fn = steps
        self.node = node or os.environ.get(NODE_ENV) or _socket.gethostname()
        self.path = socket or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
        self.job = job
        self._clock = clock
        self._log = logger.bind(node=self.node)
        self.events = EventLog(self.node)
        self._server = (ControlServer(self.path, self.status, self.node, group=group)
                        if (serve if serve is not None else _local_rank_zero()) else None)
        self.phase = TrainerPhase.STARTING
        self.current = 0  # the newest step reported
        self.loss: float | None = None
        self.step_time_s: float | None = None
        self.paused = False
        self.saved: set[int] = set()  # the steps ``save`` wrote in this process
        self.newest_saved: int | None = None  # read by the control thread: never iterate ``saved`` there
        self._last_at: float | None = None
        self._restarted_for: set[str] = set()  # incidents already restarted for: a repeat must not roll back again
        self._pending_incidents: list[str] = []
        self._group: Any = None  # torch.distributed, once a group of more than one rank is seen

    # ----------------------------------------------------------------- the socket

    def start(self) -> Supervised:
        """Open the control socket (on the serving rank); ``OSError`` in one sentence if it cannot be made."""
        if self._server is not None:
            try:
                self._server.start()
            except OSError as exc:
                raise OSError(exc.errno, f"cannot serve the trainer's control socket at {self.path} "
                              f"({exc.strerror or exc}): pass socket= or set {SOCKET_ENV} to a path this user may "
                              "create, the one the agent's trainer_socket names") from None
        return self

    def close(self) -> None:
        """Close the control socket; the status said ``done`` (or ``left``) last."""
        if self.phase != TrainerPhase.LEFT:
            self.phase = TrainerPhase.DONE
        if self._server is not None:
            self._server.stop()

    def __enter__(self) -> Supervised:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def status(self) -> TrainerStatus:
        """What the agent reads (from the control thread)."""
        rank, world = self._rank_world()
        newest = self.newest_saved
        return TrainerStatus(
            job=Text(self.job) if self.job else None, phase=self.phase, step=self.current, loss=self.loss,
            step_time_s=self.step_time_s, world_size=world, rank=rank,
            checkpoints={} if newest is None else {Text(USER_TIER): newest},
            pid=os.getpid(), node=Text(self.node), paused=self.paused, events=self.events.recent(),
        )

    def _event(self, kind: str, message: str, severity: str = "warning", **details: object) -> None:
        self.events.add(kind, message, severity, **details)
        self._log.log({"info": "INFO", "warning": "WARNING"}.get(severity, "ERROR"), "event {}: {}", kind, message)

    # ----------------------------------------------------------------- the loop's call

    def step(self, step: int, loss: SupportsFloat | None = None) -> Next:
        """Report that the loop finished ``step`` (with ``loss``), then apply the controls that came in.

        Returns at once when there are none; blocks while the job is paused.
        """
        now = self._clock()
        if self._last_at is not None and step > self.current:
            self.step_time_s = (now - self._last_at) / (step - self.current)
        self._last_at = now
        self.current = step
        if loss is not None:
            self.loss = float(loss)  # a tensor's .item(): the status crosses a thread, a tensor must not
        if self.phase == TrainerPhase.STARTING:
            self.phase = TrainerPhase.TRAINING
        todo = self._apply(self._controls())
        self._last_at = self._clock()  # time paused, saving or loading is not step time
        return todo

    def _apply(self, ctl: Controls) -> Next:
        """Apply the controls every rank agreed on, in the reference trainer's order."""
        restored = False
        if ctl.checkpoint:
            self._save("checkpoint_now")
        if ctl.leaving:
            return self._leave(ctl.leaving)
        if ctl.restart:
            restored = self._restart(ctl)
        if ctl.pauses and not self.paused:
            return self._pause(restored)
        return Next(self.current, restored=restored)

    def _pause(self, restored: bool) -> Next:
        self.phase, self.paused = TrainerPhase.PAUSED, True
        self._event("action", f"paused at step {self.current}", "info")
        while True:
            ctl = self._controls(wait=PAUSE_WAKE_S)
            if ctl.checkpoint:
                self._save("checkpoint_now")
                self.phase = TrainerPhase.PAUSED
            if ctl.leaving:
                self.paused = False
                return self._leave(ctl.leaving)
            if ctl.restart:
                restored = self._restart(ctl) or restored
                self.phase = TrainerPhase.PAUSED
            if ctl.resume:
                break
        self.phase, self.paused = TrainerPhase.TRAINING, False
        self._event("action", f"resumed at step {self.current}", "info")
        return Next(self.current, restored=restored)

    def _leave(self, leaving: list[int]) -> Next:
        """Checkpoint, then stop: a plain data-parallel group cannot lose a member in place, so every rank stops."""
        self._save("leave")
        rank, _ = self._rank_world()
        if rank in leaving:
            self.phase = TrainerPhase.LEFT
            self._event("action", f"left the job at step {self.current} on request", "info")
        else:
            self.phase = TrainerPhase.DONE
            self._log.info("rank(s) {} left at step {}: this job stops with them", leaving, self.current)
        return Next(self.current, leave=True)

    # ----------------------------------------------------------------- save and load

    def _save(self, why: str) -> bool:
        step = self.current
        self.phase = TrainerPhase.CHECKPOINTING
        t0 = self._clock()
        try:
            self._save_fn(step)
        except Exception as exc:  # noqa: BLE001 - the user's save failing is an event; training goes on
            self._event("checkpoint", f"{why}: saving step {step} failed: {exc}", "error", step=step)
            return False
        finally:
            self.phase = TrainerPhase.TRAINING
        self.saved.add(step)
        self.newest_saved = step if self.newest_saved is None else max(self.newest_saved, step)
        self._event("checkpoint", f"{why} at step {step}", "info", step=step, seconds=f"{self._clock() - t0:.3f}")
        return True

    def _load(self, step: int) -> bool:
        self.phase = TrainerPhase.RESTARTING
        try:
            self._load_fn(step)
        except Exception as exc:  # noqa: BLE001 - a checkpoint that does not load is skipped, as the reference's are
            self._event("checkpoint", f"step {step} did not load: {exc}", "warning", step=step)
            return False
        self.current = step
        self._event("checkpoint", f"restored step {step}", "info", step=step)
        return True

    def _loadable(self) -> list[int]:
        try:
            steps = set(self._steps_fn()) if self._steps_fn is not None else set(self.saved)
        except Exception as exc:  # noqa: BLE001 - a listing that fails is no step to load
            self._event("checkpoint", f"could not list the checkpoints: {exc}", "error")
            return []
        return sorted(steps, reverse=True)

    def _restart(self, ctl: Controls) -> bool:
        here, exact, below = self.current, ctl.restart_step, ctl.restart_below
        restored = exact is not None and self._load(exact)
        if not restored and ctl.restart_newest:
            # The named step did not load (or none was named): the newest that does, below the bound if any.
            for step in self._loadable():
                if step != exact and (below is None or step < below) and self._load(step):
                    restored = True
                    break
        if not restored:
            wanted = f"step {exact}" if exact is not None else (f"a step below {below}" if below is not None else "any step")
            self._event("checkpoint", f"restart_from: no checkpoint loads at {wanted}; training goes on from "
                            f"step {here}", "error")
        self._restarted_for.update(self._pending_incidents)
        self._pending_incidents = []
        self.phase = TrainerPhase.TRAINING
        return restored

    # ----------------------------------------------------------------- controls

    def _controls(self, wait: float = 0.0) -> Controls:
        """This process's controls, all-reduced with every rank's when the loop runs in a group."""
        rank, world = self._rank_world()
        mine = Controls(paused=self.paused)
        for req in self._server.take(wait) if self._server is not None else ():
            if req.cmd == ControlCommand.RESTART_FROM and self._restart_done(req.args):
                continue
            mine.ask(req, rank)
        if world == 1:
            return mine
        return self._agree(mine, world)

    def _restart_done(self, args: dict[str, Any]) -> bool:
        """A playbook sends one restart per incident to every node: a repeat must not roll the job back again."""
        incident = str(args.get("incident") or "")[:200]
        if not incident:
            return False
        if incident in self._restarted_for:
            self._log.info("restart_from for {} ignored: this job already restarted for it", incident)
            return True
        self._pending_incidents.append(incident)
        return False

    def _rank_world(self) -> tuple[int, int]:
        group = self._distributed()
        if group is None:
            return 0, 1
        return int(group.get_rank()), int(group.get_world_size())

    def _distributed(self) -> Any:
        """``torch.distributed`` when this process is in a group, else None; torch only if the user loaded it."""
        if self._group is None:
            import sys

            if "torch" not in sys.modules:
                return None
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return None
            self._group = dist
        return self._group

    def _agree(self, mine: Controls, world: int) -> Controls:
        import torch

        dist = self._group
        vec = mine.to_tensor(world)
        if dist.get_backend() == "nccl":
            vec = vec.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        return Controls.from_tensor(vec.cpu())
