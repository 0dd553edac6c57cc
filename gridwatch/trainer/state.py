"""The training state as named tensors, and in-memory snapshots of it in buffers allocated once."""

from __future__ import annotations

import threading

import torch
from torch import nn


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's moment buffers up front, so every rank holds the same tensors before step 1."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def live_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Views of the model's parameters and the optimizer's state, by stable names."""
    out = {f"model.{name}": p.data for name, p in model.named_parameters()}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for key, value in sorted(opt.state[p].items()):
            if isinstance(value, torch.Tensor):
                out[f"optim.{i}.{key}"] = value
    return out


def rng_tensors(world: int) -> dict[str, torch.Tensor]:
    """Empty holders for every rank's CPU RNG state."""
    size = torch.get_rng_state().numel()
    return {f"rng.rank{r}": torch.empty(size, dtype=torch.uint8) for r in range(world)}


class SnapshotPool:
    """Two sets of CPU buffers shaped like the state, reused for every snapshot.

    A snapshot is a copy into a free set (the only stall the loop sees); the
    writer thread owns a set until it has written it out, then releases it.
    """

    def __init__(self, count: int = 2) -> None:
        self._free: list[dict[str, torch.Tensor]] = []
        self._allocated = 0
        self._count = count
        self._cond = threading.Condition()

    def acquire(self, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with self._cond:
            if not self._free and self._allocated < self._count:
                self._allocated += 1
                pin = torch.cuda.is_available()
                return {k: torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=pin) for k, v in like.items()}
            while not self._free:
                self._cond.wait()
            bufs = self._free.pop()
        if bufs.keys() != like.keys() or any(bufs[k].shape != v.shape for k, v in like.items()):
            return {k: torch.empty(v.shape, dtype=v.dtype, device="cpu") for k, v in like.items()}
        return bufs

    def release(self, bufs: dict[str, torch.Tensor]) -> None:
        with self._cond:
            self._free.append(bufs)
            self._cond.notify()


def copy_into(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> None:
    for k, v in src.items():
        dst[k].copy_(v, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
