"""Snapshots staged beside the training: the state copied into reused arenas by a copy thread while the loop computes on.

A snapshot hands the copy to a thread and returns; the loop goes on into the
next step's forward and backward passes, which read the state but do not
change it. Before anything changes it, the copy must be done: every
optimizer's ``step()`` in this process waits for it first (a global pre-step
hook), and so does every call of the checkpointer; a loop that changes the
state in place some other way calls :meth:`Stager.settle` first. The time the
loop waits there is the snapshot's stall, reported with the snapshot's own.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gridwatch.trainer.checkpoint_arena import Arena, Layout, layout_of
from gridwatch.trainer.checkpoint_wire import one_line

_ids = itertools.count(1)


@dataclass
class _Place:
    """One of the pool's arenas: made by the copy thread when first used, or again when the state's layout changed."""

    layout: Layout
    arena: Arena | None = None
    arena_id: int = 0
    busy: bool = False


@dataclass
class Staged:
    """One snapshot being copied: ``done`` is set when the arena holds it (or ``error`` says why it does not)."""

    place: _Place
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""
    copy_s: float = 0.0

    @property
    def arena(self) -> Arena:
        assert self.place.arena is not None
        return self.place.arena

    @property
    def arena_id(self) -> int:
        return self.place.arena_id


@dataclass
class _Task:
    staged: Staged
    live: dict[str, torch.Tensor]
    ready: Any = None  # a CUDA event: where the loop's stream was when the snapshot was taken


class Stager:
    """``count`` arenas reused for every snapshot, filled by one copy thread; a snapshot waits only when all are busy."""

    def __init__(self, count: int = 2, on_wait: Callable[[float], None] | None = None) -> None:
        self._places: list[_Place] = []
        self._count = count
        self._cond = threading.Condition()
        self._on_wait = on_wait
        self._current: Staged | None = None
        self._tasks: queue.Queue[_Task | None] = queue.Queue()
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        me = weakref.ref(self)

        def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            stager = me()
            if stager is not None:
                stager.settle()

        # Global, not per optimizer: the checkpointer is handed tensors, not the optimizers that change them.
        self._hook = register_optimizer_step_pre_hook(before_step)
        self._thread = threading.Thread(target=self._copy_loop, name="ckpt-stage", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the loop's side

    def stage(self, live: dict[str, torch.Tensor]) -> Staged:
        """Start copying ``live`` into a free arena; blocks only while every arena is still being written out."""
        self.settle()
        place = self._acquire(layout_of(live))
        staged = Staged(place)
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record()
        self._current = staged
        self._tasks.put(_Task(staged, dict(live), ready))
        return staged

    def settle(self) -> float:
        """Wait until the newest snapshot's copy is done (the state may change after); returns the seconds waited."""
        staged = self._current
        if staged is None or staged.done.is_set():
            return 0.0
        t0 = time.perf_counter()
        staged.done.wait()
        waited = time.perf_counter() - t0
        if self._on_wait is not None:
            self._on_wait(waited)
        return waited

    def release(self, staged: Staged) -> None:
        """The writer is done with this snapshot's arena: the next snapshot may reuse it."""
        with self._cond:
            staged.place.busy = False
            self._cond.notify_all()

    def arena_ids(self) -> set[int]:
        """The arenas that exist now (the writer process may forget any other)."""
        with self._cond:
            return {p.arena_id for p in self._places if p.arena is not None}

    def close(self) -> None:
        """Stop the copy thread, drop the optimizer hook and give the arenas back (after the last write)."""
        self.settle()
        self._hook.remove()
        self._tasks.put(None)
        self._thread.join(10)
        with self._cond:
            for p in self._places:
                if p.arena is not None:
                    p.arena.close()
                    p.arena = None

    def _acquire(self, layout: Layout) -> _Place:
        with self._cond:
            while True:
                free = [p for p in self._places if not p.busy]
                same = [p for p in free if p.layout == layout]
                if same:
                    place = same[0]
                elif len(self._places) < self._count:
                    place = _Place(layout)
                    self._places.append(place)
                elif free:
                    place = free[0]  # the state changed shape (a new world size): this arena is made again
                    place.layout = layout
                else:
                    self._cond.wait()
                    continue
                place.busy = True
                return place

    # ------------------------------------------------------------ the copy thread

    def _copy_loop(self) -> None:
        while (task := self._tasks.get()) is not None:
            staged = task.staged
            t0 = time.perf_counter()
            try:
                self._fill(task)
            except BaseException as exc:  # the loop must outlive a snapshot that could not be staged
                staged.error = f"could not stage the snapshot: {one_line(exc)}"
            finally:
                staged.copy_s = time.perf_counter() - t0
                task.live = {}
                staged.done.set()

    def _fill(self, task: _Task) -> None:
        place = task.staged.place
        if place.arena is None or place.arena.layout != place.layout:
            if place.arena is not None:
                place.arena.close()
                place.arena = None
            place.arena = Arena.create(place.layout)
            place.arena_id = next(_ids)
        dst = place.arena.tensors
        if self._stream is None:
            for name, t in task.live.items():
                dst[name].copy_(t)
            return
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(task.ready)
            for name, t in task.live.items():
                dst[name].copy_(t, non_blocking=True)
        self._stream.synchronize()
