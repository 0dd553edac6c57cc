"""Collective restore: every rank agrees on the newest checkpoint that validates, then receives it.

Each rank lists what it can see (its node's tiers 0 and 1; rank 0 also the
shared tier 2). Candidates are tried newest first; the rank that holds one
checks every file's sha256 and, if it is good, loads it and broadcasts the
state, so a checkpoint that survives on any single node restores the job.
A bad candidate is reported and skipped, and so is a tier directory that is
not this user's private one (its checkpoints are never even listed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from loguru import logger

from gridwatch.trainer.checkpoint import CheckpointInvalid, Manifest, list_checkpoints, load_tensors, root_refusal, validate
from gridwatch.trainer.collectives import all_gather_object, broadcast_object
from gridwatch.trainer.config import TrainConfig
from gridwatch.trainer.state import rng_tensors


@dataclass(frozen=True, order=True)
class Candidate:
    neg_step: int
    tier: int
    rank: int
    path: str

    @property
    def step(self) -> int:
        return -self.neg_step


def local_candidates(cfg: TrainConfig, node: str, rank: int, refused: list[str] | None = None) -> list[Candidate]:
    """The checkpoints this rank can see; a tier directory that is not private adds a line to ``refused``."""
    out = []
    for tier in (0, 1, 2):
        if tier == 2 and rank != 0:
            continue
        why: list[str] = []
        # Tier 0 is trusted only if the run's directory above the node's is private too.
        above = root_refusal(cfg.tier0_root()) if tier == 0 else ""
        if above:
            why.append(above)
        else:
            for step, path in list_checkpoints(cfg.tier_root(tier, node), why):
                out.append(Candidate(-step, tier, rank, str(path)))
        if refused is not None:
            refused.extend(f"tier {tier} on rank {rank}: {line}" for line in why)
    return out


def restore_newest(
    cfg: TrainConfig,
    node: str,
    live: dict[str, torch.Tensor],
    model_fingerprint: str,
    want_step: int | None = None,
    below: int | None = None,
) -> tuple[Manifest | None, list[str]]:
    """Load the newest valid checkpoint (or the one at ``want_step``, or the newest below ``below``) into ``live`` on every rank.

    Returns its manifest (None when there is none) and one line per candidate
    that was skipped, for the operator. Every rank must call this together.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    log = logger.bind(node=node)
    refused: list[str] = []
    gathered = all_gather_object(local_candidates(cfg, node, rank, refused), list[Candidate])
    for line in refused:
        log.warning(line)
    candidates = sorted(c for part in gathered for c in part)
    if want_step is not None:
        candidates = [c for c in candidates if c.step == want_step]
    if below is not None:
        candidates = [c for c in candidates if c.step < below]
    skipped: list[str] = list(refused)
    for cand in candidates:
        result: Manifest | str | None = None
        if rank == cand.rank:
            try:
                result = validate(Path(cand.path), model_fingerprint)
            except CheckpointInvalid as exc:
                result = str(exc)
        result = broadcast_object(result, cand.rank, Manifest | str | None)
        if isinstance(result, str):
            line = f"tier {cand.tier} checkpoint at step {cand.step} on rank {cand.rank} is unusable: {result}; falling back"
            skipped.append(line)
            if rank == 0:
                log.warning(line)
            continue
        assert isinstance(result, Manifest)
        rngs = rng_tensors(result.rng_ranks)
        ok: bool | str = True
        if rank == cand.rank:
            try:
                load_tensors(Path(cand.path), {**live, **rngs})
            except CheckpointInvalid as exc:
                ok = str(exc)
        ok = broadcast_object(ok, cand.rank, bool | str)
        if ok is not True:
            line = f"tier {cand.tier} checkpoint at step {cand.step} could not be loaded: {ok}; falling back"
            skipped.append(line)
            if rank == 0:
                log.warning(line)
            continue
        for key in sorted(live):
            dist.broadcast(live[key], src=cand.rank)
        for key in sorted(rngs):
            dist.broadcast(rngs[key], src=cand.rank)
        if rank < result.rng_ranks:
            torch.set_rng_state(rngs[f"rng.rank{rank}"])
        else:
            torch.manual_seed(cfg.seed + 7919 * rank + result.step)
        if rank == 0:
            log.info(
                "restored step {} from tier {} ({}), written by a world of {}, now {}",
                result.step, cand.tier, cand.path, result.world_size, world,
            )
        return result, skipped
    return None, skipped
