"""One checkpoint on disk: atomic write, manifest with sha256 per file, validation, listing, retention.

A checkpoint is a directory ``step-NNNNNNNN`` holding the tensors written by
``torch.distributed.checkpoint`` and a ``manifest.json``. It is assembled in a
hidden temporary directory and renamed into place only once every file and the
manifest are on disk, so a reader sees a complete checkpoint or none.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed.checkpoint as dcp

from agents.procs import pid_alive

MANIFEST = "manifest.json"
FORMAT = 1
_PREFIX = "step-"


class FileEntry(msgspec.Struct):
    size: int
    sha256: str


class Manifest(msgspec.Struct, kw_only=True):
    """What a checkpoint holds, enough to resume exactly (tensors are in the DCP files)."""

    format: int = FORMAT
    step: int
    epoch: int
    sampler_position: int
    tier: int
    world_size: int
    model: str  # the model's shape fingerprint: a different model cannot load it
    lr_schedule: dict[str, Any] = {}
    rng_ranks: int = 0  # tensors rng.rank0 .. rng.rank{n-1}: every rank's CPU RNG state
    files: dict[str, FileEntry] = {}
    node: str = ""
    created: float = 0.0
    note: str = ""  # e.g. "protective: nan loss at step 41"


class CheckpointInvalid(Exception):
    """A checkpoint that must not be loaded; the message says why in one line."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"{_PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(directory: Path, manifest: Manifest) -> None:
    path = directory / MANIFEST
    with open(path, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(manifest)))
        f.flush()
        os.fsync(f.fileno())


def _temp_dir(root: Path, step: int) -> Path:
    return root / f".{_PREFIX}{step:08d}.tmp-{os.getpid()}-{time.monotonic_ns()}"


def _publish(tmp: Path, final: Path) -> Path:
    _fsync_dir(tmp)
    if final.exists():
        # The same step written again (a replay after a restore) holds the same
        # state; the copy already there stays, the new one is dropped.
        shutil.rmtree(tmp, ignore_errors=True)
        return final
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    return final


def save_tensors(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """Write ``tensors`` with torch.distributed.checkpoint, this process alone (no collective).

    DCP reports a failed write as a ``CheckpointException`` (not an
    ``Exception``) wrapping the cause; it is turned into an ``OSError`` here,
    ENOSPC when the device is full, so callers meet one ordinary error type.
    """
    try:
        dcp.save(tensors, checkpoint_id=str(directory), no_dist=True)
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        causes = list(getattr(exc, "failures", {}).values()) or [exc]
        for cause in causes:
            if isinstance(cause, OSError):
                raise cause from None
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        if shutil.disk_usage(directory).free < need:
            raise OSError(errno.ENOSPC, "No space left on device", str(directory)) from None
        first = str(causes[0]).strip().splitlines()
        raise OSError(errno.EIO, f"checkpoint write failed: {first[0] if first else type(causes[0]).__name__}") from None


def write_checkpoint(root: Path, tensors: dict[str, torch.Tensor], manifest: Manifest) -> Path:
    """Write a checkpoint atomically under ``root``; on any error nothing new is visible."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = _temp_dir(root, manifest.step)
    try:
        tmp.mkdir()
        save_tensors(tensors, tmp)
        manifest.files = {p.name: FileEntry(p.stat().st_size, _sha256(p)) for p in sorted(tmp.iterdir())}
        manifest.created = time.time()
        _write_manifest(tmp, manifest)
        return _publish(tmp, step_dir(root, manifest.step))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_checkpoint(src: Path, root: Path, tier: int, note: str = "") -> Path:
    """Copy a valid checkpoint to another tier's ``root``, checking every byte against the manifest."""
    manifest = validate(src)
    root.mkdir(parents=True, exist_ok=True)
    tmp = _temp_dir(root, manifest.step)
    try:
        tmp.mkdir()
        for name, entry in manifest.files.items():
            shutil.copyfile(src / name, tmp / name)
            if _sha256(tmp / name) != entry.sha256:
                raise CheckpointInvalid(f"copy of {name} from {src} does not match its manifest")
            with open(tmp / name, "rb+") as f:
                os.fsync(f.fileno())
        manifest.tier = tier
        if note:
            manifest.note = note
        _write_manifest(tmp, manifest)
        return _publish(tmp, step_dir(root, manifest.step))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_manifest(path: Path) -> Manifest:
    try:
        manifest = msgspec.json.decode((path / MANIFEST).read_bytes(), type=Manifest)
    except FileNotFoundError:
        raise CheckpointInvalid(f"{path} has no manifest (partial write?)") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointInvalid(f"{path}: manifest unreadable ({exc})") from None
    if manifest.format != FORMAT:
        raise CheckpointInvalid(f"{path}: manifest format {manifest.format}, this trainer reads {FORMAT}")
    return manifest


def validate(path: Path, model: str | None = None) -> Manifest:
    """The manifest of a checkpoint whose files all match it; :class:`CheckpointInvalid` otherwise."""
    manifest = read_manifest(path)
    if model is not None and manifest.model != model:
        raise CheckpointInvalid(f"{path} holds model {manifest.model}, this run trains {model}")
    if not manifest.files:
        raise CheckpointInvalid(f"{path}: manifest lists no files")
    for name, entry in manifest.files.items():
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointInvalid(f"{path}: {name} is missing") from None
        if size != entry.size:
            raise CheckpointInvalid(f"{path}: {name} is {size} bytes, manifest says {entry.size} (truncated?)")
        if _sha256(file) != entry.sha256:
            raise CheckpointInvalid(f"{path}: {name} fails its sha256 check (corrupt)")
    return manifest


def load_tensors(path: Path, into: dict[str, torch.Tensor]) -> None:
    """Fill ``into`` in place from the checkpoint at ``path`` (validate it first)."""
    try:
        dcp.load(into, checkpoint_id=str(path), no_dist=True)
    except Exception as exc:  # DCP wraps reader errors in its own types
        raise CheckpointInvalid(f"{path}: could not be read ({str(exc).splitlines()[0][:200]})") from None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Published checkpoints under ``root``, newest first (not validated)."""
    out: list[tuple[int, Path]] = []
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return out
    for p in entries:
        if p.name.startswith(_PREFIX) and p.is_dir():
            try:
                out.append((int(p.name[len(_PREFIX) :]), p))
            except ValueError:
                continue
    return sorted(out, reverse=True)


def prune(root: Path, keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest checkpoints under ``root``; returns what was removed."""
    removed = [p for _, p in list_checkpoints(root)[max(keep, 1) :]]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def clean_partials(root: Path) -> list[Path]:
    """Remove temporary directories left by a writer that died mid-write."""
    try:
        stale = [p for p in root.iterdir() if p.name.startswith(f".{_PREFIX}") and ".tmp-" in p.name]
    except (FileNotFoundError, NotADirectoryError):
        return []
    for p in stale:
        pid = p.name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and pid_alive(int(pid)):
            continue
        shutil.rmtree(p, ignore_errors=True)
    return stale
