"""Tiered checkpoints: snapshot in memory, persist to tmpfs (tier 0), local disk (tier 1), a second location (tier 2).

The training loop pays for handing its state to a copy thread, which fills one
of two shared-memory arenas kept across saves while the next step computes
(:mod:`gridwatch.trainer.checkpoint_stage`); a writer process of its own
serialises, hashes and writes the files from the arena
(:mod:`gridwatch.trainer.checkpoint_writer`), so none of that holds the
training's GIL, and a thread here only orders the writes and waits for them.
Every rank keeps its own node's tiers 0 and 1 (the state is replicated, so any
surviving node can restore the job); tier 2 is written by one rank per save,
rotating, each starting ``rank * stagger`` seconds late so
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

from gridwatch.trainer.checkpoint import Manifest, checkpoint_root, clean_partials, list_checkpoints
from gridwatch.trainer.checkpoint_process import WriterDied, WriterProcess
from gridwatch.trainer.checkpoint_stage import Staged, Stager
from gridwatch.trainer.checkpoint_wire import Reply, one_line
from gridwatch.trainer.config import TrainConfig
from gridwatch.trainer.private import make_private_dir


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
    staged: Staged | None = None
    source: Path | None = None  # copy an existing checkpoint instead of writing buffers
    protect: bool = False  # copy the newest tier-0 checkpoint, whichever it is when the job runs
    tier2_delay: float = 0.0
    ping: bool = False  # no write: a round trip to the writer process
    done: threading.Event = field(default_factory=threading.Event)


class TieredCheckpointer:
    def __init__(self, cfg: TrainConfig, node: str, on_outcome: Callable[[SaveOutcome], None]) -> None:
        self.cfg = cfg
        self.node = node
        self.roots = {t: cfg.tier_root(t, node) for t in (0, 1, 2)}
        self._on_outcome = on_outcome
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._log = logger.bind(node=node)
        self.newest: dict[int, int] = {}
        # Per snapshot, the loop's whole wait: handing the state over, plus any wait for its copy before the state changed.
        self.stalls: list[float] = []
        self._stager = Stager(on_wait=self._waited)
        self._writer = WriterProcess()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ckpt-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ loop side

    def due(self, step: int) -> set[int]:
        every = (self.cfg.tier0_every, self.cfg.tier1_every, self.cfg.tier2_every)
        return {t for t, n in enumerate(every) if n > 0 and step % n == 0}

    def snapshot(
        self, live: dict[str, torch.Tensor], manifest: Manifest, tiers: set[int], tier2_owner: bool, rank: int = 0
    ) -> float:
        """Stage the state for copying and queue its writes; returns the seconds this call took.

        The copy runs on while the loop computes; the next optimizer step (or
        any call of this checkpointer) waits for it, and that wait is added to
        this snapshot's entry in :attr:`stalls`.
        """
        if self._closed:
            self._log.warning("checkpoint at step {} not taken: the checkpointer was stopped", manifest.step)
            return 0.0
        t0 = time.perf_counter()
        staged = self._stager.stage(live)
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        tiers = set(tiers) | {0}
        if not tier2_owner:
            tiers.discard(2)
        delay = self.cfg.tier2_stagger_s * rank
        self._jobs.put(_Job(manifest.step, tiers, manifest, staged=staged, tier2_delay=delay))
        return stall

    def settle(self) -> float:
        """Wait until the newest snapshot's copy is done: call before changing the state in place other than by an optimizer."""
        return self._stager.settle()

    def _waited(self, seconds: float) -> None:
        if self.stalls:
            self.stalls[-1] += seconds

    def protect(self, note: str) -> None:
        """Persist the newest in-memory-tier checkpoint to local disk: the state before a bad step."""
        manifest = Manifest(step=0, epoch=0, sampler_position=0, tier=1, world_size=0, model="", note=note)
        self._jobs.put(_Job(0, {1}, manifest, protect=True))

    def flush(self, timeout: float = 120.0) -> bool:
        """Wait until every queued write is done (at exit, before a restore)."""
        self._stager.settle()
        return self._marker(timeout)

    def ready(self, timeout: float) -> bool:
        """Wait until the writer process serves (its start is over: torch's import took 14 s on a loaded node);
        False after ``timeout``. A writer that died on the way is told by the writer thread, and replaced."""
        return self._marker(timeout, ping=True)

    def _marker(self, timeout: float, ping: bool = False) -> bool:
        """Queue a job that writes nothing and wait for the writer thread to reach it."""
        marker = _Job(-1, set(), Manifest(step=-1, epoch=0, sampler_position=0, tier=0, world_size=0, model=""),
                      ping=ping)
        self._jobs.put(marker)
        return marker.done.wait(timeout)

    def busy(self) -> bool:
        """Whether writes are still queued or running."""
        return self._jobs.unfinished_tasks > 0

    def stop(self, timeout: float = 120.0) -> None:
        """Finish the queued writes, then end the writer process and give the arenas back."""
        if self._closed:
            return
        done = self.flush(timeout)
        self._closed = True
        self._jobs.put(None)
        if done:
            self._thread.join(timeout)
            self._stager.close()

    # ---------------------------------------------------------------- writer side

    def _run(self) -> None:
        # Started from this thread, which lives as long as the checkpointer: the writer dies with it, not sooner.
        try:
            self._writer.start()
        except OSError as exc:
            self._log.warning("checkpoint writer process did not start: {}; retried at the first save", one_line(exc))
        while (job := self._jobs.get()) is not None:
            try:
                if job.ping:
                    self._writer.ping()
                elif job.step >= 0:
                    self._write(job)
            except BaseException as exc:  # the writer must outlive any one failed save
                self._log.exception("checkpoint writer: {}", exc)
            finally:
                if job.staged is not None:
                    self._stager.release(job.staged)
                job.done.set()
                self._jobs.task_done()
        self._writer.close()
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
        if job.staged is not None:
            job.staged.done.wait()
            if job.staged.error:
                for tier in sorted(job.tiers):
                    self._failed(tier, job.step, self.roots[tier], job.staged.error)
                return
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
                    # The run's tier-0 directory must be private before a node's directory goes in it; the node's
                    # is made here too, before the writer gets to it, so that a node finishing first never finds
                    # the run's directory empty and gives it back under this node's coming write.
                    make_private_dir(self.cfg.tier0_root(), parents=True)
                    checkpoint_root(root)
                reply = self._send(job, tier, root, written)
            except WriterDied as exc:
                # What the dead writer had half-written is removed now, not at the next restore.
                clean_partials(root)
                reply = Reply(error=str(exc))
            except BaseException as exc:  # the checks above; nothing may stop the other tiers
                reply = Reply(error=one_line(exc))
            if reply.error:
                self._failed(tier, job.step, root, reply.error)
                continue
            path = Path(reply.path)
            written[tier] = path
            self.newest[tier] = max(self.newest.get(tier, -1), job.step)
            secs = time.perf_counter() - t0
            self._log.debug("tier {} step {} written to {} in {:.2f}s ({} pruned)", tier, job.step, path, secs, reply.pruned)
            self._on_outcome(SaveOutcome(tier, job.step, str(path), seconds=secs))

    def _send(self, job: _Job, tier: int, root: Path, written: dict[int, Path]) -> Reply:
        keep = self.cfg.keep[tier]
        if job.source is not None:
            return self._writer.copy(job.source, root, tier, job.manifest.note, keep)
        if tier == 2 and written:
            return self._writer.copy(written.get(1) or written[0], root, tier, "", keep)
        assert job.staged is not None
        manifest = msgspec.structs.replace(job.manifest, tier=tier)
        return self._writer.write(job.staged.arena, job.staged.arena_id, self._stager.arena_ids(), root, manifest, keep)

    def _failed(self, tier: int, step: int, root: Path, reason: str) -> None:
        self._log.warning("tier {} checkpoint at step {} failed: {}; earlier checkpoints are kept", tier, step, reason)
        self._on_outcome(SaveOutcome(tier, step, str(root), error=reason))
