"""Detectors against real log lines: every fault kind found, quiet lines left quiet, no line can make them raise.

The corpus is ``tests/data/logcorpus/*.jsonl``, one record a line:
``{"line": ..., "kind": "nan_loss" | null, "fields": {"rank": "3"}, "source": ...}``.
``kind: null`` is a line that must stay quiet; ``fields`` are checked against
``event.details`` (``code`` and ``gpu`` against the event's attributes). Each
line's ``source`` is where it was published; a source starting ``written by us``
marks a line we wrote ourselves, which is checked but left out of the figures.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import asyncssh
import pytest

from gridwatch.agent.detectors import detect
from gridwatch.wire import protocol as p
from gridwatch.wire.protocol import EVENT_KINDS, Event

from .conftest import start_agent, stop_agent

CORPUS = Path(__file__).parent / "data" / "logcorpus"
OURS = "written by us"
RECALL_TARGET = 0.97
PRECISION_TARGET = 0.99


@dataclass(frozen=True)
class Record:
    line: str
    kind: str | None
    fields: dict[str, str]
    source: str
    where: str  # file:line, for failure messages

    @property
    def real(self) -> bool:
        return not self.source.startswith(OURS)


def load_corpus() -> list[Record]:
    records = []
    for path in sorted(CORPUS.glob("*.jsonl")):
        for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if raw.strip():
                r = json.loads(raw)
                records.append(Record(r["line"], r["kind"], r.get("fields", {}), r["source"], f"{path.name}:{n}"))
    return records


RECORDS = load_corpus()


def _field(event: Event, key: str) -> str | None:
    if key in ("code", "gpu"):
        value = getattr(event, key)
        return None if value is None else str(value)
    return event.details.get(key)


@dataclass
class Score:
    """Per-kind hits and misses on real lines, and every wrong answer."""

    hits: Counter[str] = field(default_factory=Counter)
    expected: Counter[str] = field(default_factory=Counter)
    reported: Counter[str] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)

    def recall(self, kind: str) -> float:
        return self.hits[kind] / self.expected[kind]

    @property
    def precision(self) -> float:
        return sum(self.hits.values()) / max(1, sum(self.reported.values()))


def score(records: list[Record]) -> Score:
    s = Score()
    for r in records:
        event = detect(r.line, "/var/log/trainer.log", 1.0)
        got = None if event is None else str(event.kind)
        if r.real:
            if r.kind is not None:
                s.expected[r.kind] += 1
            if got is not None:
                s.reported[got] += 1
                s.hits[got] += got == r.kind
        if got != r.kind:
            s.wrong.append(f"{r.where}: expected {r.kind}, got {got}: {r.line[:120]!r}")
            continue
        for key, want in r.fields.items():
            have = _field(event, key) if event is not None else None
            if have != str(want):  # a field may be written as a number: the event carries text
                s.wrong.append(f"{r.where}: {key} is {have!r}, expected {want!r}: {r.line[:120]!r}")
    return s


def test_the_corpus_is_real_large_and_names_its_sources() -> None:
    real = [r for r in RECORDS if r.real]
    assert sum(r.kind is not None for r in real) >= 150 and sum(r.kind is None for r in real) >= 150
    for r in RECORDS:
        assert r.kind is None or r.kind in EVENT_KINDS, f"{r.where}: unknown kind {r.kind}"
        assert r.source.startswith(("https://", OURS)), f"{r.where}: a line needs its source"


def test_every_kind_is_found_and_quiet_lines_stay_quiet() -> None:
    s = score(RECORDS)
    low = {k: f"{s.hits[k]}/{s.expected[k]}" for k in s.expected if s.recall(k) < RECALL_TARGET}
    assert not low, f"recall below {RECALL_TARGET:.0%}: {low}\n" + "\n".join(s.wrong)
    assert s.precision >= PRECISION_TARGET, f"precision {s.precision:.3f}\n" + "\n".join(s.wrong)


def test_every_expected_field_is_right() -> None:
    # Lines we wrote ourselves count here too: they pin behaviour no public line shows.
    wrong = score(RECORDS).wrong
    assert not wrong, "\n".join(wrong)


def test_random_bytes_never_make_a_detector_raise() -> None:
    rng = random.Random(13)
    for _ in range(3000):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(400)))
        detect(raw.decode("utf-8", "replace"))
        # Fragments of real markers between the noise reach the specific patterns, not just the prefilter.
        detect(raw.decode("latin-1") + rng.choice(RECORDS).line[: rng.randrange(80)])


def test_every_corpus_line_cut_at_every_position_never_makes_a_detector_raise() -> None:
    started = time.monotonic()
    for r in RECORDS:
        line = r.line[:300]
        for cut in range(len(line) + 1):
            detect(line[:cut])
    # A detector that backtracks badly on some line shows here as a slow run.
    assert time.monotonic() - started < 60


async def test_corpus_lines_written_to_a_followed_log_arrive_over_ssh_with_their_fields(keys, tmp_path: Path) -> None:
    from gridwatch.agent.logs import LogTailer

    wanted = {
        "nan_loss": "grad_norm",
        "cuda_error": "cudaErrorIllegalAddress",
        "ecc_dbe": "cudaErrorECCUncorrectable",
        "worker_failed": "SIGKILL",
        "nccl_timeout": "_REDUCE_SCATTER_BASE",
    }
    picked = []
    for kind, marker in wanted.items():
        r = next(r for r in RECORDS if r.real and r.kind == kind and marker in json.dumps(r.fields))
        picked.append(r)
    log = tmp_path / "trainer.log"
    log.write_text("")
    ra = await start_agent(keys, interval=0.05, tailer=LogTailer([str(log)], kernel=False))
    try:
        conn = await asyncssh.connect(
            "127.0.0.1", ra.port, username="t", client_keys=[str(keys.viewer_key)], known_hosts=str(keys.known_hosts)
        )
        async with conn:
            proc = await conn.create_process(subsystem="gridwatch", encoding=None)
            assert isinstance(p.decode_agent_frame(await asyncio.wait_for(proc.stdout.readline(), 10)), p.Hello)
            proc.stdin.write(p.encode(p.Subscribe()))
            quiet = [r.line for r in RECORDS if r.real and r.kind is None][:20]
            with log.open("a", encoding="utf-8") as f:
                for r in picked:
                    f.write("\n".join(quiet[:4]) + "\n" + r.line + "\n")
            events: dict[str, Event] = {}

            async def read() -> None:
                while len(events) < len(picked):
                    frame = p.decode_agent_frame(await proc.stdout.readline())
                    if isinstance(frame, Event) and str(frame.source).startswith("log:"):
                        events[str(frame.kind)] = frame

            await asyncio.wait_for(read(), 20)
    finally:
        await stop_agent(ra)
    assert set(events) == set(wanted)
    for r in picked:
        event = events[str(r.kind)]
        assert event.source == f"log:{log}" and event.node == "node-1"
        for key, want in r.fields.items():
            assert _field(event, key) == str(want), (r.kind, key)


@pytest.mark.parametrize("kind", sorted({r.kind for r in RECORDS if r.kind}))
def test_each_kind_has_enough_real_lines_to_measure(kind: str) -> None:
    assert sum(1 for r in RECORDS if r.real and r.kind == kind) >= 3
