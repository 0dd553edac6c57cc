"""The console's scene store on disk: where copied bundles go beside the incident database, their records, the export.

``<db>.scenes/<incident>/<node>/<bundle>/`` holds one bundle copied off its node: private folders (0700) and
files (0600). ``MANIFEST.json`` says what the copy holds (every file with its size and sha256, what was left
out and why); ``PARTIAL.json`` is there while the copy runs and stays when it did not end whole (what arrived,
what is missing, why), so a console or node that died during a copy leaves the truth behind, not a bundle
that looks whole.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import msgspec

MANIFEST = "MANIFEST.json"
PARTIAL = "PARTIAL.json"
RECORD_NAMES = frozenset({MANIFEST, PARTIAL})
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


class CopyState(StrEnum):
    """How a bundle's copy ended (or that it has not yet)."""

    COPYING = "copying"
    WHOLE = "whole"
    CAPPED = "capped"  # every file within scene_max arrived and checked; the rest was left out, and is named
    PARTIAL = "partial"  # the copy stopped (the node died, say): what arrived is kept, the rest is named
    FAILED = "failed"  # a file did not match its checksum: it is not kept, and the copy is not whole
    NOT_COPIED = "not_copied"  # the agent named no bundle to copy: the scene is on the node only


class KeptFile(msgspec.Struct, kw_only=True):
    name: str
    size: int
    sha256: str


class LeftOut(msgspec.Struct, kw_only=True):
    name: str
    size: int | None = None
    why: str


class BadFile(msgspec.Struct, kw_only=True):
    name: str
    size: int
    sha256: str  # what the node listed
    got: str  # what arrived


class Manifest(msgspec.Struct, kw_only=True):
    """MANIFEST.json: what one copied bundle holds."""

    incident: str
    node: str
    scene: str
    on_node: str  # the bundle's path on the node
    state: CopyState
    scene_max: int
    started_at: float
    finished_at: float
    files: list[KeptFile] = []
    left_out: list[LeftOut] = []
    failed: list[BadFile] = []
    why: str = ""


class Partial(msgspec.Struct, kw_only=True):
    """PARTIAL.json: a copy under way, or one that did not end whole."""

    incident: str
    node: str
    scene: str
    on_node: str
    state: CopyState
    why: str
    at: float
    arrived: list[str] = []
    missing: list[LeftOut] = []


def scenes_path_for(db_path: str | os.PathLike[str]) -> Path:
    """Where the console that keeps its incidents in ``db_path`` keeps its scenes: a private folder beside it."""
    return Path(db_path).with_suffix(".scenes")


def safe_name(text: str, limit: int = 160) -> str:
    """``text`` as one file name: letters, digits and ``-_.:``, other characters as ``_``, never only dots."""
    cleaned = "".join(ch if ch in _SAFE else "_" for ch in text[:limit])
    return cleaned if cleaned.strip(".") else "_"


def incident_dir(root: Path, incident: str) -> Path:
    return root / safe_name(incident)


def private_dir(path: Path) -> None:
    """``path`` and every folder above it that it makes, 0700: bundles hold logs and stacks."""
    missing = []
    level = path
    while not level.exists():
        missing.append(level)
        level = level.parent
    for made in reversed(missing):
        made.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # mkdir leaves an existing folder as it was


def private_tree(root: Path, path: Path) -> None:
    """``path`` inside ``root``, made if need be, and every folder from ``root`` down to it 0700."""
    private_dir(path)
    level = path
    while True:
        os.chmod(level, 0o700)
        if level == root or level.parent == level:
            break
        level = level.parent


def open_private(path: Path) -> io.BufferedWriter:
    """A new file only this user may read (0600); an existing one, or a link in its place, is an OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "wb")


def write_record(path: Path, record: Manifest | Partial) -> None:
    """Write ``record`` as JSON at ``path``, replacing it whole (a reader never sees half of one)."""
    temp = path.with_name(f".{path.name}.tmp")
    temp.unlink(missing_ok=True)
    with open_private(temp) as out:
        out.write(msgspec.json.format(msgspec.json.encode(record)) + b"\n")
    os.replace(temp, path)


def read_manifest(bundle: Path) -> Manifest | None:
    try:
        return msgspec.json.decode((bundle / MANIFEST).read_bytes(), type=Manifest)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def read_partial(bundle: Path) -> Partial | None:
    try:
        return msgspec.json.decode((bundle / PARTIAL).read_bytes(), type=Partial)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def bundles(where: Path) -> list[Path]:
    """The bundles kept under one incident's folder (``<node>/<bundle>``), in name order."""
    return sorted(b for node in sorted(where.iterdir()) if node.is_dir() and not node.is_symlink()
                  for b in node.iterdir() if b.is_dir() and not b.is_symlink())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@dataclass(slots=True)
class BundleCheck:
    """One bundle as the export found it: its state, and the files that no longer match their checksums."""

    path: Path
    state: str
    files: int = 0
    size: int = 0
    changed: list[str] = field(default_factory=list)
    why: str = ""


def check_bundle(bundle: Path) -> BundleCheck:
    """Read ``bundle``'s records and check every kept file against its sha256."""
    manifest = read_manifest(bundle)
    partial = read_partial(bundle)
    if manifest is None:
        why = partial.why if partial is not None else "no MANIFEST.json: the copy never ended"
        return BundleCheck(bundle, str(partial.state if partial is not None else CopyState.PARTIAL), why=why)
    check = BundleCheck(bundle, str(manifest.state), files=len(manifest.files),
                        size=sum(f.size for f in manifest.files), why=manifest.why)
    for kept in manifest.files:
        path = bundle / kept.name
        try:
            same = not path.is_symlink() and file_sha256(path) == kept.sha256
        except OSError:
            same = False
        if not same:
            check.changed.append(kept.name)
    return check


def export(where: Path, out: Path, top: str) -> list[BundleCheck]:
    """Every bundle under ``where`` (one incident's folder) as one private .tar.gz at ``out``, under ``top/``.

    Only regular files go in (a link is never followed); the tarball replaces ``out`` whole once written.
    """
    checks = [check_bundle(b) for b in bundles(where)]
    temp = out.with_name(f".{out.name}.tmp")
    temp.unlink(missing_ok=True)
    with open_private(temp) as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for check in checks:
            for path in sorted(check.path.iterdir()):
                if path.is_symlink() or not path.is_file() or path.name.startswith("."):
                    continue
                info = tar.gettarinfo(str(path), arcname=f"{top}/{path.relative_to(where).as_posix()}")
                info.uname = info.gname = ""
                with open(path, "rb") as f:
                    tar.addfile(info, f)
    os.replace(temp, out)
    return checks
