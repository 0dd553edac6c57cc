"""Where a console's frame goes, stage by stage: timers around the runtime's own calls, for the frame bench.

Each stage the runtime calls per frame (store, goodput, engine) is wrapped on the instance with a
perf_counter_ns timer, so ``on_frame`` runs unchanged and what is left of its time is its own.
GC is timed by ``gc.callbacks``; it runs inside whichever stage allocated, so it is also in that
stage's figure (the table says so).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

STAGES = ("decode", "store", "goodput", "engine")


def _timed(totals: dict[str, int], stage: str, call: Callable[..., Any]) -> Callable[..., Any]:
    clock = time.perf_counter_ns

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return call(*args, **kwargs)
        finally:
            totals[stage] += clock() - t0

    return timed


def stage_profile(runtime: Any, links: list[SimpleNamespace], rows: list[list[bytes]],
                  advance: Callable[[float], Any], decode: Callable[[bytes], Any], passes: int = 4) -> dict[str, float]:
    """µs per frame by stage over ``passes`` rounds of ``rows`` (the first pass warms the histories, unmeasured)."""
    totals = dict.fromkeys((*STAGES, "on_frame", "gc"), 0)
    gc_started = [0]

    def gc_timer(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter_ns()
        else:
            totals["gc"] += time.perf_counter_ns() - gc_started[0]

    frames = 0
    for n in range(passes + 1):
        if n == 1:  # wrapped from here: the first pass only fills the rings
            totals = dict.fromkeys(totals, 0)
            runtime.store.apply = _timed(totals, "store", runtime.store.apply)
            runtime.goodput.observe = _timed(totals, "goodput", runtime.goodput.observe)
            if runtime.engine is not None:
                runtime.engine.observe = _timed(totals, "engine", runtime.engine.observe)
            timed_decode = _timed(totals, "decode", decode)
            on_frame = _timed(totals, "on_frame", runtime.on_frame)
            gc.callbacks.append(gc_timer)
        advance(1.0)
        for i, line in enumerate(rows[n % len(rows)]):
            if n:
                on_frame(links[i], timed_decode(line))
                frames += 1
            else:
                runtime.on_frame(links[i], decode(line))
    gc.callbacks.remove(gc_timer)
    per = {stage: totals[stage] / frames / 1e3 for stage in totals}
    per["rest of on_frame"] = per.pop("on_frame") - sum(per[s] for s in STAGES if s != "decode")
    return per


def print_stages(per: dict[str, float], measured: float) -> None:
    """The table, beside the CPU figure measured without timers."""
    total = sum(v for k, v in per.items() if k != "gc")
    print(f"  per stage, summaries (wall µs per frame, timers on; {measured:.1f} µs CPU measured without them):")
    for stage, us in per.items():
        note = " (inside the stages above)" if stage == "gc" else ""
        print(f"    {stage:<18} {us:6.2f} µs  {100 * us / total:5.1f} %{note}")
    print(f"    {'total':<18} {total:6.2f} µs")
