"""Frames as one plain line of text, for ``gridwatch tail`` and headless output."""

from __future__ import annotations

import time

from gridwatch.wire import protocol as p


def _na(value: float | None, fmt: str = "{:.0f}") -> str:
    return "N/A" if value is None else fmt.format(value)


def frame_line(frame: p.Frame) -> str:
    """One frame as one line; no control character reaches the terminal, whatever built the frame."""
    line = _format(frame)
    # Node text is cleaned on decode; this is the last line before the terminal.
    return p.clean_text(line, len(line))


def _format(frame: p.Frame) -> str:
    ts = time.strftime("%H:%M:%S", time.localtime(frame.ts)) if frame.ts else "--:--:--"
    head = f"{ts} {frame.node} #{frame.seq}"
    if isinstance(frame, p.Sample):
        gpus = " ".join(f"{g.index}:{_na(g.util)}%/{_na(g.temp_c)}C" if g.state == "ok" else f"{g.index}:{g.state}" for g in frame.gpus)
        host = frame.host
        trainer = ""
        if frame.trainer is not None:
            trainer = f" trainer {frame.trainer.phase} step {frame.trainer.step} loss {_na(frame.trainer.loss, '{:.3f}')}"
        return f"{head} sample cpu {_na(host.cpu_percent)}% gpus [{gpus}]{trainer}{' ISOLATED' if frame.isolated else ''}"
    if isinstance(frame, p.Event):
        extra = f" gpu {frame.gpu}" if frame.gpu is not None else ""
        extra += f" code {frame.code}" if frame.code is not None else ""
        return f"{head} event {frame.severity} {frame.kind}{extra}: {frame.message}"
    if isinstance(frame, p.Hello):
        return f"{head} hello v{frame.v} role {frame.role} gpus {len(frame.gpus)} stack {frame.stack.hash[:12]}"
    if isinstance(frame, p.LogLine):
        return f"{head} log {frame.source}: {frame.line}"
    if isinstance(frame, p.Gap):
        return f"{head} GAP frames {frame.from_seq}-{frame.to_seq} lost: {frame.reason}"
    if isinstance(frame, p.ActionResult):
        return f"{head} action {frame.action} {'ok' if frame.ok else 'FAILED'}: {frame.message}"
    if isinstance(frame, p.Error):
        return f"{head} error {frame.code}: {frame.message}"
    return f"{head} {frame.__struct_config__.tag}"
