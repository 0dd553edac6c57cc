"""Tiered checkpoints: snapshot in memory, persist to tmpfs (tier 0), local disk (tier 1), a second location (tier 2).

The training loop only pays for a copy into reused buffers; a writer thread
does the rest. Every rank keeps its own node's tiers 0 and 1 (the state is
replicated, so any surviving node can restore the job); tier 2 is written by
one rank per save, rotating, each starting ``rank * stagger`` seconds late so
that copies to shared storage do not peak together.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch
from loguru import logger

from gridwatch.trainer.checkpoint import Manifest, copy_checkpoint, list_checkpoints, prune, write_checkpoint
from gridwatch.trainer.config import TrainConfig
from gridwatch.trainer.private import make_private_dir
from gridwatch.trainer.state import SnapshotPool, copy_into


@dataclass
class SaveOutcome:
    """One tier's save finished (``error`` empty) or failed (``error`` says why, in one line)."""

    tier: int
    step: int
    path: str
    error: str = ""
    seconds: float = 0.0


@dataclass
class _Job:
    step: int
    tiers: set[int]
    manifest: Manifest
    buffers: dict[str, torch.Tensor] | None = None
    source: Path | None = None  # copy an existing checkpoint instead of writing buffers
    protect: bool = False  # copy the newest tier-0 checkpoint, whichever it is when the job runs
    tier2_delay: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class TieredCheckpointer:
    def __init__(self, cfg: TrainConfig, node: str, on_outcome: Callable[[SaveOutcome], None]) -> None:
        self.cfg = cfg
        self.node = node
        self.roots = {t: cfg.tier_root(t, node) for t in (0, 1, 2)}
        self._on_outcome = on_outcome
        self._pool = SnapshotPool()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._log = logger.bind(node=node)
        self.newest: dict[int, int] = {}
        self.stalls: list[float] = []
        self._thread = threading.Thread(target=self._run, name="ckpt-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ loop side

    def due(self, step: int) -> set[int]:
        every = (self.cfg.tier0_every, self.cfg.tier1_every, self.cfg.tier2_every)
        return {t for t, n in enumerate(every) if n > 0 and step % n == 0}

    def snapshot(
        self, live: dict[str, torch.Tensor], manifest: Manifest, tiers: set[int], tier2_owner: bool, rank: int = 0
    ) -> float:
        """Copy the state into buffers and queue its writes; returns the stall in seconds."""
        t0 = time.perf_counter()
        bufs = self._pool.acquire(live)
        copy_into(bufs, live)
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        tiers = set(tiers) | {0}
        if not tier2_owner:
            tiers.discard(2)
        delay = self.cfg.tier2_stagger_s * rank
        self._jobs.put(_Job(manifest.step, tiers, manifest, buffers=bufs, tier2_delay=delay))
        return stall

    def protect(self, note: str) -> None:
        """Persist the newest in-memory-tier checkpoint to local disk: the state before a bad step."""
        manifest = Manifest(step=0, epoch=0, sampler_position=0, tier=1, world_size=0, model="", note=note)
        self._jobs.put(_Job(0, {1}, manifest, protect=True))

    def flush(self, timeout: float = 120.0) -> bool:
        """Wait until every queued write is done (at exit, before a restore)."""
        marker = _Job(-1, set(), Manifest(step=-1, epoch=0, sampler_position=0, tier=0, world_size=0, model=""))
        self._jobs.put(marker)
        return marker.done.wait(timeout)

    def busy(self) -> bool:
        """Whether writes are still queued or running."""
        return self._jobs.unfinished_tasks > 0

    def stop(self, timeout: float = 120.0) -> None:
        self.flush(timeout)
        self._jobs.put(None)

    # ---------------------------------------------------------------- writer side

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if job.step >= 0:
                    self._write(job)
            except BaseException as exc:  # the writer must outlive any one failed save
                self._log.exception("checkpoint writer: {}", exc)
            finally:
                if job.buffers is not None:
                    self._pool.release(job.buffers)
                job.done.set()
                self._jobs.task_done()

    def _write(self, job: _Job) -> None:
        if job.protect:
            refused: list[str] = []
            newest = list_checkpoints(self.roots[0], refused)
            for why in refused:
                self._log.warning("protective snapshot: {}", why)
            if not newest:
                self._log.warning("protective snapshot: no tier-0 checkpoint to keep yet")
                return
            job.step, job.source = newest[0]
        written: dict[int, Path] = {}
        for tier in sorted(job.tiers):
            if tier == 2 and job.tier2_delay > 0:
                time.sleep(job.tier2_delay)
            t0 = time.perf_counter()
            root = self.roots[tier]
            try:
                if tier == 2 and not root.parent.is_dir():
                    raise FileNotFoundError(f"second location {root.parent} is missing")
                if tier == 0:
                    # The run's tier-0 directory must be private before a node's directory goes in it.
                    make_private_dir(self.cfg.tier0_root(), parents=True)
                if job.source is not None:
                    path = copy_checkpoint(job.source, root, tier, note=job.manifest.note)
                elif tier == 2 and written:
                    path = copy_checkpoint(written.get(1) or written[0], root, tier)
                else:
                    assert job.buffers is not None
                    path = write_checkpoint(root, job.buffers, msgspec.structs.replace(job.manifest, tier=tier))
            except BaseException as exc:  # DCP raises CheckpointException, a BaseException
                reason = _one_line(exc)
                self._log.warning(
                    "tier {} checkpoint at step {} failed: {}; earlier checkpoints are kept", tier, job.step, reason
                )
                self._on_outcome(SaveOutcome(tier, job.step, str(root), error=reason))
                continue
            written[tier] = path
            self.newest[tier] = max(self.newest.get(tier, -1), job.step)
            removed = prune(root, self.cfg.keep[tier])
            secs = time.perf_counter() - t0
            self._log.debug("tier {} step {} written to {} in {:.2f}s ({} pruned)", tier, job.step, path, secs, len(removed))
            self._on_outcome(SaveOutcome(tier, job.step, str(path), seconds=secs))


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    msg = text[0] if text else type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror and exc.strerror not in msg:
        msg = f"{exc.strerror}: {msg}"
    return msg[:300]
