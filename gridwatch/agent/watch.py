"""Metric conditions evaluated on the node, as DCGM's policies are: a console need not see every sample to notice one.

A console sends the conditions of its playbooks (:class:`gridwatch.wire.protocol.Watch`:
metric, comparison, threshold, seconds held; data, never code). Each tick the
agent reads them on its own sample and reports transitions only: a
``condition_held`` event when one has held its window on a GPU, a
``condition_cleared`` event when it stops holding there.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

from gridwatch.wire import protocol as p

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
}


def watch_refusal(watch: p.Watch) -> str:
    """Why the agent cannot evaluate ``watch`` (one sentence), or '' when it can."""
    if str(watch.metric) not in p.WATCH_METRICS:
        return f"the agent cannot evaluate metric {str(watch.metric)!r}; it evaluates {', '.join(sorted(p.WATCH_METRICS))}"
    if str(watch.op) not in p.WATCH_OPS:
        return f"unknown comparison {str(watch.op)!r}; use one of {' '.join(sorted(p.WATCH_OPS))}"
    if not (watch.hold >= 0 and watch.threshold == watch.threshold):
        return "a condition needs a number to compare with and a window of 0 s or more"
    return ""


def watch_text(watch: p.Watch) -> str:
    """The condition as a playbook writes it (``gpu.temperature > 90 for 60s``)."""
    text = f"{watch.metric} {watch.op} {watch.threshold:g}"
    return f"{text} for {watch.hold:g}s" if watch.hold else text


def read_metric(gpu: p.GpuSample, metric: str) -> float | None:
    """One GPU's value of a :data:`gridwatch.wire.protocol.WATCH_METRICS` name; None is N/A and never holds."""
    field = p.WATCH_METRICS[metric]
    if field.startswith("throttle:"):
        word = field.partition(":")[2]
        return 1.0 if any(word in str(r).lower() for r in gpu.throttle) else 0.0
    value = getattr(gpu, field)
    return None if value is None else float(value)


@dataclass(frozen=True)
class Transition:
    """A condition began to hold (its window full) or stopped holding, on one GPU."""

    watch: p.Watch
    gpu: int
    held: bool
    value: float | None
    since: float  # agent clock, when it began to hold


class Watcher:
    """The conditions every connected console asked for, with how long each has held per GPU."""

    def __init__(self) -> None:
        self._by_client: dict[int, list[p.Watch]] = {}
        self._watches: dict[tuple[str, str], p.Watch] = {}  # (name, text) -> watch, one per distinct condition
        self._since: dict[tuple[str, str, int], float] = {}  # (name, text, gpu) -> holding since
        self._reported: set[tuple[str, str, int]] = set()  # held and already said so

    def set(self, client: int, watches: list[p.Watch]) -> list[str]:
        """Replace what one client asks for; returns why each refused condition was refused."""
        kept: list[p.Watch] = []
        refusals: list[str] = []
        for watch in watches[: p.MAX_WATCHES]:
            why = watch_refusal(watch)
            if why:
                refusals.append(f"{watch.name}: {why}")
            else:
                kept.append(watch)
        if len(watches) > p.MAX_WATCHES:
            refusals.append(f"only the first {p.MAX_WATCHES} conditions are watched")
        if kept:
            self._by_client[client] = kept
        else:
            self._by_client.pop(client, None)
        self._rebuild()
        return refusals

    def forget(self, client: int) -> None:
        if self._by_client.pop(client, None) is not None:
            self._rebuild()

    def _rebuild(self) -> None:
        self._watches = {(str(w.name), watch_text(w)): w for ws in self._by_client.values() for w in ws}
        live = set(self._watches)
        self._since = {k: v for k, v in self._since.items() if k[:2] in live}
        self._reported = {k for k in self._reported if k[:2] in live}

    def __bool__(self) -> bool:
        return bool(self._watches)

    def evaluate(self, gpus: list[p.GpuSample], now: float) -> list[Transition]:
        """Read every condition on one sample's GPUs; the transitions to report."""
        out: list[Transition] = []
        for (name, text), watch in self._watches.items():
            metric, compare = str(watch.metric), _OPS[str(watch.op)]
            for gpu in gpus:
                key = (name, text, gpu.index)
                value = read_metric(gpu, metric)
                if value is None or not compare(value, watch.threshold):
                    self._since.pop(key, None)
                    if key in self._reported:
                        self._reported.discard(key)
                        out.append(Transition(watch, gpu.index, False, value, now))
                    continue
                since = self._since.setdefault(key, now)
                if now - since >= watch.hold and key not in self._reported:
                    self._reported.add(key)
                    out.append(Transition(watch, gpu.index, True, value, since))
        return out
