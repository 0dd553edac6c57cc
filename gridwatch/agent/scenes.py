"""Scene bundles read back by a console: a bundle's files with their checksums, and a file's bytes in chunks.

Only regular files directly inside one bundle of the agent's own scene directory are served. The names
come from a console, and text from a console is untrusted too: a name that is empty, only dots, or holds a
path separator is refused before anything is opened, and every open is relative to the bundle's own
directory with ``O_NOFOLLOW``, so no symbolic link (to a bundle, or inside one) leads out of it.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gridwatch.sshlink.server import Caller
from gridwatch.wire import protocol as p
from gridwatch.wire.scenes import SCENE_CHUNK_BYTES, SceneFile, SceneListing, SceneSkipped, listing_data

if TYPE_CHECKING:
    from gridwatch.agent.agent import Agent

_MAX_NAME = 255
_HASH_BLOCK = 1 << 20


class SceneRefused(ValueError):
    """A read the agent will not serve; the message says why in one sentence."""


def _one_name(text: str, what: str) -> str:
    if not text or len(text) > _MAX_NAME or text.strip(".") == "" or "/" in text or "\\" in text or "\0" in text:
        raise SceneRefused(f"read_scene refused: {what} {p.clean_text(text, 80)!r} is not a name inside the "
                           "scene directory (no path, no '..')")
    return text


def _open_bundle(scene_dir: str, scene: str) -> int:
    """A directory descriptor of bundle ``scene``, which must be a real directory right inside ``scene_dir``."""
    root = Path(scene_dir).resolve()
    name = _one_name(scene, "scene")
    try:
        fd = os.open(root / name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SceneRefused(f"read_scene: no scene {name!r} in {root}") from None
    except NotADirectoryError:
        raise SceneRefused(f"read_scene refused: {name!r} in {root} is not a scene bundle") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            raise SceneRefused(f"read_scene refused: {name!r} in {root} is a symbolic link") from None
        raise
    return fd


def _open_file(bundle: int, name: str) -> int:
    try:
        fd = os.open(_one_name(name, "file"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=bundle)
    except FileNotFoundError:
        raise SceneRefused(f"read_scene: no file {name!r} in the scene") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SceneRefused(f"read_scene refused: {name!r} is a symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SceneRefused(f"read_scene refused: {name!r} is not a regular file")
    return fd


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while block := os.pread(fd, _HASH_BLOCK, offset):
        digest.update(block)
        offset += len(block)
    return digest.hexdigest()


def list_bundle(scene_dir: str, scene: str) -> SceneListing:
    """Every regular file of bundle ``scene`` with its size and sha256; links and folders are named, not served."""
    bundle = _open_bundle(scene_dir, scene)
    try:
        files: list[SceneFile] = []
        skipped: list[SceneSkipped] = []
        with os.scandir(bundle) as entries:
            names = sorted((e.name, e.is_symlink(), e.is_file(follow_symlinks=False)) for e in entries)
        for name, link, regular in names:
            if link or not regular:
                why = "a symbolic link: not served" if link else "not a regular file: not served"
                skipped.append(SceneSkipped(name=name, why=why))
                continue
            fd = _open_file(bundle, name)
            try:
                files.append(SceneFile(name=name, size=os.fstat(fd).st_size, sha256=_sha256(fd)))
            finally:
                os.close(fd)
        return SceneListing(scene=scene, files=files, skipped=skipped)
    finally:
        os.close(bundle)


def read_chunk(scene_dir: str, scene: str, name: str, offset: int, length: int) -> tuple[bytes, int]:
    """Up to ``length`` bytes (at most SCENE_CHUNK_BYTES) of ``name`` in bundle ``scene`` from ``offset``, and its size."""
    bundle = _open_bundle(scene_dir, scene)
    try:
        fd = _open_file(bundle, name)
    finally:
        os.close(bundle)
    try:
        return os.pread(fd, min(length, SCENE_CHUNK_BYTES), offset), os.fstat(fd).st_size
    finally:
        os.close(fd)


def _whole(args: dict[str, Any], name: str, default: int | None = None) -> int:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SceneRefused(f"read_scene: {name} must be a whole number from 0, got {p.clean_text(str(value), 40)!r}")
    return value


def _answer(action: p.Action, ok: bool, message: str, chunk: bytes | None = None, **data: Any) -> p.ActionResult:
    # changed=False: a read is no news; the agent publishes no action event for it.
    return p.ActionResult(id=action.id, action=action.action, ok=ok, message=p.Text(message),
                          data={"changed": False, **data}, chunk=chunk)


async def read_scene(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    """``{"scene": NAME}``: the bundle's listing; with ``"file"``, ``"offset"`` and ``"length"``: those bytes."""
    args = dict(action.args)
    scene = str(args.get("scene", ""))
    name = args.get("file")
    try:
        if name is None:
            listing = await asyncio.to_thread(list_bundle, agent.config.scene_dir, scene)
            total = sum(f.size for f in listing.files)
            return _answer(action, True, f"{len(listing.files)} files, {total} bytes", **listing_data(listing))
        offset, length = _whole(args, "offset"), _whole(args, "length", SCENE_CHUNK_BYTES)
        data, size = await asyncio.to_thread(read_chunk, agent.config.scene_dir, scene, str(name), offset, length)
    except SceneRefused as exc:
        agent.log.warning("{} (asked by {})", exc, caller)
        return _answer(action, False, str(exc))
    except OSError as exc:
        return _answer(action, False, f"read_scene: {exc.strerror or exc}")
    return _answer(action, True, "", chunk=data, offset=offset, size=size)
