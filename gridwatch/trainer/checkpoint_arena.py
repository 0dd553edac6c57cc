"""Staging memory for snapshots: one shared-memory block (a memfd) laid out to hold a copy of every tensor of the state.

The training process copies its state into an arena; the checkpoint writer
process maps the same block and writes the checkpoint from it, so no tensor is
pickled between them and the loop's copy goes into memory kept across saves.
A memfd has no name: no other process can open it unless it is handed the
descriptor.
"""

from __future__ import annotations

import mmap
import os

import msgspec
import torch
from loguru import logger

# Each tensor starts on its own page: copies stay aligned and a slot never shares a page with the next.
_ALIGN = 4096


class Slot(msgspec.Struct, frozen=True):
    """Where one tensor of the state lives in the arena."""

    name: str
    dtype: str  # a torch dtype's name without "torch.", e.g. "float32"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class Layout(msgspec.Struct, frozen=True):
    """Every tensor's place in an arena; equal layouts can stage the same state."""

    slots: tuple[Slot, ...]
    size: int


def layout_of(state: dict[str, torch.Tensor]) -> Layout:
    """The arena layout that holds ``state``: its names, dtypes and shapes, each tensor page-aligned."""
    slots, offset = [], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        slots.append(Slot(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
    return Layout(tuple(slots), max(offset, _ALIGN))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"arena slot names an unknown dtype {name!r}")
    return dtype


class Arena:
    """A memfd of ``layout.size`` bytes, mapped, with one tensor per slot over it."""

    def __init__(self, fd: int, layout: Layout, writable: bool) -> None:
        self.fd = fd
        self.layout = layout
        self._mm = mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self._pinned = 0
        self.tensors: dict[str, torch.Tensor] = {}
        for s in layout.slots:
            dtype = _dtype(s.dtype)
            count = s.nbytes // torch.empty((), dtype=dtype).element_size()
            if count == 0:
                self.tensors[s.name] = torch.empty(s.shape, dtype=dtype)
                continue
            flat = torch.frombuffer(self._mm, dtype=dtype, count=count, offset=s.offset)
            self.tensors[s.name] = flat.view(s.shape)
        if writable and torch.cuda.is_available():
            self._pin()

    @classmethod
    def create(cls, layout: Layout) -> Arena:
        """A new arena, its memory allocated now (not page by page during the first copy)."""
        fd = os.memfd_create("gridwatch-snapshot", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, layout.size)
            # Allocates the pages up front: a full /dev/shm or memory limit fails here, with ENOSPC/ENOMEM,
            # instead of killing the process with SIGBUS when the copy touches a page that cannot be had.
            os.posix_fallocate(fd, 0, layout.size)
            return cls(fd, layout, writable=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, layout: Layout) -> Arena:
        """The writer process's view of an arena whose descriptor it was handed."""
        if os.fstat(fd).st_size < layout.size:
            os.close(fd)
            raise ValueError("arena is smaller than its layout")
        return cls(fd, layout, writable=False)

    def _pin(self) -> None:
        # Page-locked staging lets copies from the GPU run asynchronously, at full PCIe speed.
        base = torch.frombuffer(self._mm, dtype=torch.uint8, count=self.layout.size)
        try:
            rc = int(torch.cuda.cudart().cudaHostRegister(base.data_ptr(), self.layout.size, 0))
        except (RuntimeError, AttributeError, TypeError) as exc:
            logger.debug("snapshot arena not pinned ({}); copies from the GPU are synchronous", exc)
            return
        if rc == 0:
            self._pinned = base.data_ptr()
        else:
            logger.debug("snapshot arena not pinned (cudaHostRegister: error {}); copies from the GPU are synchronous", rc)

    def close(self) -> None:
        """Unmap and close; the memory goes back once the writer process has let go of it too."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._pinned)
            self._pinned = 0
        self.tensors = {}
        try:
            self._mm.close()
        except BufferError:
            pass  # a tensor over it is still referenced; the mapping goes with it
        try:
            os.close(self.fd)
        except OSError:
            pass
