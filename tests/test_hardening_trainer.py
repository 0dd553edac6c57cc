"""The trainer against another local user: planted checkpoints, its control socket, its store's address."""

from __future__ import annotations

import asyncio
import grp
import hashlib
import json
import os
import pickle
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from loguru import logger

from gridwatch.trainer.checkpoint import CheckpointInvalid, list_checkpoints, load_tensors, validate, write_checkpoint
from gridwatch.trainer.config import TrainConfig, tier0_base
from gridwatch.trainer.control_server import ControlServer
from gridwatch.trainer.launch import LaunchError, prepare
from gridwatch.trainer.restore import local_candidates, restore_newest
from gridwatch.trainer.tiers import SaveOutcome, TieredCheckpointer
from gridwatch.wire.controlsock import read_status, request
from gridwatch.wire.protocol import Text, TrainerStatus
from tests.conftest import ROOT, wait_until_sync
from tests.support_hardening import MODEL, NOBODY, as_nobody, as_root, finished, make_manifest, state


@pytest.fixture
def logs() -> Iterator[list[str]]:
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), format="{message}", level="DEBUG")
    yield lines
    logger.remove(sink)


def _payload(marker: Path) -> bytes:
    """A DCP ``.metadata`` whose unpickling creates ``marker``: what the attacker plants."""

    class Plant:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.mkdir, (str(marker),))

    return pickle.dumps(Plant())


def _plant(step_dir: Path, marker: Path) -> Callable[[], None]:
    """As the attacker: a step with a crafted pickle and a manifest whose sha256s match it."""

    def plant() -> None:
        step_dir.mkdir(parents=True)
        for d in (step_dir, step_dir.parent, step_dir.parent.parent):
            d.chmod(0o700)  # "private" too: only who owns it tells it apart
        files = {".metadata": _payload(marker), "__0_0.distcp": b"\0" * 64}
        for name, data in files.items():
            (step_dir / name).write_bytes(data)
            (step_dir / name).chmod(0o600)
        manifest = {
            "format": 1, "step": 10, "epoch": 0, "sampler_position": 0, "tier": 0, "world_size": 1, "model": MODEL,
            "files": {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()},
        }
        (step_dir / "manifest.json").write_text(json.dumps(manifest))
        (step_dir / "manifest.json").chmod(0o600)

    return plant


@pytest.fixture
def shm_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TrainConfig]:
    """A run whose tier 0 is in /dev/shm, where every local user may create directories."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    if tier0_base() != Path("/dev/shm"):
        pytest.skip("no writable /dev/shm here")
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), steps=20)
    yield cfg
    shutil.rmtree(cfg.tier0_root(), ignore_errors=True)


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# ------------------------------------------------------------------- item 1: tier 0


def test_the_planted_payload_is_real(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    pickle.loads(_payload(marker))
    assert marker.is_dir(), "unpickling the planted .metadata runs code: the tests below rely on it"


@as_root
def test_a_tier0_step_planted_by_another_user_is_refused_and_never_runs(
    shm_run: TrainConfig, tmp_path: Path, world_of_one: None, logs: list[str]
) -> None:
    cfg = prepare(shm_run, resume=False)
    root = cfg.tier0_root()
    write_checkpoint(cfg.tier_root(1, "node-1"), state(4), make_manifest(4))
    shutil.rmtree(root, ignore_errors=True)  # the run ended (or the attacker won the race to the name)

    marker = tmp_path / "pwned"
    as_nobody(_plant(cfg.tier_root(0, "node-1") / "step-00000010", marker))  # type: ignore[arg-type]
    assert root.stat().st_uid == NOBODY

    live = {"model.w": torch.zeros(64)}
    manifest, skipped = restore_newest(cfg, "node-1", live, MODEL)  # what `restart_from newest` runs
    assert not marker.exists(), "the planted pickle never ran"
    assert manifest is not None and manifest.step == 4 and manifest.tier == 1, "the job falls back to its own checkpoint"
    assert torch.equal(live["model.w"], state(4)["model.w"])
    assert [line for line in skipped if f"owned by uid {NOBODY}" in line and "never loaded" in line], skipped
    assert any(str(root) in line and "never loaded" in line for line in logs)

    with pytest.raises(LaunchError, match=f"owned by uid {NOBODY}") as refused:
        prepare(cfg, resume=True)  # `gridwatch train --resume` refuses the directory, in one line
    assert "\n" not in str(refused.value)

    # Writing is refused too: nothing of ours goes into another user's directory.
    outcomes: list[SaveOutcome] = []
    ckpt = TieredCheckpointer(cfg, "node-1", outcomes.append)
    ckpt.snapshot(state(5), make_manifest(12, tier=0), {0}, tier2_owner=False)
    assert ckpt.flush(30)
    ckpt.stop()
    assert [o.tier for o in outcomes if o.error] == [0] and f"owned by uid {NOBODY}" in outcomes[0].error
    assert sorted(p.name for p in cfg.tier_root(0, "node-1").iterdir()) == ["step-00000010"]
    assert not marker.exists()


@as_root
def test_steps_and_files_that_are_not_ours_or_not_private_are_never_loaded(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    good = write_checkpoint(root, state(1), make_manifest(10))
    write_checkpoint(root, state(2), make_manifest(20))
    step = root / "step-00000020"

    def refused(why: str) -> None:
        with pytest.raises(CheckpointInvalid, match=why):
            validate(step, MODEL)
        with pytest.raises(CheckpointInvalid, match=why):
            load_tensors(step, state(0))

    os.chown(step / ".metadata", NOBODY, NOBODY)
    refused(f".metadata is owned by uid {NOBODY}")
    os.chown(step / ".metadata", 0, 0)
    os.chmod(step / ".metadata", 0o644)
    refused(r"\.metadata is open to group or others \(mode 0644\)")
    os.chmod(step / ".metadata", 0o600)
    os.chmod(step, 0o755)
    refused("is open to group or others")
    os.chmod(step, 0o700)
    os.chown(step, NOBODY, NOBODY)
    refused(f"owned by uid {NOBODY}")
    os.chown(step, 0, 0)
    (step / "extra").symlink_to(good / ".metadata")
    refused("extra is a symbolic link")
    (step / "extra").unlink()
    assert validate(step, MODEL).step == 20

    root.chmod(0o755)
    why: list[str] = []
    assert list_checkpoints(root, why) == [] and "is open to group or others" in why[0]


def test_checkpoints_are_written_private_whatever_the_umask(tmp_path: Path) -> None:
    (tmp_path / "nfs").mkdir()
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), tier0_dir=str(tmp_path / "t0"), second_dir=str(tmp_path / "nfs"))
    old = os.umask(0)
    try:
        outcomes: list[SaveOutcome] = []
        ckpt = TieredCheckpointer(cfg, "node-1", outcomes.append)
        ckpt.snapshot(state(1), make_manifest(40), {0, 1, 2}, tier2_owner=True)
        ckpt.protect("protective: test")
        assert ckpt.flush(30)
        ckpt.stop()
    finally:
        os.umask(old)
    assert not [o.error for o in outcomes if o.error]
    roots = [cfg.tier0_root(), *(cfg.tier_root(t, "node-1") for t in (0, 1, 2))]
    seen = 0
    for root in roots:
        assert stat.S_IMODE(root.stat().st_mode) == 0o700, root
        for path in root.rglob("*"):
            seen += 1
            want = 0o700 if path.is_dir() else 0o600
            assert stat.S_IMODE(path.lstat().st_mode) == want, f"{path} is {stat.S_IMODE(path.lstat().st_mode):o}"
    assert seen >= 12


@as_root
def test_a_symlink_at_the_tier0_path_is_refused(shm_run: TrainConfig, tmp_path: Path, logs: list[str]) -> None:
    cfg = prepare(shm_run, resume=False)
    root = cfg.tier0_root()
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    write_checkpoint(target / "node-1", state(1), make_manifest(10, tier=0))
    root.rmdir()
    root.symlink_to(target)
    try:
        with pytest.raises(LaunchError, match="is a symbolic link"):
            prepare(cfg, resume=True)
        refused: list[str] = []
        assert local_candidates(cfg, "node-1", 0, refused) == []
        assert refused and "is a symbolic link" in refused[0] and "never loaded" in refused[0]
        outcomes: list[SaveOutcome] = []
        ckpt = TieredCheckpointer(cfg, "node-1", outcomes.append)
        ckpt.snapshot(state(2), make_manifest(12, tier=0), {0}, tier2_owner=False)
        assert ckpt.flush(30)
        ckpt.stop()
        assert outcomes[0].error and "is a symbolic link" in outcomes[0].error
        assert sorted(p.name for p in (target / "node-1").iterdir()) == ["step-00000010"], "nothing written through the link"
    finally:
        root.unlink()


def test_tier0_is_in_a_private_xdg_runtime_dir_when_there_is_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), tier0_key="k")
    assert cfg.tier0_root().parent == xdg
    xdg.chmod(0o755)  # not private: not used
    assert cfg.tier0_root().parent != xdg


def test_a_finished_run_removes_tier0_and_an_interrupted_one_keeps_it_private(tmp_path: Path) -> None:
    cfg = prepare(TrainConfig(run_dir=str(tmp_path / "run"), steps=20), resume=False)
    root = cfg.tier0_root()
    write_checkpoint(cfg.tier_root(0, "node-1"), state(1), make_manifest(10, tier=0))

    finished(cfg, 12).stop()  # interrupted (Ctrl-C): kept for --resume, and private
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    resumed = prepare(TrainConfig(run_dir=cfg.run_dir, steps=20), resume=True)
    assert resumed.tier0_root() == root
    assert [s for s, _ in list_checkpoints(resumed.tier_root(0, "node-1"))] == [10]

    assert finished(resumed, 20).wait(30) == 0
    assert not root.exists(), "a finished run gives its RAM tier back"


def test_resuming_past_checkpoints_that_would_be_refused_stops_with_a_reason(tmp_path: Path) -> None:
    cfg = prepare(TrainConfig(run_dir=str(tmp_path / "run")), resume=False)
    step = write_checkpoint(cfg.tier_root(1, "node-1"), state(1), make_manifest(20))
    step.chmod(0o755)  # as an older trainer, under umask 022, left it
    with pytest.raises(LaunchError, match=r"cannot resume: .*step-00000020 is open to group or others \(mode 0755\)"):
        prepare(TrainConfig(run_dir=cfg.run_dir), resume=True)
    step.chmod(0o700)
    assert prepare(TrainConfig(run_dir=cfg.run_dir), resume=True).tier0_key == cfg.tier0_key
    shutil.rmtree(cfg.tier0_root())


def test_a_fresh_run_in_the_same_dir_gives_back_the_old_tier0(tmp_path: Path) -> None:
    first = prepare(TrainConfig(run_dir=str(tmp_path / "run")), resume=False)
    root = first.tier0_root()
    assert first.tier0_key and first.tier0_key in root.name, "the default tier-0 name is not guessable from the run dir"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and root.stat().st_uid == os.geteuid()
    second = prepare(TrainConfig(run_dir=str(tmp_path / "run")), resume=False)
    assert not first.tier0_root().exists() and second.tier0_root().is_dir()
    assert first.tier0_root() != second.tier0_root()
    shutil.rmtree(second.tier0_root())


# ------------------------------------------------------------- item 15: control socket


def _status() -> TrainerStatus:
    return TrainerStatus(phase=Text("training"), step=7, node=Text("node-1"))


def _talk(path: str, lines: list[bytes]) -> Callable[[], bytes]:
    def talk() -> bytes:
        out = b""
        for line in lines:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                s.connect(path)
                try:
                    s.sendall(line)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # refused before the request was read: the reply says why
                out += s.makefile("rb").readline() or b"<closed>\n"
        return out

    return talk


def test_the_socket_is_owner_only_or_group_whatever_the_umask(open_dir: Path) -> None:
    old = os.umask(0o002)
    try:
        owner = ControlServer(str(open_dir / "control" / "a.sock"), _status)
        owner.start()
        group = ControlServer(str(open_dir / "control" / "b.sock"), _status, group=grp.getgrgid(NOBODY).gr_name)
        group.start()
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(owner.path).st_mode) == 0o600
        st = os.stat(group.path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == NOBODY
        assert stat.S_IMODE((open_dir / "control").stat().st_mode) == 0o700
        assert [p.name for p in (open_dir / "control").iterdir() if p.name.startswith(".")] == []
        assert asyncio.run(read_status(owner.path)).step == 7
    finally:
        owner.stop()
        group.stop()


@as_root
def test_nobody_is_refused_even_when_the_socket_mode_lets_it_in(open_dir: Path, logs: list[str]) -> None:
    server = ControlServer(str(open_dir / "control" / "node-1.sock"), _status, node="node-1")
    server.start()
    try:
        (open_dir / "control").chmod(0o755)
        os.chmod(server.path, 0o777)  # what a loose umask used to give
        got = as_nobody(_talk(server.path, [b'{"cmd": "pause"}\n', b'{"cmd": "status"}\n'])).splitlines()
        assert len(got) == 2 and all(b'"ok":false' in line and b"refused" in line for line in got), got
        assert b'"step"' not in b"".join(got)
        message = as_nobody(lambda: asyncio.run(request(server.path, "pause")).message.encode())
        assert message.startswith(b"refused: only this user and root"), message
        assert server.take() == [], "nobody's pause never reached the loop"
        assert sum(f"refused uid {NOBODY}" in line for line in logs) == 1, "three refusals, one line: the log cannot be flooded"
        assert asyncio.run(request(server.path, "pause")).ok, "the owner still gets in"
        assert [r.cmd for r in server.take()] == ["pause"]
    finally:
        server.stop()


@as_root
def test_a_member_of_the_control_group_gets_in(open_dir: Path) -> None:
    server = ControlServer(str(open_dir / "control" / "node-1.sock"), _status, group=grp.getgrgid(NOBODY).gr_name)
    server.start()
    try:
        got = as_nobody(_talk(server.path, [b'{"cmd": "status"}\n']), gid=NOBODY)
        assert b'"ok":true' in got and b'"step":7' in got
        # Not in the group: refused, even with the file system open to it.
        (open_dir / "control").chmod(0o755)
        os.chmod(server.path, 0o777)
        got = as_nobody(_talk(server.path, [b'{"cmd": "status"}\n']), gid=0)
        assert b"refused" in got
    finally:
        server.stop()


def test_an_unknown_control_group_stops_the_launch(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="control group 'no-such-group-gw' does not exist"):
        prepare(TrainConfig(run_dir=str(tmp_path / "run"), control_group="no-such-group-gw"), resume=False)


# ------------------------------------------------------------------ item 17: the store


def _other_address() -> str | None:
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127.") and not a.address.startswith("169.254."):
                return a.address
    return None


def test_the_store_listens_only_where_asked() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "gridwatch.trainer.store", "--host", "127.0.0.1", "--port", "0", "--no-coordinator"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        assert listening == [("127.0.0.1", port)], listening
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        other = _other_address()
        if other is not None:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((other, port), timeout=5).close()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("membership", ["coordinator", "torchrun"])
def test_no_process_of_a_local_run_listens_beyond_loopback(tmp_path: Path, membership: str) -> None:
    """torchrun's agents host no store of their own (its rendezvous store and the shared TCPStore would
    listen, unauthenticated, on every interface): every listener of the run is on 127.0.0.1."""
    from gridwatch.trainer.launch import start_local_run
    from tests.support_trainer import last, tiny

    cfg = tiny(tmp_path / "run", steps=100_000)
    run = start_local_run(cfg, ["node-1", "node-2"], membership=membership)
    try:
        wait_until_sync(lambda: (last(run).get("step") or 0) >= 5, timeout=90, what="the run to train")
        tree = [psutil.Process(run.store.pid)] + [psutil.Process(p.pid) for p in run.nodes.values()]
        procs = [q for t in tree for q in [t, *t.children(recursive=True)]]
        listening = [(q.name(), c.laddr) for q in procs for c in q.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and all(addr.ip == "127.0.0.1" for _, addr in listening), listening
    finally:
        run.stop()
