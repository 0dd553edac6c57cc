"""How a worker keeps its place in the job: the two membership modes, behind one interface (:class:`GroupMode`).

- :class:`CoordinatedMode`: the membership coordinator names the members of each
  generation; a worker enters a generation's group, leaves it and re-forms in
  place, keeping its process, its model and its place in the data
  (:mod:`gridwatch.trainer.group`).
- :class:`TorchrunMode`: torchrun's rendezvous made the process group (from its
  environment); any change of members ends this process, and torchrun starts
  every worker again.

The worker calls its mode wherever the two differ and never asks which one it has.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist
from loguru import logger

from gridwatch.trainer.collectives import all_gather_object
from gridwatch.trainer.config import TrainConfig
from gridwatch.trainer.controls import Controls
from gridwatch.trainer.group import Membership
from gridwatch.trainer.membership import Generation
from gridwatch.wire.protocol import TrainerPhase

if TYPE_CHECKING:
    from gridwatch.trainer.worker import Worker

# torchrun restarts the workers of every node when one exits non-zero; these say why.
EXIT_REFORM = 75  # a node left: re-form without it
EXIT_DEADLINE = 76  # no progress within the deadline: a peer is frozen or gone


class GroupMode(Protocol):
    """What the worker asks of its membership mode, at the points where the two modes differ."""

    def collective_timeout(self, cfg: TrainConfig) -> timedelta:
        """How long a collective may wait."""
        ...

    def progress_deadline(self, cfg: TrainConfig) -> float:
        """Seconds a step may take before the worker gives up on the job (the last resort)."""
        ...

    def attach(self, w: Worker) -> None:
        """The worker is built: take its first place (rank, size, peers), if it has one yet."""
        ...

    def join(self, w: Worker) -> None:
        """Before the first step: line up the worker's state with the job's (a checkpoint, or rank 0's)."""
        ...

    def at_boundary(self, step_s: float = 0.0) -> None:
        """The loop passed a step boundary; the last step took ``step_s``."""
        ...

    def generation(self, rank: int) -> int:
        """The generation this rank puts in the control vector (the newest one, from rank 0)."""
        ...

    def follow(self, w: Worker, ctl: Controls) -> bool:
        """Move to the generation every rank agreed on, if it is new; True if the worker moved."""
        ...

    def restarted_for(self, w: Worker, incident: str) -> bool:
        """Whether the job already restarted for ``incident`` (and says so)."""
        ...

    def mark_restarted(self, incidents: list[str], step: int) -> None:
        """The job restarted (to ``step``) for these incidents."""
        ...

    def leave(self, w: Worker, leaving: list[int]) -> None:
        """Every rank agreed that ``leaving`` go: they stop, the others go on without them."""
        ...

    def depart(self, w: Worker) -> None:
        """This node leaves at once, alone (its GPU is lost); never returns."""
        ...

    def survive(self, w: Worker, exc: RuntimeError) -> bool:
        """A step failed in a collective: re-form and return True, or False if the process must end."""
        ...

    def finish(self) -> None:
        """The run is done."""
        ...


class TorchrunMode:
    """torchrun's rendezvous made the group and any change of members restarts this process."""

    @classmethod
    def form(cls, cfg: TrainConfig, node: str, backend: str) -> TorchrunMode:
        """Form the process group torchrun's rendezvous named; this process lives as long as its membership."""
        mode = cls()
        watchdog = init_watchdog(cfg, node)
        torchrun_group(backend, mode.collective_timeout(cfg))
        watchdog.cancel()
        return mode

    def collective_timeout(self, cfg: TrainConfig) -> timedelta:
        """The progress deadline ends the process first, so collectives may wait longer."""
        return timedelta(seconds=max(60.0, 4 * cfg.progress_deadline_s))

    def progress_deadline(self, cfg: TrainConfig) -> float:
        return cfg.progress_deadline_s

    def attach(self, w: Worker) -> None:
        w.adopt(all_gather_object(w.node, str))
        w.flight.join("world", 0, w.rank, w.members)

    def join(self, w: Worker) -> None:
        if not w.restore():
            w.start_fresh()

    def at_boundary(self, step_s: float = 0.0) -> None:
        pass

    def generation(self, rank: int) -> int:
        return 0

    def follow(self, w: Worker, ctl: Controls) -> bool:
        return False

    def restarted_for(self, w: Worker, incident: str) -> bool:
        return False

    def mark_restarted(self, incidents: list[str], step: int) -> None:
        pass

    def leave(self, w: Worker, leaving: list[int]) -> None:
        """Checkpoint to local disk, then the leaving node stops and the others re-form without it."""
        w.phase = TrainerPhase.CHECKPOINTING
        w.deadline.feed(w.cfg.startup_deadline_s)
        w.snapshot({0, 1})
        w.ckpt.flush()
        dist.barrier()
        names = ", ".join(w.members[r] for r in leaving)
        if w.rank in leaving:
            w.phase = TrainerPhase.LEFT
            w.log.info("leaving the job at step {} on request; the others re-form without this node", w.step)
            self._stop_agent(w)
        w.log.info("{} left at step {}; re-forming", names, w.step)
        w.exit(EXIT_REFORM)

    def depart(self, w: Worker) -> None:
        self._stop_agent(w)

    def _stop_agent(self, w: Worker) -> None:
        # Stopping our torchrun agent by signal keeps the rendezvous open for the others
        # (a clean exit would close it for everyone).
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(30)
        w.exit(0)

    def survive(self, w: Worker, exc: RuntimeError) -> bool:
        return False  # a peer that died makes the collective fail: exit so torchrun re-forms

    def finish(self) -> None:
        pass


class CoordinatedMode:
    """The coordinator's generations: a change of members re-forms the job in place, without a restart."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership

    def collective_timeout(self, cfg: TrainConfig) -> timedelta:
        """A peer that stops answering fails the collective after the progress deadline and the job re-forms in place."""
        return timedelta(seconds=max(2.0, cfg.progress_deadline_s))

    def progress_deadline(self, cfg: TrainConfig) -> float:
        # A hung collective times out first (and the job re-forms in place); the deadline is the last resort.
        return 2 * cfg.progress_deadline_s + 5

    def attach(self, w: Worker) -> None:
        pass  # no place until a generation takes this node

    def join(self, w: Worker) -> None:
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if restarts:
            # Under the coordinator torchrun restarts only this node's worker, and only when it died.
            w.event("trainer_restarted", f"the trainer on {w.node} was restarted by torchrun (restart {restarts}): "
                    "the previous process died; it rejoins the job", "error", restarts=restarts)
        w.phase = TrainerPhase.JOINING
        self.membership.start()  # only now: the model and data are ready
        gen = self.membership.wait(w.cfg.startup_deadline_s)
        if gen is None:
            w.log.error("no generation took this node within {:.0f} s", w.cfg.startup_deadline_s)
            w.exit(EXIT_REFORM)
        assert gen is not None
        self._enter(w, gen)

    def at_boundary(self, step_s: float = 0.0) -> None:
        self.membership.at_boundary(step_s)

    def generation(self, rank: int) -> int:
        return self.membership.newest() if rank == 0 else 0

    def follow(self, w: Worker, ctl: Controls) -> bool:
        if ctl.generation <= self.membership.number:
            return False
        self._change(w, ctl.generation)
        return True

    def restarted_for(self, w: Worker, incident: str) -> bool:
        key = f"gw/restarted/{incident}"
        if self.membership.store.check([key]):
            w.event("checkpoint", f"restart_from for {incident} ignored: the job already restarted for it "
                    f"(at step {self.membership.store.get(key).decode(errors='replace')})", "info")
            return True
        return False

    def mark_restarted(self, incidents: list[str], step: int) -> None:
        for incident in incidents:
            self.membership.store.set(f"gw/restarted/{incident}", str(step))

    def leave(self, w: Worker, leaving: list[int]) -> None:
        """Every member is at this step: the others go on in a new generation, from memory, without a restart."""
        names = ", ".join(w.members[r] for r in leaving)
        w.phase = TrainerPhase.CHECKPOINTING
        w.snapshot({0})
        if w.rank in leaving:
            self.membership.leave()
        # The leaver waits too: gone before the coordinator saw "leave", it would look like a crash.
        nxt = self.membership.wait(w.cfg.startup_deadline_s, want_member=False)
        if w.rank in leaving:
            w.phase = TrainerPhase.LEFT
            w.log.info("leaving the job at step {} on request; the others go on without this node", w.step)
            w.ckpt.flush()
            self.membership.close("done")
            w.exit(0)
        if nxt is None:
            w.log.error("no new generation after {} left; exiting so the node is started again", names)
            w.exit(EXIT_REFORM)
        assert nxt is not None
        nxt = self._member_of(w, nxt)
        w.log.info("{} left at step {}; going on in generation {}", names, w.step, nxt.gen)
        self._enter(w, nxt)

    def depart(self, w: Worker) -> None:
        self.membership.leave()
        self.membership.wait(w.cfg.startup_deadline_s, want_member=False)
        self.membership.close("done")
        w.exit(0)

    def survive(self, w: Worker, exc: RuntimeError) -> bool:
        self._enter(w, self._wait_after_failure(w, exc))
        return True

    def finish(self) -> None:
        self.membership.close("done")

    # ------------------------------------------------------------ generations

    def _enter(self, w: Worker, gen: Generation) -> None:
        """Form ``gen``'s group (waiting again if that fails) and line up every member's state."""
        while True:
            w.phase = TrainerPhase.REFORMING
            w.deadline.feed(w.cfg.startup_deadline_s)
            watchdog = init_watchdog(w.cfg, w.node)
            try:
                self.membership.form(gen, w.backend, self.collective_timeout(w.cfg))
                w.adopt(list(gen.members))
                w.flight.join(f"gen{gen.gen}", gen.gen, w.rank, w.members)
                self._line_up(w, gen)
                watchdog.cancel()
                break
            except RuntimeError as exc:
                watchdog.cancel()
                gen = self._wait_after_failure(w, exc)
        w.phase = TrainerPhase.TRAINING
        w.event("membership", f"generation {gen.gen}: training on {w.world} nodes ({', '.join(gen.members)}) "
                f"from step {w.step}", "info", generation=gen.gen, world=w.world, sync=gen.sync)

    def _line_up(self, w: Worker, gen: Generation) -> None:
        if gen.sync == "restore":
            if w.restore():
                return
            if self.membership.number <= 1 and w.step == 0:
                w.start_fresh()
                return
        if gen.sync in ("share", "restore"):
            w.share()

    def _wait_after_failure(self, w: Worker, exc: BaseException) -> Generation:
        """A collective failed: say so, and wait for the coordinator's next generation that takes this node."""
        number = self.membership.number
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        w.event("membership", f"generation {number} failed ({first}); waiting for the job to re-form", "warning",
                generation=number)
        w.phase = TrainerPhase.REFORMING
        w.deadline.feed(w.cfg.startup_deadline_s)
        if dist.is_initialized():
            # Closing our connections fails the collective our peers still wait in, at once,
            # instead of after the collective timeout: they report too, and the job re-forms sooner.
            dist.destroy_process_group()
        self.membership.failed()
        gen = self.membership.wait(w.cfg.startup_deadline_s)
        if gen is None:
            w.log.error("no generation took this node within {:.0f} s; exiting so it is started again",
                        w.cfg.startup_deadline_s)
            w.exit(EXIT_REFORM)
        assert gen is not None
        return gen

    def _change(self, w: Worker, newest: int) -> None:
        """Rank 0 saw generation ``newest``: every member is at this step; move to it (or stand by if not in it)."""
        gen = self.membership.read(newest)  # the number every rank agreed on, not whatever is newest now
        if gen is None:
            return
        self._enter(w, self._member_of(w, gen))

    def _member_of(self, w: Worker, gen: Generation) -> Generation:
        """``gen``, or, if it dropped this node (thought dead, or slow), the next one that takes it back."""
        if w.node in gen.members:
            return gen
        return self._wait_after_failure(w, RuntimeError(f"generation {gen.gen} does not include {w.node}"))


# ------------------------------------------------------------ forming a group


def _init_limit(cfg: TrainConfig) -> float:
    return max(30.0, 2 * cfg.progress_deadline_s)


def init_watchdog(cfg: TrainConfig, node: str) -> threading.Timer:
    """Exit if forming a process group takes past the limit (cancel it once the group is up).

    Forming can wait far past the collective timeout when a member is gone
    (gloo's full-mesh connect waits for it); exiting lets the node start again.
    """
    limit = _init_limit(cfg)
    watchdog = threading.Timer(limit, _init_timed_out, args=(node, limit))
    watchdog.daemon = True
    watchdog.start()
    return watchdog


def _init_timed_out(node: str, limit: float) -> None:
    logger.bind(node=node).error("the process group did not form within {:.0f} s; exiting so the job re-forms", limit)
    logger.complete()
    os._exit(1)


def torchrun_group(backend: str, timeout: timedelta) -> None:
    """The process group torchrun's rendezvous named (RANK, WORLD_SIZE, MASTER_ADDR:MASTER_PORT), on a store
    rank 0 hosts on MASTER_ADDR alone: torch's own (``env://``) would listen, unauthenticated, on every
    interface."""
    from gridwatch.trainer.store import listen

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        listener = listen(host, port)
        store = dist.TCPStore(host, port, world, is_master=True, wait_for_workers=False, timeout=timeout,
                              master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
