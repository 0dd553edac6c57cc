"""The checkpointer's staging and writer process: a snapshot is the state at the snapshot, the loop barely waits,
arenas are kept across saves, every tier keeps what docs/trainer.md says, and a writer that dies or meets a full
disk costs one save, in one line, never the previous checkpoint or the training."""

from __future__ import annotations

import os
import re
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gridwatch.trainer import checkpoint_process
from gridwatch.trainer.checkpoint import Manifest, list_checkpoints, load_tensors, validate
from gridwatch.trainer.checkpoint_stage import Stager
from gridwatch.trainer.config import TrainConfig
from gridwatch.trainer.model import ByteGPT, ModelConfig
from gridwatch.trainer.state import init_optimizer_state, live_tensors
from gridwatch.trainer.tiers import SaveOutcome, TieredCheckpointer

ROOT = Path(__file__).resolve().parent.parent


def _manifest(step: int) -> Manifest:
    return Manifest(step=step, epoch=0, sampler_position=step, tier=0, world_size=1, model="m")


def _state(seed: int, n: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.w": torch.randn(n, generator=g), "optim.0.step": torch.tensor(float(seed))}


def _cfg(tmp_path: Path, **kw: object) -> TrainConfig:
    return TrainConfig(run_dir=str(tmp_path / "run"), tier0_dir=str(tmp_path / "t0"), second_dir=str(tmp_path / "nfs"), **kw)  # type: ignore[arg-type]


def _wrap_writer(monkeypatch: pytest.MonkeyPatch, setup: str) -> None:
    """Start the writer process with ``setup`` run in it first (a patch, a limit)."""
    script = textwrap.dedent(setup) + "\nfrom gridwatch.trainer.checkpoint_writer import main\nsys.exit(main(sys.argv[1:]))\n"
    monkeypatch.setattr(checkpoint_process, "WRITER_COMMAND", [sys.executable, "-c", "import sys\n" + script])


@pytest.fixture
def ckpt_of(tmp_path: Path) -> Iterator[tuple[TieredCheckpointer, list[SaveOutcome], TrainConfig]]:
    (tmp_path / "nfs").mkdir()
    cfg = _cfg(tmp_path)
    outcomes: list[SaveOutcome] = []
    ckpt = TieredCheckpointer(cfg, "node-1", outcomes.append)
    yield ckpt, outcomes, cfg
    ckpt.stop()


def test_the_snapshot_is_the_state_when_taken_though_the_optimizer_steps_at_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ByteGPT(ModelConfig(dim=64, layers=2, heads=4, seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    init_optimizer_state(opt)
    live = live_tensors(model, opt)
    x = torch.randint(0, 256, (2, 16))
    model(x, x).backward()
    opt.step()
    opt.zero_grad()
    want = {k: v.clone() for k, v in live.items()}
    outcomes: list[SaveOutcome] = []
    ckpt = TieredCheckpointer(_cfg(tmp_path), "node-1", outcomes.append)
    m = Manifest(step=1, epoch=0, sampler_position=0, tier=0, world_size=1, model="m")
    handed = ckpt.snapshot(live, m, {0}, tier2_owner=False)
    model(x, x).backward()
    opt.step()  # at once: this step waits for the copy before it changes a thing
    assert ckpt.stalls[-1] >= handed
    assert ckpt.flush(60)
    ckpt.stop()
    assert not [o.error for o in outcomes if o.error]
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    step = tmp_path / "t0" / "node-1" / "step-00000001"
    validate(step, "m")
    load_tensors(step, got)
    assert all(torch.equal(got[k], want[k]) for k in want), "the checkpoint holds the state before the second step"
    changed = [k for k in want if not torch.equal(live[k], want[k])]
    assert changed, "the second step did change the live state"


def test_arenas_are_kept_across_saves_and_made_again_only_when_the_state_changes_shape() -> None:
    stager = Stager()
    try:
        ids = []
        for i in range(6):
            staged = stager.stage(_state(i))
            staged.done.wait(30)
            assert not staged.error
            assert torch.equal(staged.arena.tensors["model.w"], _state(i)["model.w"])
            ids.append(staged.arena_id)
            stager.release(staged)
        assert len(set(ids)) <= 2 and stager.arena_ids() == set(ids)
        wider = stager.stage(_state(9, n=2000))  # a new world size: more RNG states, a new layout
        wider.done.wait(30)
        assert not wider.error and wider.arena_id not in ids and torch.equal(wider.arena.tensors["model.w"], _state(9, n=2000)["model.w"])
        stager.release(wider)
    finally:
        stager.close()


def test_each_tier_keeps_as_many_checkpoints_as_its_retention(ckpt_of: tuple[TieredCheckpointer, list[SaveOutcome], TrainConfig]) -> None:
    ckpt, outcomes, cfg = ckpt_of
    assert cfg.keep == (2, 3, 2)
    for step in range(1, 7):
        ckpt.snapshot(_state(step), _manifest(step), {0, 1, 2}, tier2_owner=True)
    assert ckpt.flush(120)
    assert not [o.error for o in outcomes if o.error]
    for tier, keep in enumerate(cfg.keep):
        assert [s for s, _ in list_checkpoints(cfg.tier_root(tier, "node-1"))] == list(range(6, 6 - keep, -1)), tier
    assert ckpt.newest == {0: 6, 1: 6, 2: 6}


def test_docs_say_each_tiers_retention_as_the_config_keeps_it() -> None:
    text = (ROOT / "docs" / "trainer.md").read_text()
    cfg = TrainConfig(run_dir="run")
    rows = dict(re.findall(r"^\| (\d) \|[^|]*\| every \d+ steps[^|]*\| (\d+) newest \|$", text, re.M))
    assert rows == {str(t): str(k) for t, k in enumerate(cfg.keep)}, "docs/trainer.md's tier table says each tier's retention"
    assert f"default `{list(cfg.keep)}`".replace(" ", "") in text.replace(" ", "").replace("\n", "")


def _wait_for(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def test_a_writer_killed_mid_write_costs_that_save_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flag = tmp_path / "writing"
    _wrap_writer(monkeypatch, f"""
        import os, time
        from pathlib import Path
        from gridwatch.trainer import checkpoint as c
        real = c.save_tensors
        def slow(tensors, directory):
            real(tensors, directory)
            if ".step-00000020" in str(directory):
                Path({str(flag)!r}).write_text(f"{{os.getpid()}}\\n")
                time.sleep(60)  # killed here, its files on disk but no manifest
        c.save_tensors = slow
    """)
    outcomes: list[SaveOutcome] = []
    ckpt = TieredCheckpointer(_cfg(tmp_path), "node-1", outcomes.append)
    ckpt.snapshot(_state(1), _manifest(10), {0}, tier2_owner=False)
    assert ckpt.flush(60)
    ckpt.snapshot(_state(2), _manifest(20), {0}, tier2_owner=False)
    os.kill(int(_wait_for(flag)), signal.SIGKILL)
    assert ckpt.flush(60)
    failed = [o for o in outcomes if o.error]
    assert [(o.tier, o.step) for o in failed] == [(0, 20)]
    assert failed[0].error == "the checkpoint writer process died (killed by SIGKILL); a new one takes the next write"
    root = tmp_path / "t0" / "node-1"
    assert [s for s, _ in list_checkpoints(root)] == [10] and validate(root / "step-00000010", "m").step == 10
    assert sorted(p.name for p in root.iterdir()) == ["step-00000010"], "the dead writer's partial step is removed"
    ckpt.snapshot(_state(3), _manifest(30), {0}, tier2_owner=False)  # training goes on; a new writer takes it
    assert ckpt.flush(60)
    ckpt.stop()
    assert [s for s, _ in list_checkpoints(root)] == [30, 10] and ckpt.newest == {0: 30}


def test_ready_answers_only_once_a_slow_starting_writer_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker joins its job after ``ready``: a writer still starting (torch's import on a loaded node) is waited
    for there, not behind the job's third snapshot with every rank's step held."""
    gate = tmp_path / "imported"
    _wrap_writer(monkeypatch, f"""
        import time
        from pathlib import Path
        while not Path({str(gate)!r}).exists():
            time.sleep(0.02)
    """)
    outcomes: list[SaveOutcome] = []
    ckpt = TieredCheckpointer(_cfg(tmp_path), "node-1", outcomes.append)
    assert not ckpt.ready(0.3), "a writer that does not serve yet is not ready"
    gate.write_text("")
    assert ckpt.ready(60)
    ckpt.snapshot(_state(1), _manifest(10), {0}, tier2_owner=False)
    assert ckpt.flush(60)
    ckpt.stop()
    assert not [o.error for o in outcomes if o.error] and ckpt.newest == {0: 10}


def test_a_writer_that_died_between_saves_is_replaced_without_losing_a_save(tmp_path: Path) -> None:
    outcomes: list[SaveOutcome] = []
    ckpt = TieredCheckpointer(_cfg(tmp_path), "node-1", outcomes.append)
    ckpt.snapshot(_state(1), _manifest(10), {0}, tier2_owner=False)
    assert ckpt.flush(60)
    pid = ckpt._writer.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    ckpt.snapshot(_state(2), _manifest(20), {0}, tier2_owner=False)
    assert ckpt.flush(60)
    ckpt.stop()
    assert not [o.error for o in outcomes if o.error]
    assert ckpt.newest == {0: 20}


def test_a_file_size_limit_in_the_writer_fails_the_save_in_one_line_and_keeps_the_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _wrap_writer(monkeypatch, """
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    """)
    (tmp_path / "nfs").mkdir()
    cfg = _cfg(tmp_path)
    outcomes: list[SaveOutcome] = []
    ckpt = TieredCheckpointer(cfg, "node-1", outcomes.append)
    ckpt.snapshot(_state(1), _manifest(10), {0, 1}, tier2_owner=False)
    ckpt.snapshot(_state(2, n=2_000_000), _manifest(20), {0, 1}, tier2_owner=False)  # 8 MB, over the limit
    ckpt.snapshot(_state(3), _manifest(30), {0, 1}, tier2_owner=False)
    assert ckpt.flush(60)
    ckpt.stop()
    failed = [o for o in outcomes if o.error]
    assert [(o.tier, o.step) for o in failed] == [(0, 20), (1, 20)]
    assert all("File too large" in o.error and "\n" not in o.error for o in failed), failed
    for tier in (0, 1):
        root = cfg.tier_root(tier, "node-1")
        assert [s for s, _ in list_checkpoints(root)] == [30, 10]
        assert not [p for p in root.iterdir() if p.name.startswith(".")], "no partial directory left behind"
    assert ckpt.newest == {0: 30, 1: 30}


def test_a_snapshot_that_cannot_be_staged_fails_its_tiers_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gridwatch.trainer import checkpoint_arena

    real = checkpoint_arena.Arena.create

    def no_memory(layout: checkpoint_arena.Layout) -> checkpoint_arena.Arena:
        if layout.size > 1 << 20:
            raise OSError(28, "No space left on device")
        return real(layout)

    monkeypatch.setattr(checkpoint_arena.Arena, "create", staticmethod(no_memory))
    outcomes: list[SaveOutcome] = []
    ckpt = TieredCheckpointer(_cfg(tmp_path), "node-1", outcomes.append)
    ckpt.snapshot(_state(1, n=1_000_000), _manifest(10), {0}, tier2_owner=False)
    ckpt.snapshot(_state(2), _manifest(20), {0}, tier2_owner=False)
    assert ckpt.flush(60)
    ckpt.stop()
    assert [(o.tier, o.step, o.error) for o in outcomes if o.error] == [
        (0, 10, "could not stage the snapshot: [Errno 28] No space left on device")]
    assert ckpt.newest == {0: 20}
