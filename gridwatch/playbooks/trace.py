"""Read a recorded trace: one frame per line, bare or wrapped as ``{"endpoint": ..., "frame": ...}``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import msgspec

from gridwatch.wire.protocol import Frame, FrameError, decode_any_frame, encode


@dataclass(frozen=True)
class TraceRecord:
    """One usable frame of a trace and where it came from."""

    line_no: int
    endpoint: str  # the agent's endpoint if the recorder wrote it, else the frame's node name
    frame: Frame


@dataclass
class TraceStats:
    """What a trace held, and what could not be used, by reason."""

    lines: int = 0
    frames: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    first_bad_line: dict[str, int] = field(default_factory=dict)  # reason -> line number

    def skip(self, reason: str, line_no: int) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.first_bad_line.setdefault(reason, line_no)

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def describe(self) -> str:
        if not self.skipped:
            return "nothing skipped"
        parts = [f"{n} {reason.replace('_', ' ')} (first at line {self.first_bad_line[reason]})"
                 for reason, n in sorted(self.skipped.items())]
        return f"skipped {self.skipped_total}: " + ", ".join(parts)


_wrapper = msgspec.json.Decoder()


def read_trace(lines: Iterable[str | bytes], stats: TraceStats) -> Iterator[TraceRecord]:
    """Yield every frame that decodes; count every line that does not, by reason."""
    for line_no, raw in enumerate(lines, start=1):
        stats.lines += 1
        text = raw if isinstance(raw, bytes) else raw.encode("utf-8", "replace")
        if not text.strip():
            continue
        endpoint = ""
        try:
            value = _wrapper.decode(text)
            if isinstance(value, dict) and "frame" in value and "type" not in value:
                endpoint = str(value.get("endpoint") or "")
                text = msgspec.json.encode(value["frame"])
        except (msgspec.DecodeError, RecursionError):
            # A line nested hundreds deep is one bad line, like any other garbage.
            stats.skip("garbage", line_no)
            continue
        try:
            frame = decode_any_frame(text)
        except FrameError as exc:
            stats.skip("unknown_type" if exc.code == "unknown_type" else "garbage", line_no)
            continue
        stats.frames += 1
        yield TraceRecord(line_no, endpoint or str(frame.node), frame)


def record_line(endpoint: str, frame: Frame) -> bytes:
    """A trace line as the recorder writes it (tests and tools write traces with this)."""
    return b'{"endpoint":' + msgspec.json.encode(endpoint) + b',"frame":' + encode(frame).rstrip() + b"}\n"
