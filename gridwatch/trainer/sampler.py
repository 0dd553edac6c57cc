"""A deterministic sampler whose position is part of every checkpoint.

The corpus is cut into fixed windows; each epoch visits them in a permutation
seeded by (seed, epoch). A global batch is ``micro_batches`` micro-batches of
``micro_batch`` windows, the same whatever the world size: rank ``r`` of ``w``
computes micro-batches ``r, r+w, ...``. So resuming on fewer nodes replays the
very same batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0  # windows of this epoch already consumed


class BatchSampler:
    def __init__(self, data: torch.Tensor, seq_len: int, micro_batch: int, micro_batches: int, seed: int) -> None:
        self.data = data
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.micro_batches = micro_batches
        self.seed = seed
        self.windows = (len(data) - 1) // seq_len
        self.per_step = micro_batch * micro_batches
        if self.windows < self.per_step:
            raise ValueError(
                f"corpus of {len(data)} bytes gives {self.windows} windows, fewer than one global batch ({self.per_step})"
            )
        self.state = SamplerState()
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.windows, generator=gen)
            self._perm_epoch = epoch
        return self._perm

    def next_global_batch(self) -> list[torch.Tensor]:
        """Window indices of each micro-batch of the next step; advances the position."""
        if self.state.position + self.per_step > self.windows:
            self.state = SamplerState(epoch=self.state.epoch + 1, position=0)
        perm = self._permutation(self.state.epoch)
        chosen = perm[self.state.position : self.state.position + self.per_step]
        self.state.position += self.per_step
        return list(chosen.split(self.micro_batch))

    def tensors(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets for the given window indices."""
        starts = windows * self.seq_len
        offsets = torch.arange(self.seq_len + 1)
        rows = self.data[(starts[:, None] + offsets[None, :])].long()
        return rows[:, :-1], rows[:, 1:]


def my_slots(rank: int, world: int, micro_batches: int) -> list[int]:
    return list(range(rank, micro_batches, world))
