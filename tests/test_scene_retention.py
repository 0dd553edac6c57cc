"""The console's scene store is pruned by age and size, oldest first, and never loses an open incident's scenes."""

from __future__ import annotations

import os
from pathlib import Path

from gridwatch.console.runtime.scene_retention import SceneCounters, SceneRetention, SceneStoreCollector, prune_scenes
from gridwatch.console.runtime.scene_store import incident_dir

DAY = 86400.0
NOW = 1_800_000_000.0


def _scene(root: Path, incident: str, age_days: float, size: int) -> Path:
    bundle = incident_dir(root, incident) / "node-2" / "20261201T000000-scene-x"
    bundle.mkdir(parents=True)
    for name in ("frames.jsonl", "MANIFEST.json"):
        path = bundle / name
        path.write_bytes(b"x" * (size // 2))
        os.utime(path, (NOW - age_days * DAY, NOW - age_days * DAY))
    return incident_dir(root, incident)


def test_an_old_scene_goes_a_young_one_and_an_open_incidents_old_one_stay(tmp_path: Path) -> None:
    root = tmp_path / "incidents.scenes"
    old = _scene(root, "xid-hardware:node-2:1.a.1", age_days=20, size=1000)
    still_open = _scene(root, "xid-hardware:node-3:2.b.2", age_days=30, size=1000)
    young = _scene(root, "heartbeat-lost:node-4:3.c.3", age_days=1, size=1000)
    counters = SceneCounters()
    removed = prune_scenes(root, ["xid-hardware:node-3:2.b.2"], NOW, 14 * DAY, None, counters)
    assert removed == [old] and not old.exists() and still_open.exists() and young.exists()
    assert (counters.pruned_age, counters.pruned_size, counters.bytes) == (1, 0, 2000)


def test_over_its_size_the_oldest_closed_incidents_scenes_go_first(tmp_path: Path) -> None:
    root = tmp_path / "incidents.scenes"
    oldest_open = _scene(root, "a:node-1:1.a.1", age_days=5, size=4000)
    older = _scene(root, "b:node-1:2.b.2", age_days=4, size=4000)
    newer = _scene(root, "c:node-1:3.c.3", age_days=3, size=4000)
    newest = _scene(root, "d:node-1:4.d.4", age_days=2, size=4000)
    counters = SceneCounters()
    removed = prune_scenes(root, ["a:node-1:1.a.1"], NOW, 14 * DAY, 10_000, counters)
    assert removed == [older, newer]  # the open one is kept though it is the oldest
    assert oldest_open.exists() and newest.exists()
    assert counters.pruned_size == 2 and counters.bytes == 8000


def test_a_missing_store_prunes_nothing_and_the_counters_reach_metrics(tmp_path: Path) -> None:
    counters = SceneCounters()
    assert prune_scenes(tmp_path / "none.scenes", [], NOW, DAY, 1, counters) == [] and counters.bytes == 0

    class Runtime:
        plan_store = None

    retention = SceneRetention(Runtime(), tmp_path, DAY, None)  # type: ignore[arg-type]
    retention.counters.pruned_age = 3
    families = {f.name: f for f in SceneStoreCollector(retention).collect()}
    assert {s.labels["reason"]: s.value for s in families["gridwatch_console_scenes_pruned"].samples
            if s.name.endswith("_total")} == {"age": 3, "size": 0}
