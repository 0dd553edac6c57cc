"""Training progress read from the lines a job's own trainer prints: step, loss, iteration time, throughput.

``parse_progress`` knows six writers by the line each training loop logs: ``megatron`` (``iteration
N/ M | elapsed time per iteration (ms): ... | lm loss: ...``, also Megatron-DeepSpeed, Megatron-Bridge
and GPT-NeoX), ``nemo`` (NeMo 2's ``Training epoch E, iteration N/M | ... global_step: S |
reduced_train_loss: ...``, NeMo 1's bar with ``reduced_train_loss=``), ``huggingface`` (the Trainer's
``{'loss': ..., 'learning_rate': ..., 'epoch': ...}``), ``lightning`` (the bar ``Epoch E:  22%|██▏ |
4/18 [00:17<01:02,  4.47s/it, loss=10.07]``), ``torchtitan`` (``step: N  loss: ...  tps: 7,282``) and
``deepspeed`` (the engine's ``step=N, skipped=K, lr=[...]`` and its timer's ``...global_step=N,
RunningAvgSamplesPerSec=..., CurrSamplesPerSec=...``).

Evaluation is not training progress and stays ``None`` (``{'eval_loss': ...}``, ``validation loss at
iteration``, ``validate step:``), as do a run's summary (``{'train_runtime': ...}``) and every tqdm bar
not labelled ``Epoch N:``: data loading, sanity checks, and the Hugging Face Trainer's bare bar, which a
log cannot tell from any other. A loss printed as ``nan`` or ``inf`` is kept (a NaN loss is the signal);
any other figure that is not finite is ``None``. Lines are untrusted: nothing is evaluated, every
pattern is bounded, and only the first ``MAX_CHARS`` of a line are read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from gridwatch.agent.detectors.common import rank_of

__all__ = ["FRAMEWORKS", "MAX_CHARS", "JobProgress", "Progress", "ProgressTracker", "parse_progress"]

FRAMEWORKS = ("megatron", "nemo", "huggingface", "lightning", "torchtitan", "deepspeed")
MAX_CHARS = 4096  # ten times the longest progress line in the corpus; a 1 MB line costs no more


class Progress(msgspec.Struct, frozen=True, kw_only=True):
    """One progress line, as its trainer printed it; a figure the line does not carry is ``None``."""

    framework: str
    step: int | None = None  # the optimizer step (Lightning: the batch within the epoch)
    total_steps: int | None = None  # as printed: max steps, or an epoch's batches for Lightning
    loss: float | None = None  # the training loss; nan and inf are kept
    step_time_s: float | None = None  # seconds per iteration
    tokens_per_s: float | None = None  # as printed (torchtitan's tps is per GPU)
    samples_per_s: float | None = None
    lr: float | None = None
    epoch: float | None = None


# A number with bounded digit runs, so int() and float() never see an oversized string.
_N = r"(?:[-+]?(?:\d{1,30}(?:\.\d{0,30})?|\.\d{1,30})(?:[eE][-+]?\d{1,3})?|[-+]?(?:nan|NaN|NAN|inf|Inf|INF))"
_ANSI = re.compile(r"\x1b\[[0-9;?]{0,32}[ -/]{0,4}[@-~]")


def _float(text: str | None, keep_nonfinite: bool = False) -> float | None:
    try:
        value = None if text is None else float(text.replace(",", ""))
    except ValueError:  # "7,,": thousands separators the pattern let through
        return None
    return value if value is None or keep_nonfinite or math.isfinite(value) else None


def _int(text: str | None) -> int | None:
    return None if (value := _float(text)) is None else int(value)  # NeMo prints global_step=794.0


def _fields(pattern: re.Pattern[str], line: str) -> dict[str, str]:
    """Key -> value text for every ``key: value`` the pattern finds; the first of a key wins."""
    found: dict[str, str] = {}
    for match in pattern.finditer(line):
        found.setdefault(match.group(1), match.group(2))
    return found


def _first(found: dict[str, str], *keys: str) -> str | None:
    return next((found[k] for k in keys if k in found), None)


# ---------------------------------------------------------------- the writers

_MEGATRON = re.compile(r"iteration\s{1,20}(\d{1,12})/\s{0,20}(\d{1,12}) \|")
_MEGATRON_FIELD = re.compile(r"(?:^ *|\| )([A-Za-z][\w ()/-]{0,60}?): +(" + _N + r")")


def _megatron(line: str) -> Progress | None:
    if (head := _MEGATRON.search(line)) is None:
        return None
    f = _fields(_MEGATRON_FIELD, line)
    ms = _float(f.get("elapsed time per iteration (ms)"))
    return Progress(
        framework="megatron", step=int(head.group(1)), total_steps=int(head.group(2)),
        loss=_float(_first(f, "lm loss", "lm_loss", "loss"), keep_nonfinite=True),
        step_time_s=None if ms is None else ms / 1000.0,
        tokens_per_s=_float(f.get("tokens per gpu per second (tgs)")),
        samples_per_s=_float(_first(f, "samples per second", "samples/sec")),
        lr=_float(f.get("learning rate")),
    )


_NEMO = re.compile(r"Training epoch (\d{1,9}), iteration (\d{1,12})/(\d{1,12})")
_NEMO_FIELD = re.compile(r"\| ([a-z_][\w ]{0,40}?): (" + _N + r")")


def _nemo(line: str) -> Progress | None:
    if (head := _NEMO.search(line)) is None:
        return None
    f = _fields(_NEMO_FIELD, line)
    step = _int(f.get("global_step"))  # the iteration counts within an epoch; global_step does not
    return Progress(
        framework="nemo", step=int(head.group(2)) if step is None else step, total_steps=int(head.group(3)),
        loss=_float(f.get("reduced_train_loss"), keep_nonfinite=True),
        step_time_s=_float(f.get("train_step_timing in s")), lr=_float(f.get("lr")), epoch=float(head.group(1)),
    )


# The bar tqdm draws for Lightning, with or without the bar itself (notebooks print "34% 1020/3000"),
# and with "?" as the total of an iterable dataset.
_BAR = re.compile(r"Epoch (\d{1,9}): {0,4}(?:\d{1,3}%)? {0,4}(?:\|[^|]{0,400}\|)? {0,4}(\d{1,12})/(\d{1,12}|\?) \[([^\]]{0,3000})")
_RATE = re.compile(r", {0,4}(\d{1,12}(?:\.\d{1,12})?)(s/it|it/s|s/batch|batch/s)")
_POSTFIX = re.compile(r"(?:, |^)([A-Za-z_][\w./-]{0,80})=(" + _N + r")")


def _lightning(line: str) -> Progress | None:
    if (head := _BAR.search(line)) is None:
        return None
    inner = head.group(4)
    rate = _RATE.search(inner)
    step_time = None
    if rate is not None:
        value = float(rate.group(1))
        step_time = value if rate.group(2).startswith("s/") else (1.0 / value if value > 0 else None)
    f = _fields(_POSTFIX, inner[rate.end():] if rate is not None else inner)
    nemo = "reduced_train_loss" in f or "global_step" in f
    global_step = _int(f.get("global_step"))
    loss_keys = ("reduced_train_loss", "loss") if nemo else ("train_loss_step", "train_loss", "loss")
    return Progress(
        framework="nemo" if nemo else "lightning",
        step=int(head.group(2)) if global_step is None else global_step,
        total_steps=None if head.group(3) == "?" else int(head.group(3)),
        loss=_float(_first(f, *loss_keys), keep_nonfinite=True), step_time_s=step_time,
        lr=_float(_first(f, "lr", "learning_rate")), epoch=float(head.group(1)),
    )


# Keys read one at a time from the dict's text: never evaluated, each value a bounded number.
_HF_FIELD = re.compile(r"'(loss|learning_rate|epoch|step)': '?(" + _N + r")")


def _huggingface(line: str) -> Progress | None:
    f = _fields(_HF_FIELD, line)
    if "loss" not in f or "epoch" not in f:  # Lightning prints {'loss': ...} dicts too, without an epoch
        return None
    return Progress(framework="huggingface", step=_int(f.get("step")),
                    loss=_float(f["loss"], keep_nonfinite=True), lr=_float(f.get("learning_rate")),
                    epoch=_float(f["epoch"]))


_TITAN = re.compile(r"(?<!validate )\bstep:\s{0,8}(\d{1,12})\s{1,8}loss:\s{0,8}(" + _N + r")")
_TITAN_FIELD = re.compile(r"\b(tps|wps|lr): {0,8}(\d[\d,]{0,30}(?:\.\d{1,20})?(?:[eE][-+]?\d{1,3})?)")


def _torchtitan(line: str) -> Progress | None:
    if (head := _TITAN.search(line)) is None:
        return None
    f = _fields(_TITAN_FIELD, line[head.end():])
    return Progress(framework="torchtitan", step=int(head.group(1)),
                    loss=_float(head.group(2), keep_nonfinite=True),
                    tokens_per_s=_float(_first(f, "tps", "wps")), lr=_float(f.get("lr")))


_DS_STEP = re.compile(r"\bstep=(\d{1,12}), skipped=\d{1,12}, lr=\[(" + _N + r")")
# The throughput timer: "epoch=0/micro_step=34/global_step=34, RunningAvg...=, CurrSamplesPerSec=" or "] 0/25, SamplesPerSec=".
_DS_TIMER = re.compile(r"(?:epoch=(\d{1,9})/micro_step=\d{1,12}/global_step=|\] (\d{1,9})/)(\d{1,12}), "
                       r"(?:RunningAvgSamplesPerSec=" + _N + r", CurrSamplesPerSec=|SamplesPerSec=)(" + _N + r")")


def _deepspeed(line: str) -> Progress | None:
    if (step := _DS_STEP.search(line)) is not None:
        return Progress(framework="deepspeed", step=int(step.group(1)), lr=_float(step.group(2)))
    if (timer := _DS_TIMER.search(line)) is None:
        return None
    return Progress(framework="deepspeed", step=int(timer.group(3)), samples_per_s=_float(timer.group(4)),
                    epoch=float(timer.group(1) or timer.group(2)))


# Each writer behind two plain substrings all its lines contain: a line that is no progress costs a few
# `in` tests (memchr-fast) and no regex. NeMo 2 before Megatron: its line also says "iteration N/M |".
_WRITERS: tuple[tuple[str, str, Callable[[str], Progress | None]], ...] = (
    ("Training epoch ", "", _nemo),
    ("iteration", " | ", _megatron),
    ("Epoch ", "/", _lightning),
    ("'loss': ", "'epoch': ", _huggingface),
    ("step:", "loss:", _torchtitan),
    ("step=", "skipped=", _deepspeed),
    ("SamplesPerSec=", "", _deepspeed),
)


def _visible(line: str) -> str:
    """The part of a raw line a terminal would show last: tqdm rewrites itself after a carriage return."""
    end = len(line)
    for _ in range(4):  # bounded: a line of a million "\r" costs four searches, not a million
        cut = line.rfind("\r", 0, end)
        if cut < 0 or line[cut + 1:end].strip():
            return line[cut + 1:end]
        end = cut
    return line[:end]


def parse_progress(line: str) -> Progress | None:
    """The progress a trainer's log line reports, or ``None`` for any other line."""
    if "\r" in line:
        line = _visible(line)
    line = line[:MAX_CHARS]
    if "\x1b" in line:  # torchtitan colours its metrics
        line = _ANSI.sub("", line)
    for first, second, parse in _WRITERS:  # a plain loop: all() over a generator costs more than the tests
        if first in line and second in line:
            progress = parse(line)
            if progress is not None:
                return progress
    return None


# ---------------------------------------------------------------- folding lines into a job's status


@dataclass
class JobProgress:
    """What one log says of its job's training: the newest of each figure, and the restarts it saw.

    For Lightning, ``step`` counts batches from the run's start (epoch × batches per epoch + batch)
    when the bar shows its total. ``restarted_from`` is (the step it went back to, the step it had
    reached) at the latest restart; a Hugging Face log names epochs only: ``restarted_from_epoch``.
    """

    framework: str
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    lr: float | None = None
    epoch: float | None = None
    ts: float = 0.0  # when the newest progress line was read
    lines: int = 0
    restarts: int = 0
    restarted_from: tuple[int, int] | None = None
    restarted_from_epoch: tuple[float, float] | None = None
    steps_lost: int = 0  # steps trained again after every restart


_FIGURES = ("total_steps", "loss", "step_time_s", "tokens_per_s", "samples_per_s", "lr", "epoch")
_MAX_STREAMS = 256  # ranks a log may name before its marks are forgotten (a hostile log names many)
_Order = tuple[float, float]


def _where(p: Progress) -> tuple[_Order, int | None] | None:
    """How a line orders in its run, and its steps from the run's start when known; None: it cannot say."""
    if p.framework == "lightning" and p.step is not None and p.epoch is not None:
        return (p.epoch, p.step), int(p.epoch) * p.total_steps + p.step if p.total_steps else None
    if p.step is not None:
        return (0.0, p.step), p.step
    return ((p.epoch, 0.0), None) if p.epoch is not None else None


class ProgressTracker:
    """Folds progress lines into the newest status per log, and notices a job restarted from a checkpoint.

    A step that goes back is a restart only within one stream (one framework, one rank): a rank whose
    lines lag the others' is none, and every rank going back after the same restart counts it once.
    """

    def __init__(self) -> None:
        self._jobs: dict[str, JobProgress] = {}
        self._marks: dict[tuple[str, str, str], _Order] = {}  # (log, framework, rank) -> its newest line
        # (log, framework) -> where the job is: order, steps, epoch
        self._heads: dict[tuple[str, str], tuple[_Order, int | None, float | None]] = {}

    def feed(self, log: str, line: str, ts: float = 0.0) -> Progress | None:
        """Parse one line of ``log`` and fold it in; the progress it showed, or ``None``."""
        progress = parse_progress(line)
        if progress is not None:
            self.update(log, progress, rank_of(line), ts)
        return progress

    def update(self, log: str, p: Progress, rank: str = "", ts: float = 0.0) -> JobProgress:
        """Fold one parsed line of ``log`` (printed by ``rank``) into its status."""
        job = self._jobs.setdefault(log, JobProgress(framework=p.framework))
        job.lines += 1
        if (where := _where(p)) is not None:
            order, steps = where
            stream, key = (log, p.framework, rank), (log, p.framework)
            mark, head = self._marks.get(stream), self._heads.get(key)
            if len(self._marks) >= _MAX_STREAMS and stream not in self._marks:
                self._marks.clear()
            self._marks[stream] = order
            if head is not None and order < head[0]:
                if mark is None or order >= mark:
                    return job  # a lagging rank's older figures, or a rank catching up after a restart
                job.restarts += 1
                if steps is not None and head[1] is not None:
                    job.restarted_from = (steps, head[1])
                    job.steps_lost += head[1] - steps
                if p.epoch is not None and head[2] is not None:
                    job.restarted_from_epoch = (p.epoch, head[2])
            self._heads[key] = (order, steps, p.epoch)
            if (step := steps if steps is not None else p.step) is not None:
                job.step = step
        job.framework, job.ts = p.framework, ts
        for name in _FIGURES:
            if (value := getattr(p, name)) is not None:
                setattr(job, name, value)
        return job

    def status(self, log: str) -> JobProgress | None:
        """The folded status of ``log``, or ``None`` before its first progress line."""
        return self._jobs.get(log)

    def logs(self) -> dict[str, JobProgress]:
        """Every log that printed progress, by path."""
        return dict(self._jobs)
