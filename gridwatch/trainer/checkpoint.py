"""One checkpoint on disk: atomic write, manifest with sha256 per file, validation, listing, retention.

A checkpoint is a directory ``step-NNNNNNNN`` holding the tensors written by
``torch.distributed.checkpoint`` and a ``manifest.json``. It is assembled in a
hidden temporary directory and renamed into place only once every file and the
manifest are on disk, so a reader sees a complete checkpoint or none.

Checkpoints are private: directories 0700 and files 0600 whatever the umask.
DCP's metadata is a pickle, so a checkpoint directory or file that is not this
user's, or that group or others could have written, is never loaded
(:mod:`gridwatch.trainer.private`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import resource
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
from loguru import logger

from gridwatch.trainer.private import NotPrivate, make_private, make_private_dir, open_private_dir, open_private_file, refusal
from gridwatch.wire.control import pid_alive

# torch.distributed.checkpoint is imported where a checkpoint is written or read, not with this
# module. Importing it (its planner pulls in sympy and the compiler's modules) is 1.1 s on top of torch's
# 2.5 s, and every worker imports this module for its manifests: a worker that starts fresh, or restores from
# a peer's memory, never reads a checkpoint with DCP, and a restarted one trains 1.1 s sooner.
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


NEVER_LOADED = "a checkpoint another user could have written is never loaded"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{_PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return _sha256_of(f)


def _sha256_of(f: Any) -> str:
    h = hashlib.sha256()
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
    with os.fdopen(open_private_file(directory / MANIFEST), "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(manifest)))
        f.flush()
        os.fsync(f.fileno())


def _temp_dir(root: Path, step: int) -> Path:
    return root / f".{_PREFIX}{step:08d}.tmp-{os.getpid()}-{time.monotonic_ns()}"


def checkpoint_root(root: Path) -> Path:
    """Make ``root`` (a tier's directory) private, its parents as usual; :class:`NotPrivate` if it is not ours."""
    return make_private_dir(root, parents=True)


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
    import torch.distributed.checkpoint as dcp  # late, see the note above MANIFEST

    try:
        dcp.save(tensors, checkpoint_id=str(directory), no_dist=True)
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        # DCP keeps each rank's failure as (exception, its stack): the exception is what says why.
        causes = [c[0] if isinstance(c, tuple) and c and isinstance(c[0], BaseException) else c
                  for c in getattr(exc, "failures", {}).values()] or [exc]
        for cause in causes:
            if isinstance(cause, OSError):
                raise cause from None
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        if shutil.disk_usage(directory).free < need:
            raise OSError(errno.ENOSPC, "No space left on device", str(directory)) from None
        # torch's file writer reports a refused write (EFBIG past RLIMIT_FSIZE) as a bare position mismatch.
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and limit < need:
            raise OSError(errno.EFBIG, f"File too large: files may be at most {limit} bytes here (ulimit -f), "
                          f"the checkpoint needs {need}", str(directory)) from None
        first = str(causes[0]).strip().splitlines()
        raise OSError(errno.EIO, f"checkpoint write failed: {first[0] if first else type(causes[0]).__name__}") from None


def write_checkpoint(root: Path, tensors: dict[str, torch.Tensor], manifest: Manifest) -> Path:
    """Write a checkpoint atomically under ``root``; on any error nothing new is visible."""
    checkpoint_root(root)
    tmp = _temp_dir(root, manifest.step)
    try:
        make_private_dir(tmp)
        save_tensors(tensors, tmp)
        for p in tmp.iterdir():
            make_private(p)
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
    checkpoint_root(root)
    tmp = _temp_dir(root, manifest.step)
    try:
        make_private_dir(tmp)
        for name, entry in manifest.files.items():
            shutil.copyfile(src / name, tmp / name)
            make_private(tmp / name)
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


def _open_step(path: Path) -> int:
    """A descriptor on the checkpoint directory ``path``, refused unless it is this user's and private."""
    try:
        return open_private_dir(path)
    except FileNotFoundError:
        raise CheckpointInvalid(f"{path} is missing") from None
    except NotPrivate as exc:
        raise CheckpointInvalid(f"{exc}; {NEVER_LOADED}") from None


def _check_entries(path: Path, fd: int) -> None:
    """Every entry of the checkpoint must be a private regular file of this user (DCP reads more than the manifest names)."""
    for name in os.listdir(fd):
        why = refusal(os.stat(name, dir_fd=fd, follow_symlinks=False), want_dir=False)
        if why:
            raise CheckpointInvalid(f"{path}: {name} {why}; {NEVER_LOADED}")


def _open_file(path: Path, fd: int, name: str) -> Any:
    try:
        return os.fdopen(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd), "rb")
    except FileNotFoundError:
        raise CheckpointInvalid(f"{path}: {name} is missing") from None


def _read_manifest(path: Path, fd: int) -> Manifest:
    try:
        with _open_file(path, fd, MANIFEST) as f:
            raw = f.read()
    except CheckpointInvalid:
        raise CheckpointInvalid(f"{path} has no manifest (partial write?)") from None
    try:
        manifest = msgspec.json.decode(raw, type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointInvalid(f"{path}: manifest unreadable ({exc})") from None
    if manifest.format != FORMAT:
        raise CheckpointInvalid(f"{path}: manifest format {manifest.format}, this trainer reads {FORMAT}")
    return manifest


def read_manifest(path: Path) -> Manifest:
    """The manifest of the checkpoint at ``path`` (which must be private to this user), its files unchecked."""
    fd = _open_step(path)
    try:
        _check_entries(path, fd)
        return _read_manifest(path, fd)
    finally:
        os.close(fd)


def validate(path: Path, model: str | None = None) -> Manifest:
    """The manifest of a private checkpoint whose files all match it; :class:`CheckpointInvalid` otherwise."""
    fd = _open_step(path)
    try:
        _check_entries(path, fd)
        manifest = _read_manifest(path, fd)
        if model is not None and manifest.model != model:
            raise CheckpointInvalid(f"{path} holds model {manifest.model}, this run trains {model}")
        if not manifest.files:
            raise CheckpointInvalid(f"{path}: manifest lists no files")
        for name, entry in manifest.files.items():
            if "/" in name or name in (".", ".."):
                raise CheckpointInvalid(f"{path}: manifest names {name!r}, not a file of this checkpoint")
            with _open_file(path, fd, name) as f:
                size = os.fstat(f.fileno()).st_size
                if size != entry.size:
                    raise CheckpointInvalid(f"{path}: {name} is {size} bytes, manifest says {entry.size} (truncated?)")
                if _sha256_of(f) != entry.sha256:
                    raise CheckpointInvalid(f"{path}: {name} fails its sha256 check (corrupt)")
        return manifest
    finally:
        os.close(fd)


def load_tensors(path: Path, into: dict[str, torch.Tensor]) -> None:
    """Fill ``into`` in place from the checkpoint at ``path`` (validate it first)."""
    import torch.distributed.checkpoint as dcp  # late, see the note above MANIFEST

    fd = _open_step(path)
    try:
        _check_entries(path, fd)
        # DCP opens files by name; through the checked descriptor, a directory
        # renamed over ``path`` since the check is not what it reads.
        dcp.load(into, checkpoint_id=f"/proc/self/fd/{fd}", no_dist=True)
    except CheckpointInvalid:
        raise
    except BaseException as exc:  # DCP wraps reader errors in CheckpointException, a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointInvalid(f"{path}: could not be read ({str(exc).splitlines()[0][:200]})") from None
    finally:
        os.close(fd)


def root_refusal(root: Path) -> str:
    """Why the checkpoints under ``root`` are never loaded, in one line; '' when ``root`` is private (or absent)."""
    try:
        st = os.lstat(root)
    except (FileNotFoundError, NotADirectoryError):
        return ""
    why = refusal(st, want_dir=True)
    return f"{root} {why}; {NEVER_LOADED}" if why else ""


def list_checkpoints(root: Path, refused: list[str] | None = None) -> list[tuple[int, Path]]:
    """Published checkpoints under ``root``, newest first (not validated).

    A ``root`` that is not this user's private directory lists nothing; why is
    appended to ``refused``, or logged when no list is given.
    """
    out: list[tuple[int, Path]] = []
    why = root_refusal(root)
    if why:
        if refused is None:
            logger.warning("{}", why)
        else:
            refused.append(why)
        return out
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for p in entries:
        if p.name.startswith(_PREFIX) and p.is_dir(follow_symlinks=False):
            try:
                out.append((int(p.name[len(_PREFIX) :]), Path(p.path)))
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
    if root_refusal(root):
        return []
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
