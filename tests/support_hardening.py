"""Another local user for the hardening tests (uid nobody, a fork that runs as it), and checkpoints and runs to attack."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gridwatch.trainer.checkpoint import Manifest
from gridwatch.trainer.config import TrainConfig
from gridwatch.trainer.launch import LocalRun

NOBODY = 65534
MODEL = "m"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second local user (nobody)")


def as_nobody(fn: Callable[[], bytes | None], gid: int = NOBODY) -> bytes:
    """Run ``fn`` in a forked child as uid nobody (primary group ``gid``); returns what it returns."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            os.setgroups([gid])
            os.setgid(gid)
            os.setuid(NOBODY)
            os.write(w, fn() or b"")
            code = 0
        except BaseException as exc:
            os.write(w, f"child failed: {exc!r}".encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out.decode(errors="replace")
    return out


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.w": torch.randn(64, generator=g)}


def make_manifest(step: int, tier: int = 1) -> Manifest:
    return Manifest(step=step, epoch=0, sampler_position=step, tier=tier, world_size=1, model=MODEL)


def finished(cfg: TrainConfig, last_step: int) -> LocalRun:
    """A run whose nodes have exited, the last at ``last_step`` (stand-ins for the store and the node)."""
    Path(cfg.run_dir, "metrics.jsonl").write_text(json.dumps({"step": last_step, "loss": 1.0}) + "\n")
    true = shutil.which("true") or "/bin/true"
    return LocalRun(cfg=cfg, store=subprocess.Popen([true]), port=0, nodes={"node-1": subprocess.Popen([true])})
