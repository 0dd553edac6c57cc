"""Small typed values over torch.distributed, as msgspec JSON (torch's object collectives pickle, and need numpy).

A peer's bytes are decoded into the type the caller names and nothing else: a
rank (or anything that reached the job's store) can send a wrong value, never
code, which it could with pickle.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import torch
import torch.distributed as dist

T = TypeVar("T")
# What msgspec decodes into: a class, or a union such as ``Manifest | str``. Typing has
# no name for "a type expression" yet (PEP 747's TypeForm), so the result's type comes
# from the value a caller passes instead.
TypeForm = Any


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(msgspec.json.encode(obj)), dtype=torch.uint8).to(_device())


def _decode(t: torch.Tensor, size: int, type_: TypeForm) -> Any:
    return msgspec.json.decode(bytes(t[:size].cpu().tolist()), type=type_)


def all_gather_object(obj: T, type_: type[T]) -> list[T]:
    """Every rank's ``obj``, in rank order, each decoded as ``type_``."""
    data = _encode(obj)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.long, device=data.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.long, device=data.device))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=data.device)
    padded[: data.numel()] = data
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return [_decode(p, int(s.item()), type_) for p, s in zip(parts, sizes, strict=True)]


def broadcast_object(obj: T, src: int, type_: TypeForm) -> T:
    """``obj`` as rank ``src`` holds it, on every rank, decoded as ``type_`` (a class or a union).

    Only rank ``src``'s ``obj`` is sent; the others pass a placeholder of the same type.
    """
    dev = _device()
    size = torch.zeros(1, dtype=torch.long, device=dev)
    data = _encode(obj) if dist.get_rank() == src else None
    if data is not None:
        size[0] = data.numel()
    dist.broadcast(size, src=src)
    buf = data if data is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src=src)
    return _decode(buf, int(size.item()), type_)
