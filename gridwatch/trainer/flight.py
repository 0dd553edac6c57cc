"""Each rank's own flight recorder: its newest collectives, per process group, in a bounded ring.

torch 2.13's Flight Recorder records NCCL only (``TORCH_NCCL_TRACE_BUFFER_SIZE``,
dumped by ``torch._C._distributed_c10d._dump_nccl_trace``); for other backends
it needs torchcomms (``TORCH_FR_BUFFER_SIZE``), which this job does not use. So
the worker records every collective of its loop itself, in the same terms
(sequence number per group, op, sizes, scheduled / started / completed and the
times), and the control thread dumps the ring on request while the loop is
stuck. Ranks run the same collectives in the same order, so a sequence number
names the same collective on every member of a group.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch

from gridwatch.wire.control import CollectiveEntry, CollectiveRecord, CollectiveState, ProcessGroupInfo
from gridwatch.wire.protocol import Text, clean_text

RING = 1024  # entries kept: minutes of steps at a few collectives each
GROUPS = 16  # process groups remembered (the job's newest generations)

T = TypeVar("T")


class FlightRecorder:
    """Records collectives as the loop runs them; :meth:`dump` is safe from another thread."""

    def __init__(self, node: str, size: int = RING, clock: Callable[[], float] = time.time) -> None:
        self.node = node
        self.clock = clock
        self._ring: deque[CollectiveEntry] = deque(maxlen=size)
        self._groups: deque[ProcessGroupInfo] = deque(maxlen=GROUPS)
        self._seq: dict[str, int] = {}
        # Each group's newest collective, kept past the ring: after the job re-formed and trained
        # on, the collective the old group hung in is still what blame needs to read.
        self._last_of: dict[str, CollectiveEntry] = {}
        self._pg = ""
        self._added = 0
        self._lock = threading.Lock()

    def join(self, name: str, ordinal: int, rank: int, members: list[str]) -> None:
        """The loop now runs in process group ``name`` (numbered from its first collective on)."""
        with self._lock:
            self._pg = name
            self._seq[name] = 0
            self._groups.append(ProcessGroupInfo(name=Text(name), ordinal=ordinal, rank=rank,
                                                 members=[Text(m) for m in members]))

    def run(self, op: str, tensor: torch.Tensor | None, call: Callable[[], T],
            before_start: Callable[[], None] | None = None) -> T:
        """Run one collective ``call`` and record it; ``before_start`` runs once it is scheduled (a device's hook)."""
        with self._lock:
            self._seq[self._pg] = seq = self._seq.get(self._pg, 0) + 1
            entry = CollectiveEntry(pg=Text(self._pg), seq=seq, op=Text(op),
                                    numel=int(tensor.numel()) if tensor is not None else 0,
                                    dtype=Text(str(tensor.dtype).removeprefix("torch.")) if tensor is not None else Text(""),
                                    state=CollectiveState.SCHEDULED, scheduled_at=self.clock())
            self._ring.append(entry)
            self._last_of[self._pg] = entry
            self._added += 1
        if before_start is not None:
            before_start()
        entry.started_at = self.clock()
        entry.state = CollectiveState.STARTED
        try:
            out = call()
        except BaseException as exc:
            entry.ended_at = self.clock()
            entry.error = Text(clean_text(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, 200))
            entry.state = CollectiveState.FAILED
            raise
        entry.ended_at = self.clock()
        entry.state = CollectiveState.COMPLETED
        return out

    def dump(self, limit: int) -> CollectiveRecord:
        """The newest ``limit`` entries and the groups they belong to (copies: the loop goes on)."""
        with self._lock:
            entries = list(self._ring)[-limit:]
            groups = list(self._groups)
            dropped = self._added - len(entries)
            shown = {id(e) for e in entries}
            tails = [self._last_of[str(g.name)] for g in groups
                     if str(g.name) in self._last_of and id(self._last_of[str(g.name)]) not in shown]
            entries = [*tails, *entries]
        # Copied field by field: the loop may change an entry's state while it is encoded.
        return CollectiveRecord(
            node=Text(self.node), pid=os.getpid(), now=self.clock(), groups=groups,
            entries=[CollectiveEntry(pg=e.pg, seq=e.seq, op=e.op, numel=e.numel, dtype=e.dtype, state=e.state,
                                     scheduled_at=e.scheduled_at, started_at=e.started_at, ended_at=e.ended_at,
                                     error=e.error) for e in entries],
            dropped=dropped,
        )


async def gather(sockets: dict[str, str], timeout: float = 1.0) -> dict[str, CollectiveRecord | None]:
    """Every node's record read from its trainer's control socket at once (None where it did not answer)."""
    import asyncio

    from gridwatch.wire.controlsock import TrainerUnavailable, read_collectives

    async def one(path: str) -> CollectiveRecord | None:
        try:
            return await read_collectives(path, timeout=timeout)
        except TrainerUnavailable:
            return None

    got = await asyncio.gather(*(one(p) for p in sockets.values()))
    return dict(zip(sockets, got, strict=True))
