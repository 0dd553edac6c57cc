"""Small Python objects over torch.distributed without numpy (torch's object collectives need it)."""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _encode(obj: Any) -> torch.Tensor:
    return torch.tensor(list(pickle.dumps(obj)), dtype=torch.uint8, device=_device())


def _decode(t: torch.Tensor, size: int) -> Any:
    return pickle.loads(bytes(t[:size].cpu().tolist()))


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    data = _encode(obj)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.long, device=data.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.long, device=data.device))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=data.device)
    padded[: data.numel()] = data
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return [_decode(p, int(s.item())) for p, s in zip(parts, sizes, strict=True)]


def broadcast_object(obj: Any, src: int) -> Any:
    """``obj`` as rank ``src`` holds it, on every rank."""
    dev = _device()
    size = torch.zeros(1, dtype=torch.long, device=dev)
    data = _encode(obj) if dist.get_rank() == src else None
    if data is not None:
        size[0] = data.numel()
    dist.broadcast(size, src=src)
    buf = data if data is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src=src)
    return _decode(buf, int(size.item()))
