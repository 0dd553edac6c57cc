"""The scenes the console keeps (``<db>.scenes/<incident>/``), pruned by age and size, never an open incident's.

The same lifecycle as the log store (cluster.toml's ``retention`` and ``store_max``, the latter for the scenes
on their own): an incident's folder is removed whole, oldest first, once its newest file is older than the
retention, then while the folder holds more than ``store_max``; an incident still open keeps its scenes
whatever their age or size. What was removed is counted for /metrics.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loguru import logger
from prometheus_client.registry import Collector

from gridwatch.console.runtime.scene_store import incident_dir
from gridwatch.playbooks.store import OPEN_STATES

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from gridwatch.console.runtime.core import ConsoleRuntime

PRUNE_EVERY_S = 60.0


@dataclass
class SceneCounters:
    pruned_age: int = 0  # incidents' scene folders removed for their age
    pruned_size: int = 0  # ... to bring the store under its size
    failed: int = 0  # folders the disk would not let go
    bytes: int = 0  # what the store holds, as of the last prune


@dataclass(frozen=True)
class _Folder:
    path: Path
    newest: float  # the newest file's mtime
    size: int


def _measure(path: Path) -> _Folder:
    newest, size = 0.0, 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(base, name))
            except OSError:
                continue
            newest, size = max(newest, st.st_mtime), size + st.st_size
    return _Folder(path, newest or path.stat().st_mtime, size)


def prune_scenes(root: Path, keep: Iterable[str], now: float, retention_s: float | None, max_bytes: int | None,
                 counters: SceneCounters) -> list[Path]:
    """Remove incidents' scene folders under ``root`` past ``retention_s``, then the oldest past ``max_bytes``;
    the incidents named in ``keep`` stay. Returns what was removed."""
    if not root.is_dir():
        counters.bytes = 0
        return []
    kept = {incident_dir(root, incident).name for incident in keep}
    folders = sorted((_measure(p) for p in root.iterdir() if p.is_dir() and not p.is_symlink()),
                     key=lambda f: f.newest)
    removed: list[Path] = []
    total = sum(f.size for f in folders)

    def drop(folder: _Folder) -> bool:
        nonlocal total
        try:
            shutil.rmtree(folder.path)
        except OSError as exc:
            counters.failed += 1
            logger.warning("cannot remove the old scenes in {}: {}", folder.path, exc.strerror or exc)
            return False
        total -= folder.size
        removed.append(folder.path)
        return True

    left = []
    for folder in folders:
        old = retention_s is not None and now - folder.newest > retention_s
        if old and folder.path.name not in kept and drop(folder):
            counters.pruned_age += 1
        else:
            left.append(folder)
    for folder in left:  # oldest first
        if max_bytes is None or total <= max_bytes:
            break
        if folder.path.name not in kept and drop(folder):
            counters.pruned_size += 1
    counters.bytes = total
    return removed


class SceneRetention:
    """Prunes one runtime's scene store every ``every`` seconds, off the event loop."""

    def __init__(self, runtime: ConsoleRuntime, root: Path, retention_s: float | None, max_bytes: int | None,
                 every: float = PRUNE_EVERY_S, clock: Callable[[], float] = time.time) -> None:
        self.runtime = runtime
        self.root = root
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self.every = every
        self.clock = clock
        self.counters = SceneCounters()
        self._task: asyncio.Task[None] | None = None

    def open_incidents(self) -> list[str]:
        plan_store = self.runtime.plan_store
        if plan_store is None or not hasattr(plan_store, "incidents"):
            return []
        return [rec.id for rec in plan_store.incidents(states=OPEN_STATES, limit=10_000)]

    async def prune_now(self) -> list[Path]:
        try:
            keep = self.open_incidents()
        except Exception:  # noqa: BLE001 - without the incidents nothing is pruned this round
            logger.exception("cannot read the open incidents: the scene store is not pruned this round")
            return []
        return await asyncio.to_thread(prune_scenes, self.root, keep, self.clock(), self.retention_s,
                                       self.max_bytes, self.counters)

    async def start(self) -> None:
        if self.every > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._forever())

    async def _forever(self) -> None:
        while True:
            try:
                await self.prune_now()
            except Exception:  # noqa: BLE001 - retention is housekeeping; the console goes on
                logger.exception("pruning the scene store failed")
            await asyncio.sleep(self.every)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


class SceneStoreCollector(Collector):
    """The scene store's counters for /metrics (``gridwatch_console_scene*``), read at scrape time."""

    def __init__(self, retention: SceneRetention) -> None:
        self.retention = retention

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self.retention.counters
        pruned = CounterMetricFamily("gridwatch_console_scenes_pruned", "Incidents' scene folders the scene store's "
                                     "retention removed, by reason (age: older than retention; size: over "
                                     "store_max).", labels=["reason"])
        pruned.add_metric(["age"], c.pruned_age)
        pruned.add_metric(["size"], c.pruned_size)
        yield pruned
        size = GaugeMetricFamily("gridwatch_console_scene_store_bytes", "Bytes the scene store holds, as of its "
                                 "last prune.")
        size.add_metric([], c.bytes)
        yield size


def keep_scene_retention(runtime: ConsoleRuntime, root: Path, retention_s: float | None, max_bytes: int | None,
                         registry: CollectorRegistry | None = None) -> SceneRetention:
    """Prune ``root`` while ``runtime`` runs; counted in ``registry``."""
    retention = SceneRetention(runtime, root, retention_s, max_bytes)
    runtime.hooks.starting.append(retention.start)
    runtime.hooks.stopping.append(retention.stop)
    if registry is not None:
        registry.register(SceneStoreCollector(retention))
    return retention
