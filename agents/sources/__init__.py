"""What an agent reads each tick: GPUs, the host, logs, the software stack.

Every source is opened once and read once per tick; a reading that fails is
N/A (``None``) for that field, never an exception out of ``sample()``.
"""

from __future__ import annotations

from typing import Protocol

from agents.protocol import Event, GpuInfo, GpuSample


class FaultNotSupported(Exception):
    """This source cannot take injected faults (real hardware)."""


class GpuSource(Protocol):
    """NVML and the simulator both look like this to the sampler."""

    simulated: bool

    def info(self) -> list[GpuInfo]:
        """Static facts, read once at start."""
        ...

    def sample(self) -> list[GpuSample]:
        """One reading of every GPU; unreadable fields are ``None``."""
        ...

    def poll_events(self) -> list[Event]:
        """Events (XIDs, ECC, thermal, fell off the bus) since the last call; non-blocking."""
        ...

    def inject(self, kind: str, gpu: int | None = None, code: int | None = None) -> str:
        """Inject a fault (simulated GPUs only); returns a one-line description.

        Raises :class:`FaultNotSupported` on real hardware, ``ValueError`` for a
        bad kind or GPU index.
        """
        ...

    def clear_faults(self) -> None:
        ...

    def close(self) -> None:
        ...
