"""Clock-throttle reasons: NVML's bit mask and the names frames carry (both ends read them)."""

from __future__ import annotations

# Bits of nvmlClocksEventReason*, named as an operator reads them. Idle is left
# out: an idle GPU clocks down by design, it is not being held back.
_THROTTLE_BITS: tuple[tuple[int, str], ...] = (
    (0x0002, "applications_clocks"),
    (0x0004, "sw_power"),
    (0x0008, "hw_slowdown"),
    (0x0010, "sync_boost"),
    (0x0020, "sw_thermal"),
    (0x0040, "hw_thermal"),
    (0x0080, "power_brake"),
    (0x0100, "display_clocks"),
    (0x0200, "board_limit"),
    (0x0400, "reliability"),
)


def decode_throttle(mask: int) -> list[str]:
    """Names of the active clock-throttle reasons in an NVML bit mask (``nvidia-smi -q -d PERFORMANCE``)."""
    return [name for bit, name in _THROTTLE_BITS if mask & bit]


def encode_throttle(names: list[str]) -> int:
    """The NVML bit mask for throttle-reason names (what ``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`` holds)."""
    bits = {name: bit for bit, name in _THROTTLE_BITS}
    mask = 0
    for name in names:
        mask |= bits.get(name, 0)
    return mask
