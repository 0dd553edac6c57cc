"""A sampling profile of a console or a relay, by stage: where each frame's time goes.

Reads py-spy's raw output (``py-spy record -f raw``: one collapsed stack a line, root first, then a
sample count) and puts each sample in the innermost stage its stack reaches: GC and logging inside the
store count as GC and logging, the store inside Textual's timer counts as the store. Samples of threads
blocked (the event loop's poll, a lock, a blocking read) are idle, kept out of the shares: not CPU.

    .venv/bin/python benchmarks/profile_stages.py PROFILE.raw [...]
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

# (stage, what a frame of it says), innermost stage first when several match one frame.
# A frame reads "function (path:line)" or, native, "function (library.so)".
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Threads blocked (the loop's poll, the executor's queue and its blocking reads, SQLite's fsync):
    # py-spy samples them with --native too, and they cost no CPU.
    ("idle (poll)", ("epoll_wait", "select.epoll", "(selectors.py", "clock_nanosleep", "poll (libc",
                     "PyThread_acquire_lock_timed", "pthread_cond_timedwait", "pthread_cond_wait", "fdatasync",
                     "read (libc")),
    ("GC", ("gc_collect", "gcmodule", "collect_with_callback", "collect_generations", "collector.py")),
    ("logging", ("loguru/",)),
    ("relay envelope", ("wire/envelopes.py", "relay/service.py", "_on_relay_line", "relayed (")),
    ("decode", ("wire/codec.py", "msgspec", "wire/text.py")),
    ("store", ("console/fleet/state.py", "console/fleet/history.py", "console/fleet/rows.py",
               "console/fleet/node.py")),
    ("goodput", ("goodput_tracker.py", "console/fleet/jobstate.py")),
    ("engine", ("gridwatch/playbooks/",)),
    ("framing", ("_on_line", "LineBuffer", "sshlink/lines.py", "asyncio/streams.py", "readuntil")),
    ("SSH read and decrypt", ("asyncssh/", "cryptography", "libcrypto", "libssl", "_openssl", "sshlink/lean.py",
                              "ssh2/", "libssh2")),
    ("on_frame and its hooks", ("console/runtime/frames.py", "serve_console.<locals>.on_frame")),
    # Once a tick, not per frame: the views' paint and the runtime's own ticks (engine, recoveries, hangs).
    ("views' draw (tick)", ("gridwatch/console/tui/",)),
    ("runtime ticks", ("gridwatch/console/runtime/",)),
    ("Textual pump and timers", ("textual/", "rich/")),
    ("event loop", ("asyncio/",)),
)


def _match(frame: str) -> str | None:
    for stage, marks in RULES:
        if any(mark in frame for mark in marks):
            return stage
    return None


def stage_of(stack: list[str]) -> str:
    """The innermost stage a stack (root first) reaches; "other" when none.

    Textual's own code painting on a view's behalf is the view's draw: the cost is the view's to cut.
    """
    found = None
    for frame in reversed(stack):
        stage = _match(frame)
        if stage is None:
            continue
        if found is None:
            if stage != "Textual pump and timers":
                return stage
            found = stage
        elif stage == "views' draw (tick)":
            return stage
    return found or "other"


def read_raw(lines: Iterable[str]) -> Counter[str]:
    """Samples per stage from py-spy raw lines."""
    counts: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if stack and count.isdigit():
            counts[stage_of(stack.split(";"))] += int(count)
    return counts


def table(counts: Counter[str], per: float | None = None, unit: str = "") -> list[str]:
    """The stages by share of CPU samples (idle left out); with ``per``, each share of that figure too."""
    busy = {stage: n for stage, n in counts.items() if stage != "idle (poll)"}
    total = sum(busy.values()) or 1
    rows = [f"    {'stage':<24} {'samples':>8} {'share':>7}" + (f" {unit:>12}" if per is not None else "")]
    for stage, n in sorted(busy.items(), key=lambda kv: -kv[1]):
        share = n / total
        rows.append(f"    {stage:<24} {n:8d} {100 * share:6.1f} %" + (f" {share * per:12.1f}" if per is not None else ""))
    rows.append(f"    {'(idle, not counted)':<24} {counts.get('idle (poll)', 0):8d}")
    return rows


def main() -> int:
    for name in sys.argv[1:]:
        print(name)
        print("\n".join(table(read_raw(Path(name).read_text().splitlines()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
