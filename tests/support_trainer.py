"""A tiny training run's config for real local jobs, and the newest line of a run's metrics."""

from __future__ import annotations

import json
from pathlib import Path

from gridwatch.trainer.config import TrainConfig

STEPS = 16


def tiny(run_dir: Path, **over: object) -> TrainConfig:
    base = dict(
        run_dir=str(run_dir), steps=STEPS, dim=32, layers=1, heads=2, seq_len=32, micro_batch=4, micro_batches=4,
        corpus_bytes=1 << 18, lr=1e-2, warmup=2, tier0_every=2, tier1_every=4, tier2_every=8,
        tier0_dir=str(run_dir.parent / f"{run_dir.name}-tier0"), progress_deadline_s=4.0,
    )
    base.update(over)
    return TrainConfig(**base)  # type: ignore[arg-type]


def last(run) -> dict:
    try:
        lines = run.metrics_path.read_text().splitlines()
        return json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}
