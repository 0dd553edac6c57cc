"""Checkpoints on disk: atomic, validated, falling back past damage, surviving a full disk and a missing second location."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gridwatch.trainer.checkpoint import (
    CheckpointInvalid,
    Manifest,
    clean_partials,
    list_checkpoints,
    load_tensors,
    prune,
    validate,
    write_checkpoint,
)
from gridwatch.trainer.config import TrainConfig
from gridwatch.trainer.tiers import SaveOutcome, TieredCheckpointer


def _state(seed: int, n: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.w": torch.randn(n, generator=g), "optim.0.step": torch.tensor(float(seed))}


def _manifest(step: int) -> Manifest:
    return Manifest(step=step, epoch=0, sampler_position=step * 8, tier=1, world_size=2, model="m")


def _newest_valid(root: Path) -> tuple[int, list[str]]:
    """What a restore does on one node: the newest checkpoint that validates, and what it skipped."""
    skipped = []
    for step, path in list_checkpoints(root):
        try:
            validate(path, "m")
            return step, skipped
        except CheckpointInvalid as exc:
            skipped.append(str(exc))
    return -1, skipped


def test_round_trip_and_retention(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        write_checkpoint(tmp_path, _state(step), _manifest(step))
    prune(tmp_path, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [15, 10]
    manifest = validate(tmp_path / "step-00000015", "m")
    assert manifest.sampler_position == 120 and all(len(f.sha256) == 64 for f in manifest.files.values())
    into = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    load_tensors(tmp_path / "step-00000015", into)
    assert torch.equal(into["model.w"], _state(15)["model.w"]) and into["optim.0.step"].item() == 15


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "delete_manifest"])
def test_damaged_checkpoint_is_skipped_with_a_reason(tmp_path: Path, damage: str) -> None:
    write_checkpoint(tmp_path, _state(1), _manifest(10))
    newest = write_checkpoint(tmp_path, _state(2), _manifest(20))
    data = newest / "__0_0.distcp"
    if damage == "truncate":
        os.truncate(data, data.stat().st_size // 2)
    elif damage == "bitflip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    else:
        (newest / "manifest.json").unlink()
    step, skipped = _newest_valid(tmp_path)
    assert step == 10, "falls back to the older checkpoint, which is intact"
    reason = {"truncate": "truncated", "bitflip": "sha256", "delete_manifest": "no manifest"}[damage]
    assert len(skipped) == 1 and reason in skipped[0]


def test_sigkill_during_write_leaves_no_visible_checkpoint(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, _state(1), _manifest(10))
    script = textwrap.dedent(f"""
        import torch
        from pathlib import Path
        from gridwatch.trainer import checkpoint as c
        real = c.save_tensors
        def slow(tensors, directory):
            real(tensors, directory)
            print("written", flush=True)
            import time; time.sleep(60)  # killed here, before the manifest and the rename
        c.save_tensors = slow
        m = c.Manifest(step=20, epoch=0, sampler_position=0, tier=1, world_size=1, model="m")
        c.write_checkpoint(Path({str(tmp_path)!r}), {{"model.w": torch.randn(100000)}}, m)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
    proc.kill()
    proc.wait()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10]
    assert len(clean_partials(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010"]
    validate(tmp_path / "step-00000010", "m")


@pytest.fixture
def tiny_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A 1 MB tmpfs where mounting is allowed; otherwise a directory whose writes fail with ENOSPC in the writer process."""
    path = tmp_path / "tiny"
    path.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True
    ).returncode == 0
    if mounted:
        yield path
        subprocess.run(["umount", "-l", str(path)], check=False)
        return
    from gridwatch.trainer import checkpoint_process

    # The checkpointer writes from its own process: the full disk is simulated there.
    setup = textwrap.dedent(f"""
        import errno, sys
        from pathlib import Path
        from gridwatch.trainer import checkpoint as c
        from gridwatch.trainer.checkpoint_writer import main
        real = c.save_tensors
        def full(tensors, directory):
            if Path(directory).is_relative_to({str(path)!r}) and sum(t.numel() * t.element_size() for t in tensors.values()) > 1 << 20:
                raise OSError(errno.ENOSPC, "No space left on device", str(directory))
            real(tensors, directory)
        c.save_tensors = full
        sys.exit(main(sys.argv[1:]))
    """)
    monkeypatch.setattr(checkpoint_process, "WRITER_COMMAND", [sys.executable, "-c", setup])
    yield path


def _checkpointer(cfg: TrainConfig) -> tuple[TieredCheckpointer, list[SaveOutcome]]:
    outcomes: list[SaveOutcome] = []
    return TieredCheckpointer(cfg, "node-1", outcomes.append), outcomes


def test_full_disk_during_save_keeps_the_previous_checkpoint(tmp_path: Path, tiny_disk: Path) -> None:
    cfg = TrainConfig(run_dir=str(tiny_disk), tier0_dir=str(tmp_path / "t0"), second_dir=str(tmp_path))
    ckpt, outcomes = _checkpointer(cfg)
    small = _state(1, n=1000)
    ckpt.snapshot(small, _manifest(10), {0, 1}, tier2_owner=False)
    big = _state(2, n=2_000_000)  # 8 MB: does not fit in 1 MB
    ckpt.snapshot(big, _manifest(20), {0, 1}, tier2_owner=False)
    assert ckpt.flush(60)
    failed = [o for o in outcomes if o.error]
    assert [(o.tier, o.step) for o in failed] == [(1, 20)]
    assert "No space left on device" in failed[0].error
    tier1 = cfg.tier_root(1, "node-1")
    assert [s for s, _ in list_checkpoints(tier1)] == [10]
    validate(tier1 / "step-00000010", "m")
    assert not [p for p in tier1.iterdir() if p.name.startswith(".")], "no partial directory left behind"
    assert ckpt.newest == {0: 20, 1: 10}
    ckpt.stop()


def test_missing_second_location_does_not_stop_tiers_0_and_1(tmp_path: Path) -> None:
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), tier0_dir=str(tmp_path / "t0"), second_dir=str(tmp_path / "nfs-not-mounted"))
    ckpt, outcomes = _checkpointer(cfg)
    ckpt.snapshot(_state(1), _manifest(30), {0, 1, 2}, tier2_owner=True)
    assert ckpt.flush(60)
    failed = [o for o in outcomes if o.error]
    assert [(o.tier, o.step) for o in failed] == [(2, 30)] and "second location" in failed[0].error
    assert ckpt.newest == {0: 30, 1: 30}
    assert not (tmp_path / "nfs-not-mounted").exists(), "a missing mount is not replaced by a local directory"
    ckpt.stop()


def test_tier2_copy_is_verified_and_protective_copy_keeps_last_snapshot(tmp_path: Path) -> None:
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), tier0_dir=str(tmp_path / "t0"), second_dir=str(tmp_path / "nfs"))
    (tmp_path / "nfs").mkdir()
    ckpt, outcomes = _checkpointer(cfg)
    ckpt.snapshot(_state(1), _manifest(40), {0, 1, 2}, tier2_owner=True, rank=0)
    ckpt.snapshot(_state(2), _manifest(45), {0}, tier2_owner=False)
    ckpt.protect("protective: loss spike at step 46")
    assert ckpt.flush(60)
    assert not [o for o in outcomes if o.error]
    assert validate(cfg.tier_root(2, "node-1") / "step-00000040", "m").tier == 2
    kept = validate(cfg.tier_root(1, "node-1") / "step-00000045", "m")
    assert kept.tier == 1 and kept.note.startswith("protective")
    ckpt.stop()
