"""Progress parsers against real trainer lines: every line read to its figures, quiet lines left quiet, hostile lines harmless.

The corpus is ``tests/data/progress/*.jsonl``, one record a line:
``{"line": ..., "framework": "megatron" | null, "fields": {"step": 5426, ...}, "source": ...}``.
``framework: null`` is a line that must give no progress (``why`` says what it is). ``fields`` lists every
figure the line carries; a figure it does not list must be ``None``; ``"nan"`` stands for a NaN. Each
line was copied from its ``source``, a public bug report, pull request or document.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gridwatch.agent.detectors.progress import FRAMEWORKS, MAX_CHARS, Progress, ProgressTracker, parse_progress

CORPUS = Path(__file__).parent / "data" / "progress"
FIGURES = ("step", "total_steps", "loss", "step_time_s", "tokens_per_s", "samples_per_s", "lr", "epoch")


@dataclass(frozen=True)
class Record:
    line: str
    framework: str | None
    fields: dict[str, Any]
    source: str
    where: str  # file:line, for failure messages


def load_corpus() -> list[Record]:
    records = []
    for path in sorted(CORPUS.glob("*.jsonl")):
        for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if raw.strip():
                r = json.loads(raw)
                records.append(Record(r["line"], r["framework"], r["fields"], r["source"], f"{path.name}:{n}"))
    return records


RECORDS = load_corpus()
PROGRESS = [r for r in RECORDS if r.framework is not None]
QUIET = [r for r in RECORDS if r.framework is None]


def _same(want: Any, have: float | int | None) -> bool:
    if want is None or have is None:
        return want is None and have is None
    if want == "nan":
        return math.isnan(have)
    return math.isclose(float(want), float(have), rel_tol=1e-9)


def _line(framework: str, n: int = 0) -> str:
    """The ``n``-th real line of ``framework`` in the corpus."""
    return [r.line for r in PROGRESS if r.framework == framework][n]


def test_the_corpus_is_real_and_covers_every_framework() -> None:
    lines: dict[str, int] = defaultdict(int)
    sources: dict[str, set[str]] = defaultdict(set)
    for r in RECORDS:
        assert r.source.startswith("https://"), f"{r.where}: a line needs its source"
        assert r.framework is None or r.framework in FRAMEWORKS, f"{r.where}: unknown framework {r.framework}"
        assert set(r.fields) <= set(FIGURES), f"{r.where}: unknown figure in {sorted(r.fields)}"
        if r.framework is not None:
            lines[r.framework] += 1
            sources[r.framework].add(r.source)
    for framework in FRAMEWORKS:
        assert lines[framework] >= 4 and len(sources[framework]) >= 2, f"{framework}: {lines[framework]} lines"
    assert len(QUIET) >= 15


@pytest.mark.parametrize("record", PROGRESS, ids=[r.where for r in PROGRESS])
def test_every_progress_line_reads_to_its_figures(record: Record) -> None:
    progress = parse_progress(record.line)
    assert progress is not None, f"{record.where}: no progress in {record.line[:120]!r}"
    assert progress.framework == record.framework
    wrong = {name: (record.fields.get(name), getattr(progress, name)) for name in FIGURES
             if not _same(record.fields.get(name), getattr(progress, name))}
    assert not wrong, f"{record.where}: (expected, got) {wrong}"


@pytest.mark.parametrize("record", QUIET, ids=[r.where for r in QUIET])
def test_quiet_lines_give_no_progress(record: Record) -> None:
    assert parse_progress(record.line) is None, f"{record.where}: {record.line[:120]!r}"


def test_a_nan_loss_is_kept_and_other_nonfinite_figures_are_not() -> None:
    line = _line("huggingface").replace("'loss': 2.119", "'loss': nan").replace("4.5833333333333334e-05", "inf")
    progress = parse_progress(line)
    assert progress is not None and progress.loss is not None and math.isnan(progress.loss)
    assert progress.lr is None and progress.epoch == 0.25
    megatron = _line("megatron", 2).replace("lm loss: 2.504220E+00", "lm loss: -inf")
    assert parse_progress(megatron) == Progress(framework="megatron", step=122, total_steps=250000, loss=-math.inf,
                                                step_time_s=86.5452, lr=9.150e-06)


def test_colours_and_carriage_returns_are_read_through() -> None:
    plain = _line("torchtitan")  # step 14
    coloured = plain.replace("step:", "\x1b[31mstep:").replace("loss:", "\x1b[32mloss:").replace("tps:", "\x1b[34mtps:") + "\x1b[39m"
    assert parse_progress(coloured) == parse_progress(plain)
    # tqdm redraws itself after "\r": the last drawing is the one a terminal shows.
    first, later = _line("lightning", 1), _line("lightning", 3)
    progress = parse_progress(first + "\r" + later + "\r")
    assert progress is not None and progress.step == 4


@pytest.mark.parametrize("line", [
    "{'loss': __import__('os').system('touch /tmp/owned'), 'epoch': 1.0}",
    "{'loss': 1.0, 'epoch': __import__('os')}",
    "{'loss': (lambda: 0)(), 'learning_rate': 1e-4, 'epoch': 1.0}",
    "\x1b]0;title\x07\x1b[2J\x1b[999999999999999999999m{'loss': \x1b[31m",
    "iteration " + "9" * 5000 + "/1 | lm loss: 1.0 |",
    "step: 1 loss: " + "9" * 5000,
    "Epoch 0: " + "|" * 100_000,
])
def test_hostile_lines_are_refused_without_evaluating_anything(line: str) -> None:
    progress = parse_progress(line)
    assert progress is None or all(v is None or isinstance(v, (int, float, str)) for v in map(progress.__getattribute__, FIGURES))
    assert not Path("/tmp/owned").exists()


@pytest.mark.parametrize("filler", ["a", "iteration 1/2 | ", "{'loss': 1.0, ", "Epoch 1: 50%|", "step: 1 ", "\r", "\x1b[", "9"])
def test_a_megabyte_line_reads_only_its_head(filler: str) -> None:
    line = filler * (1_000_000 // len(filler))
    progress = parse_progress(line)  # the suite's timeout bounds it; bench_progress.py measures it
    assert progress is None or progress.framework in FRAMEWORKS
    head = _line("megatron", 2)
    assert parse_progress(head + " " * (MAX_CHARS - len(head)) + "x" * 1_000_000) == parse_progress(head)


def test_the_tracker_keeps_the_newest_figures_of_a_log() -> None:
    tracker = ProgressTracker()
    for n, record in enumerate(r for r in PROGRESS if "Megatron-LLM/issues/11" in r.source):
        tracker.feed("/logs/train.out", record.line, ts=float(n))
    job = tracker.status("/logs/train.out")
    assert job is not None and job.framework == "megatron"
    assert (job.step, job.total_steps, job.loss, job.restarts, job.lines) == (202, 250000, 2.413736, 0, 4)
    assert tracker.status("/logs/other.out") is None and list(tracker.logs()) == ["/logs/train.out"]
    assert tracker.feed("/logs/train.out", QUIET[0].line) is None and job.lines == 4


def test_a_step_going_back_is_a_restart_from_a_checkpoint() -> None:
    tracker = ProgressTracker()
    lines = {r.fields["step"]: r.line for r in PROGRESS if "Megatron-LLM/issues/11" in r.source}
    for step in (122, 123, 201, 202, 122, 123):
        tracker.feed("/logs/train.out", lines[step])
    job = tracker.status("/logs/train.out")
    assert job is not None
    assert (job.restarts, job.restarted_from, job.steps_lost, job.step, job.loss) == (1, (122, 202), 80, 123, 2.493043)


def test_every_rank_going_back_counts_one_restart_and_a_lagging_rank_none() -> None:
    tracker = ProgressTracker()
    rank0 = [r.line for r in PROGRESS if "torchtitan/pull/3393" in r.source]  # steps 14, 15, 16 on [rank0]
    rank1 = [line.replace("[rank0]", "[rank1]") for line in rank0]
    for line in (rank0[0], rank0[1], rank1[0], rank0[2], rank1[1], rank1[2]):  # rank 1 lags a step behind
        tracker.feed("/logs/titan.log", line)
    job = tracker.status("/logs/titan.log")
    assert job is not None and (job.step, job.restarts, job.loss) == (16, 0, 3.05047)
    for line in (rank0[0], rank1[0], rank0[1], rank1[1]):  # both ranks restart from step 14
        tracker.feed("/logs/titan.log", line)
    assert (job.step, job.restarts, job.restarted_from, job.steps_lost) == (15, 1, (14, 16), 2)


def test_lightning_steps_count_through_epochs_and_hugging_face_restarts_by_epoch() -> None:
    tracker = ProgressTracker()
    end_of_32, into_33 = (r.line for r in PROGRESS if "pytorch-lightning/issues/675" in r.source)
    tracker.feed("lightning", end_of_32)
    tracker.feed("lightning", into_33)
    job = tracker.status("lightning")
    assert job is not None and (job.step, job.epoch, job.restarts) == (33 * 331 + 18, 33.0, 0)
    tracker.feed("lightning", end_of_32)
    assert (job.restarts, job.restarted_from) == (1, (32 * 331 + 331, 33 * 331 + 18))
    later, earlier = _line("huggingface", 7), _line("huggingface", 6)  # epochs 0.28, then 0.1
    tracker.feed("hf", earlier)
    tracker.feed("hf", later)
    tracker.feed("hf", earlier)
    hf = tracker.status("hf")
    assert hf is not None and (hf.restarts, hf.restarted_from, hf.restarted_from_epoch) == (1, None, (0.1, 0.28))


def test_an_iterable_epoch_without_a_total_is_no_restart_and_a_mixed_log_keeps_its_step() -> None:
    tracker = ProgressTracker()
    deep_in_0, start_of_1 = (r.line.replace("/150000 ", "/? ").replace("/146256 ", "/? ")
                             for r in PROGRESS if "anemoi-core" in r.source)
    tracker.feed("iterable", deep_in_0)
    tracker.feed("iterable", start_of_1)
    job = tracker.status("iterable")
    assert job is not None and (job.step, job.epoch, job.total_steps, job.restarts) == (0, 1.0, None, 0)
    # The Hugging Face Trainer under DeepSpeed: the engine names the step, the Trainer the loss and epoch.
    tracker.feed("mixed", _line("deepspeed", 1))  # step=35
    tracker.feed("mixed", _line("huggingface", 0))
    mixed = tracker.status("mixed")
    assert mixed is not None and (mixed.step, mixed.loss, mixed.epoch, mixed.restarts) == (35, 2.119, 0.25, 0)
