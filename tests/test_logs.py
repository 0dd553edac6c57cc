"""Log tailing: nothing written after start is lost through rotation, truncation or re-creation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gridwatch.agent.logs import LogTailer, parse_kmsg_record
from gridwatch.wire.protocol import MAX_LINE_CHARS


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _lines(tailer: LogTailer) -> list[str]:
    return [line for _, line, _ in tailer.poll()[0]]


def _append(path: Path, *lines: str | bytes) -> None:
    with open(path, "ab") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else line.encode() + b"\n")


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "trainer.log"
    path.write_text("old line from before the agent started\n")
    return path


def _tailer(*paths: Path, **kw) -> LogTailer:
    return LogTailer([str(p) for p in paths], kernel=False, **kw)


def test_new_lines_arrive_with_source_and_time_and_carry_events(log: Path) -> None:
    clock = Clock()
    tailer = _tailer(log, clock=clock)
    assert tailer.poll() == ([], [])
    _append(log, "step 10 loss: 2.1", "step 11 loss: nan")
    clock.t = 101.0
    entries, events = tailer.poll()
    assert entries == [(str(log), "step 10 loss: 2.1", 101.0), (str(log), "step 11 loss: nan", 101.0)]
    assert [(e.kind, e.source) for e in events] == [("nan_loss", f"log:{log}")]


def test_a_partial_line_waits_for_its_newline(log: Path) -> None:
    tailer = _tailer(log)
    _append(log, b"half a li")
    assert _lines(tailer) == []
    _append(log, b"ne\n")
    assert _lines(tailer) == ["half a line"]


def test_a_1mb_line_is_clipped_and_escape_sequences_and_garbage_are_defused(log: Path) -> None:
    tailer = _tailer(log)
    _append(log, "\x1b[31mred\x1b[0m " + "x" * (1 << 20), bytes(b for b in range(256) if b != 10) + b"\n", "after")
    lines = []
    for _ in range(4):
        lines += _lines(tailer)
    huge, garbage, after = lines
    assert huge.startswith("[31mred[0m xxx") and len(huge) <= MAX_LINE_CHARS + 1
    assert not any(ch in garbage for ch in "\x00\x1b\x07\x9b")
    assert "\ufffd" in garbage  # undecodable bytes are shown, not dropped
    assert after == "after"


def test_rotation_loses_no_line_written_to_either_file(log: Path) -> None:
    tailer = _tailer(log)
    writer = open(log, "ab", buffering=0)
    writer.write(b"one\n")
    assert _lines(tailer) == ["one"]
    os.rename(log, str(log) + ".1")
    writer.write(b"two (old file, after rename)\n")
    _append(log, "three (new file)")
    writer.close()
    assert _lines(tailer) == ["two (old file, after rename)", "three (new file)"]
    _append(log, "four")
    assert _lines(tailer) == ["four"]


def test_truncation_reads_the_file_again_from_its_start(log: Path) -> None:
    tailer = _tailer(log)
    _append(log, "a much longer line before truncation")
    assert _lines(tailer) == ["a much longer line before truncation"]
    log.write_text("")
    _append(log, "after")
    assert _lines(tailer) == ["after"]


def test_deleted_and_recreated_file_is_followed(log: Path) -> None:
    tailer = _tailer(log)
    _append(log, "before delete")
    log.unlink()
    assert _lines(tailer) == ["before delete"]
    assert _lines(tailer) == []
    _append(log, "recreated 1", "recreated 2")
    assert _lines(tailer) == ["recreated 1", "recreated 2"]


def test_a_file_that_appears_later_is_read_from_its_start(tmp_path: Path) -> None:
    later = tmp_path / "later.log"
    tailer = _tailer(later)
    assert _lines(tailer) == []
    _append(later, "first", "second")
    assert _lines(tailer) == ["first", "second"]


def test_a_flood_is_read_in_bounded_polls_without_losing_lines(log: Path) -> None:
    tailer = _tailer(log, read_bytes=64 * 1024)
    _append(log, *(f"line {i:06d} " + "y" * 90 for i in range(5000)))
    first = _lines(tailer)
    assert 0 < len(first) < 1000
    seen = list(first)
    for _ in range(20):
        seen += _lines(tailer)
    assert [s[:11] for s in seen] == [f"line {i:06d}" for i in range(5000)]


@pytest.mark.parametrize("budget", [150_000, 1 << 20])
def test_a_poll_reads_in_chunks_up_to_its_budget_whole_lines_in_order(log: Path, budget: int) -> None:
    """Past one read's chunk (64 KiB) a poll reads on, to its budget and no further: the same lines as one read."""
    tailer = _tailer(log, read_bytes=budget)
    _append(log, *(f"line {i:06d} " + "z" * 88 for i in range(5000)))  # 101 bytes a line with its newline
    first = _lines(tailer)
    assert len(first) == min(budget // 101, 5000)
    seen = list(first)
    while more := _lines(tailer):
        seen += more
    assert [s[:11] for s in seen] == [f"line {i:06d}" for i in range(5000)]


def test_search_by_pattern_and_time_newest_first_limit(log: Path) -> None:
    clock = Clock(10.0)
    tailer = _tailer(log, clock=clock, buffer_lines=100)
    for t in range(10, 16):
        clock.t = float(t)
        _append(log, f"t={t} NCCL WARN something", f"t={t} ordinary")
        tailer.poll()
    assert [line for _, line, _ in tailer.search("NCCL", since=12, until=14)] == [
        "t=12 NCCL WARN something",
        "t=13 NCCL WARN something",
        "t=14 NCCL WARN something",
    ]
    assert [ts for _, _, ts in tailer.search("NCCL", limit=2)] == [14.0, 15.0]
    with pytest.raises(ValueError, match=r"^'\(unclosed' is not a regular expression: missing \)"):
        tailer.search("(unclosed")


def test_the_line_buffer_is_bounded(log: Path) -> None:
    tailer = _tailer(log, buffer_lines=100)
    _append(log, *(f"n{i}" for i in range(150)))
    tailer.poll()
    found = tailer.search("^n", limit=1000)
    assert len(found) == 100 and found[0][1] == "n50"


def test_kernel_log_is_quietly_absent_when_unreadable_and_read_when_it_is(tmp_path: Path) -> None:
    assert LogTailer([], kernel_paths=[str(tmp_path / "no-such-kmsg")]).sources == []
    kern = tmp_path / "kern.log"
    kern.write_text("")
    tailer = LogTailer([], kernel_paths=[str(tmp_path / "absent"), str(kern)])
    assert tailer.sources == [str(kern)]
    _append(kern, "kernel: NVRM: Xid (PCI:0000:3b:00): 48, pid=77, DBE (double bit error)")
    entries, events = tailer.poll()
    assert len(entries) == 1 and [(e.kind, e.code) for e in events] == [("xid", 48)]


def test_kmsg_record_parsing() -> None:
    record = b"4,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n SUBSYSTEM=pci\n"
    assert parse_kmsg_record(record) == b"NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."


def test_a_traceback_event_names_its_exception(log: Path) -> None:
    tailer = _tailer(log)
    _append(
        log,
        "Traceback (most recent call last):",
        '  File "train.py", line 10, in <module>',
        "    loss.backward()",
        "RuntimeError: NCCL communicator was aborted on rank 3.",
    )
    (event,) = tailer.poll()[1]
    assert event.kind == "traceback"
    assert event.message == "Python traceback: RuntimeError: NCCL communicator was aborted on rank 3."


def test_a_flood_of_one_error_is_folded_not_forwarded_line_by_line(log: Path) -> None:
    tailer = _tailer(log)
    _append(log, *(f"node1:22:33 [0] NCCL WARN retry {i}" for i in range(1000)))
    entries, events = tailer.poll()
    assert len(entries) == 1000
    assert len(events) == 5 and events[-1].details["suppressed"] == "995"
