"""The training process torchrun starts on each node: the loop, its guards, checkpoints and controls.

Run as ``python -m torch.distributed.run ... -m gridwatch.trainer.worker --run-dir DIR``;
the node's name comes from ``GRIDWATCH_NODE``.

The worker asks its membership mode wherever the coordinator's generations and
torchrun's group differ (:mod:`gridwatch.trainer.modes`), all-reduces its controls
as :class:`~gridwatch.trainer.controls.Controls`, and calls its device's hooks
(:mod:`gridwatch.trainer.simdevice`; they do nothing on a real GPU).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import signal
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from loguru import logger

from gridwatch.trainer.checkpoint import Manifest
from gridwatch.trainer.collectives import broadcast_object
from gridwatch.trainer.config import TrainConfig, read_config, release_tier0
from gridwatch.trainer.control_server import ControlServer
from gridwatch.trainer.controls import Controls
from gridwatch.trainer.corpus import build_corpus
from gridwatch.trainer.eventlog import EventLog
from gridwatch.trainer.flight import FlightRecorder
from gridwatch.trainer.group import Membership
from gridwatch.trainer.guards import LossGuard, ProgressDeadline, StragglerEpisodes, StragglerGuard
from gridwatch.trainer.membership import STORE_ENV
from gridwatch.trainer.model import ByteGPT, ModelConfig
from gridwatch.trainer.modes import EXIT_DEADLINE, EXIT_REFORM, CoordinatedMode, GroupMode, TorchrunMode
from gridwatch.trainer.restore import restore_newest
from gridwatch.trainer.sampler import BatchSampler, SamplerState, my_slots
from gridwatch.trainer.simdevice import Leave, SimDevice
from gridwatch.trainer.state import init_optimizer_state, live_tensors
from gridwatch.trainer.tiers import SaveOutcome, TieredCheckpointer
from gridwatch.wire.control import ControlCommand
from gridwatch.wire.controlsock import socket_path
from gridwatch.wire.protocol import Text, TrainerPhase, TrainerStatus


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` at ``cfg.steps``; ``step`` counts from 0."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _grad(param: torch.Tensor) -> torch.Tensor:
    """``param``'s gradient after ``backward()``: every parameter of the model is in the loss."""
    grad = param.grad
    assert grad is not None, "a parameter took no part in the loss"
    return grad


class Worker:
    """One node's training process: the loop, its guards, checkpoints and controls.

    ``mode`` keeps its place in the job (:mod:`gridwatch.trainer.modes`): the coordinator's
    generations, or torchrun's group.
    """

    def __init__(self, cfg: TrainConfig, node: str, backend: str, mode: GroupMode) -> None:
        self.cfg = cfg
        self.node = node
        self.backend = backend
        self.mode = mode
        self.rank, self.world = 0, 1  # until the mode places this process in a group
        self.log = logger.bind(node=node)
        torch.manual_seed(cfg.seed)
        self.mcfg = ModelConfig(seq_len=cfg.seq_len, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads)
        self.model = ByteGPT(self.mcfg)
        self.params = list(self.model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
        init_optimizer_state(self.opt)
        self.live = live_tensors(self.model, self.opt)
        data = torch.frombuffer(bytearray(build_corpus(cfg.corpus_bytes)), dtype=torch.uint8)
        self.sampler = BatchSampler(data, cfg.seq_len, cfg.micro_batch, cfg.micro_batches, cfg.seed)
        self.slots = my_slots(self.rank, self.world, cfg.micro_batches)
        self.step = 0
        self.loss_guard = LossGuard(cfg.spike_factor)
        self.straggler_guard = StragglerGuard(cfg.straggler_factor, cfg.straggler_window)
        # Kept across re-formations: an episode is about a node, whatever its rank is now.
        self.straggler_episodes = StragglerEpisodes(time.monotonic, cfg.straggler_min_steps,
                                                    min_span_s=cfg.straggler_min_span_s, rest_steps=cfg.straggler_rest_steps)
        self.prev_time = 0.0
        self.members: list[str] = [node]
        self.flight = FlightRecorder(node)
        mode.attach(self)
        # status, read by the control thread
        self.phase = TrainerPhase.STARTING
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self.rank_times: list[float] = []
        self.stragglers: list[int] = []
        self.paused = False
        self.events = EventLog(node)
        self.ckpt = TieredCheckpointer(cfg, node, self._on_saved)
        self.server = ControlServer(socket_path(cfg.run_dir, node), self.status, node, group=cfg.control_group,
                                    collectives_fn=self.flight.dump)
        self.deadline = ProgressDeadline(cfg.startup_deadline_s, self._on_deadline, time.monotonic)
        self.metrics = Path(cfg.run_dir) / "metrics.jsonl"
        self._restart_incidents: list[str] = []  # restart_from requests taken this step, by incident
        # Simulated GPUs only: their injected faults hurt this process as real ones would (elsewhere no-ops).
        self.faults = SimDevice.from_env(node, lambda: self.rank, mode.collective_timeout(cfg).total_seconds(),
                                         self.exit, backend)

    # ----------------------------------------------------------------- reporting

    def event(self, kind: str, message: str, severity: str = "warning", **details: object) -> None:
        self.events.add(kind, message, severity, **details)
        self.log.log("INFO" if severity == "info" else "WARNING", "event {}: {}", kind, message)

    def status(self) -> TrainerStatus:
        g = self.cfg.micro_batch * self.cfg.micro_batches * self.cfg.seq_len
        events = self.events.recent()
        return TrainerStatus(
            job=Text(self.cfg.run_id()), phase=self.phase, step=self.step, epoch=self.sampler.state.epoch,
            loss=self.loss, grad_norm=self.grad_norm,
            tokens_per_s=(g / self.prev_time) if self.prev_time > 0 else None,
            step_time_s=self.prev_time or None,
            rank_step_times={str(r): t for r, t in enumerate(self.rank_times)},
            stragglers=list(self.stragglers), membership=[Text(n) for n in self.members],
            world_size=self.world, checkpoints={str(t): s for t, s in sorted(self.ckpt.newest.items())},
            pid=os.getpid(), node=Text(self.node), rank=self.rank, paused=self.paused, events=events,
        )

    def _on_saved(self, out: SaveOutcome) -> None:
        if out.error:
            self.event("checkpoint", f"tier {out.tier} checkpoint at step {out.step} failed: {out.error}",
                       "error", tier=out.tier, step=out.step, path=out.path)
        elif out.tier > 0:
            self.event("checkpoint", f"tier {out.tier} checkpoint at step {out.step} written",
                       "info", tier=out.tier, step=out.step, path=out.path, seconds=f"{out.seconds:.3f}")

    def _on_deadline(self, idle: float) -> None:
        self.log.error(
            "no progress for {:.1f} s (a peer is frozen or gone); leaving so the job re-forms without it", idle
        )
        self.exit(EXIT_DEADLINE)

    def exit(self, code: int) -> None:
        try:
            self.server.stop()
        finally:
            logger.complete()
            sys.stderr.flush()
            os._exit(code)

    def _append_metrics(self, record: dict[str, object]) -> None:
        with open(self.metrics, "a") as f:
            f.write(json.dumps(record) + "\n")

    def truncate_metrics(self, upto: int) -> None:
        """Keep only steps up to ``upto``: later ones are about to be recomputed after a restore."""
        if not self.metrics.exists():
            return
        keep = []
        for line in self.metrics.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= upto:
                    keep.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
        tmp = self.metrics.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        os.replace(tmp, self.metrics)

    # ----------------------------------------------------------------- checkpoints

    def manifest(self) -> Manifest:
        return Manifest(
            step=self.step, epoch=self.sampler.state.epoch, sampler_position=self.sampler.state.position,
            tier=0, world_size=self.world, model=self.mcfg.fingerprint(), node=self.node,
            lr_schedule={"kind": "warmup_cosine", "lr": self.cfg.lr, "warmup": self.cfg.warmup,
                         "horizon": self.cfg.steps, "min_lr_ratio": self.cfg.min_lr_ratio,
                         "last_lr": lr_at(self.cfg, max(0, self.step - 1))},
            rng_ranks=self.world,
        )

    def snapshot(self, tiers: set[int]) -> float:
        """Every rank together: gather all RNG states, then copy the state out (the only stall)."""
        rng = torch.get_rng_state()
        all_rng = [torch.empty_like(rng) for _ in range(self.world)]
        self.flight.run("all_gather", rng, lambda: dist.all_gather(all_rng, rng))
        state = dict(self.live)
        state.update({f"rng.rank{r}": t for r, t in enumerate(all_rng)})
        every2 = max(1, self.cfg.tier2_every)
        owner = (self.step // every2) % self.world == self.rank
        return self.ckpt.snapshot(state, self.manifest(), tiers, tier2_owner=owner, rank=self.rank)

    def restore(self, want_step: int | None = None, below: int | None = None) -> bool:
        self.phase = TrainerPhase.RESTARTING
        self.deadline.feed(self.cfg.startup_deadline_s)
        self.ckpt.flush()
        manifest, skipped = restore_newest(self.cfg, self.node, self.live, self.mcfg.fingerprint(), want_step, below)
        for line in skipped:
            self.event("checkpoint", line, "warning")
        if manifest is None:
            return False
        self.step = manifest.step
        self.sampler.state = SamplerState(epoch=manifest.epoch, position=manifest.sampler_position)
        if self.rank == 0:
            self.truncate_metrics(self.step)
        self.event("checkpoint", f"restored step {manifest.step} (tier {manifest.tier}, written by {manifest.world_size} ranks) on {self.world} ranks",
                   "info", step=manifest.step, tier=manifest.tier)
        return True

    # ----------------------------------------------------------------- controls

    def _controls(self) -> Controls:
        """This rank's controls, all-reduced with every rank's: the controls the job applies at this step."""
        mine = Controls()
        for req in self.server.take():
            if req.cmd == ControlCommand.RESTART_FROM and self._restart_done(req.args):
                continue
            mine.ask(req, self.rank)
        mine.generation = self.mode.generation(self.rank)
        mine.paused = self.paused
        vec = mine.to_tensor(self.world)
        self.flight.run("all_reduce", vec, lambda: dist.all_reduce(vec, op=dist.ReduceOp.MAX),
                        before_start=self.faults.in_collective)
        return Controls.from_tensor(vec)

    def _restart_done(self, args: dict[str, object]) -> bool:
        """True if the job already restarted for this request's incident: a playbook sends one
        restart to every node, and a node that (re)joined later must not roll the job back again."""
        incident = str(args.get("incident") or "")[:200]
        if not incident:
            return False
        if self.mode.restarted_for(self, incident):
            return True
        self._restart_incidents.append(incident)
        return False

    def _handle(self, ctl: Controls) -> None:
        """Apply the controls every rank now agrees on."""
        if ctl.checkpoint:
            self.phase = TrainerPhase.CHECKPOINTING
            self.snapshot({0, 1, 2})
            self.event("checkpoint", f"checkpoint_now at step {self.step}", "info", step=self.step)
        if ctl.leaving:
            self.mode.leave(self, ctl.leaving)
        if ctl.restart:
            exact, below = ctl.restart_step, ctl.restart_below
            here = self.step
            restored = exact is not None and self.restore(exact)
            if not restored and ctl.restart_newest:
                # The named step did not validate (or none was named): the newest valid one, below the bound if any.
                restored = self.restore(None, below=below)
            if not restored:
                wanted = f"step {exact}" if exact is not None else ("a step below " + str(below) if below is not None else "any step")
                self.event("checkpoint", f"restart_from: no valid checkpoint at {wanted}; training goes on from step {here}", "error")
            self.mode.mark_restarted(self._restart_incidents, self.step)
            self.phase = TrainerPhase.TRAINING
        self._restart_incidents = []
        if ctl.pauses and not self.paused:
            self._pause()

    def _pause(self) -> None:
        self.phase, self.paused = TrainerPhase.PAUSED, True
        self.event("action", f"paused at step {self.step}", "info")
        while True:
            self.deadline.feed()
            self.mode.at_boundary()
            ctl = self._controls()
            if self.mode.follow(self, ctl):  # a node joins or leaves while the job is paused
                self.phase, self.paused = TrainerPhase.PAUSED, True
                continue
            if ctl.acts:
                self._handle(ctl)
                self.phase, self.paused = TrainerPhase.PAUSED, True
            if ctl.resume:
                break
            time.sleep(0.2)
        self.phase, self.paused = TrainerPhase.TRAINING, False
        self.event("action", f"resumed at step {self.step}", "info")

    # ----------------------------------------------------------------- groups

    def adopt(self, members: list[str]) -> None:
        """Take this group's rank and size: its share of each batch, its peers' names."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.slots = my_slots(self.rank, self.world, self.cfg.micro_batches)
        self.straggler_guard = StragglerGuard(self.cfg.straggler_factor, self.cfg.straggler_window)
        self.rank_times, self.stragglers = [], []
        self.members = members

    def start_fresh(self) -> None:
        """No checkpoint to start from: the job starts at step 0."""
        if self.rank == 0:
            self.log.info("no checkpoint found: starting at step 0")
            self.truncate_metrics(0)

    def share(self) -> None:
        """Every member takes rank 0's model, optimizer, step and data position (a node joining a running job)."""
        # The broadcast writes the live tensors in place, not through an optimizer step: a snapshot still
        # being copied out of them must finish first.
        self.ckpt.settle()
        pos = broadcast_object((self.step, self.sampler.state.epoch, self.sampler.state.position), 0, tuple[int, int, int])
        self.step = pos[0]
        self.sampler.state = SamplerState(epoch=pos[1], position=pos[2])
        for key in sorted(self.live):
            dist.broadcast(self.live[key], src=0)
        if self.rank != 0:
            torch.manual_seed(self.cfg.seed + 7919 * self.rank + self.step)

    # ----------------------------------------------------------------- the loop

    def train_step(self) -> None:
        cfg = self.cfg
        g_count = cfg.micro_batches
        t0 = time.perf_counter()
        batches = self.sampler.next_global_batch()
        if self.rank == cfg.fault_slow_rank and self.step + 1 == cfg.fault_slow_step:
            time.sleep(cfg.fault_slow_s)
        lr = lr_at(cfg, self.step)
        for group in self.opt.param_groups:
            group["lr"] = lr
        exact = cfg.reduce == "exact"
        grads = torch.zeros((g_count if exact else 1, self.numel), dtype=torch.float32)
        stats = torch.zeros(g_count + self.world, dtype=torch.float64)
        for slot in self.slots:
            x, y = self.sampler.tensors(batches[slot])
            loss = self.model(x, y)
            loss.backward()
            flat = torch.cat([_grad(p).reshape(-1) for p in self.params])
            if exact:
                grads[slot] = flat
            else:
                grads[0] += flat
            for p in self.params:
                p.grad = None
            stats[slot] = loss.item()
        self.faults.throttle(time.perf_counter() - t0)
        stats[g_count + self.rank] = self.prev_time
        # Each slot is filled by one rank and zero elsewhere, so the sum is exact and
        # the per-slot sum below adds in the same order on any world size.
        self.flight.run("all_reduce", grads, lambda: dist.all_reduce(grads))
        self.flight.run("all_reduce", stats, lambda: dist.all_reduce(stats))
        mean = grads.sum(dim=0).div_(g_count)
        loss_value = float(stats[:g_count].sum().item() / g_count)
        if cfg.fault_nan_step and self.step + 1 == cfg.fault_nan_step:
            loss_value = float("nan")
        verdict = self.loss_guard.check(loss_value)
        if verdict == "nan_loss":
            self.event("nan_loss", f"loss is {loss_value} at step {self.step + 1}: update skipped, last snapshot kept on disk",
                       "error", step=self.step + 1)
            self.ckpt.protect(f"protective: non-finite loss at step {self.step + 1}")
            self.grad_norm = None
        else:
            offset = 0
            for p in self.params:
                p.grad = mean[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.clip))
            self.opt.step()
            for p in self.params:
                p.grad = None
            if verdict == "loss_spike":
                self.event("loss_spike", f"loss {loss_value:.4f} at step {self.step + 1} is over {cfg.spike_factor:g}x the recent median",
                           "warning", step=self.step + 1)
                self.ckpt.protect(f"protective: loss spike at step {self.step + 1}")
        self.step += 1
        self.loss = loss_value
        self.rank_times = [float(t) for t in stats[g_count:]]
        if self.step > 1:
            self.stragglers = self.straggler_guard.check(self.rank_times)
            self._tell_stragglers()
        if self.rank == 0:
            self._append_metrics({"step": self.step, "loss": loss_value, "lr": lr, "grad_norm": self.grad_norm,
                                  "world_size": self.world, "time": time.time()})
        self.prev_time = time.perf_counter() - t0

    def _tell_stragglers(self) -> None:
        """A node slow over a window is told once per episode, by that node's own first rank.

        Every rank sees every rank's step time; were each to report each slow step, one slow node would
        make a line per rank per step. The report comes from the slow node itself: evidence about the node.
        """
        median = statistics.median(t for t in self.rank_times if t > 0) if any(t > 0 for t in self.rank_times) else 0.0
        slow: dict[str, float] = {}
        for r in self.stragglers:
            if r < len(self.members) and median > 0:
                node = self.members[r]
                slow[node] = max(slow.get(node, 0.0), self.rank_times[r] / median)
        for ep in self.straggler_episodes.update(self.step - 1, slow):
            if ep.node != self.node or self.members.index(ep.node) != self.rank:
                continue
            self.event("straggler", f"{ep.node} is slower than its peers: {ep.flagged} slow steps of "
                       f"{ep.last_step - ep.first_step + 1} over {ep.span_s:.0f} s (steps {ep.first_step}-{ep.last_step}, "
                       f"up to {ep.ratio:.1f}x the median step)", "warning",
                       rank=self.rank, node=ep.node, step=ep.last_step, first_step=ep.first_step,
                       flagged=ep.flagged, span_s=f"{ep.span_s:.1f}", ratio=f"{ep.ratio:.2f}")

    def _before_step(self) -> None:
        """The device's hook where the step's first collective starts; a node whose GPU is lost may still leave."""
        try:
            self.faults.before_step(lambda: any(r.cmd == ControlCommand.LEAVE for r in self.server.take()))
        except Leave:
            self.phase = TrainerPhase.LEFT
            self.log.info("leaving the job at step {} on request: its GPU is lost; the others go on without it", self.step)
            self.mode.depart(self)

    def _wait_for_writer(self) -> None:
        """Join once this node can checkpoint. A job's first snapshots fill the arenas; with the writer still
        starting, the next one held this rank's step until the progress deadline ended the whole job."""
        t0 = time.monotonic()
        if not self.ckpt.ready(self.cfg.startup_deadline_s / 2):
            self.log.warning("the checkpoint writer did not answer within {:.0f} s; joining anyway",
                             self.cfg.startup_deadline_s / 2)
        elif (waited := time.monotonic() - t0) >= 1.0:
            self.log.info("waited {:.1f} s for the checkpoint writer to start before joining", waited)

    def run(self) -> int:
        self.server.start()
        self.deadline.watch()
        self.faults.at_start()
        self._wait_for_writer()
        self.mode.join(self)
        self.phase = TrainerPhase.TRAINING
        deadline = self.mode.progress_deadline(self.cfg)
        self.deadline.feed(deadline)
        while self.step < self.cfg.steps:
            try:
                self.mode.at_boundary(self.prev_time)
                self._before_step()
                ctl = self._controls()
                if self.mode.follow(self, ctl):
                    continue
                self._handle(ctl)
                self.train_step()
                self.deadline.feed(deadline)
                tiers = self.ckpt.due(self.step)
                if tiers:
                    self.snapshot(tiers)
            except RuntimeError as exc:
                self.faults.on_collective_error(exc, seq=self.step + 1)
                if not self.mode.survive(self, exc):
                    raise
                self.deadline.feed(deadline)
        self.phase = TrainerPhase.CHECKPOINTING
        self.deadline.feed(self.cfg.startup_deadline_s)
        self.snapshot({0, 1, 2})
        self.ckpt.stop()
        dist.barrier()
        self.phase = TrainerPhase.DONE
        # Tier 0 is a RAM cache for resuming; a finished run keeps its last
        # checkpoint in tiers 1 and 2 and gives the memory back (the last node
        # out removes the run's directory too).
        for why in release_tier0(self.cfg, self.node):
            self.log.warning("tier 0 left in place: {}", why)
        if self.rank == 0:
            self.log.info("done: step {} loss {:.4f}", self.step, self.loss or float("nan"))
        self.mode.finish()
        self.server.stop()
        return 0


def _setup_logging(node: str) -> None:
    # This job has no numpy and saves per process on purpose; torch warns about both.
    warnings.filterwarnings("ignore", message=".*NumPy.*")
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    logger.remove()
    fmt = "{time:HH:mm:ss.SSS} {level: <7} [{extra[node]}] {message}"
    logger.configure(extra={"node": node})
    logger.add(sys.stderr, format=fmt, level=os.environ.get("GRIDWATCH_LOG_LEVEL", "INFO"))


def _die_with_agent() -> None:
    """A worker whose torchrun agent died must not train on alone under pid 1."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent or parent == 1:  # the agent died before the prctl took hold
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    _die_with_agent()
    parser = argparse.ArgumentParser(prog="gridwatch.trainer.worker")
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    node = os.environ.get("GRIDWATCH_NODE") or f"node-{int(os.environ.get('GROUP_RANK', '0')) + 1}"
    _setup_logging(node)
    # `kill -USR1` a worker to see where every thread is (a hung collective, a slow save).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        cfg = read_config(args.run_dir)
    except ValueError as exc:
        logger.error("{}", exc)
        return 2
    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    endpoint = os.environ.get(STORE_ENV)
    mode: GroupMode
    if endpoint:
        try:
            mode = CoordinatedMode(Membership(endpoint, node))
        except (ValueError, RuntimeError) as exc:
            logger.bind(node=node).error("cannot reach the job's store at {}: {}", endpoint, exc)
            return EXIT_REFORM
    else:
        # torchrun's rendezvous made the group; this process lives as long as its membership.
        mode = TorchrunMode.form(cfg, node, backend)
    try:
        return Worker(cfg, node, backend, mode).run()
    except Exception as exc:
        # A peer that died makes the next collective fail: exit so torchrun re-forms.
        logger.bind(node=node).error("training stopped: {}", str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
        logger.complete()
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
