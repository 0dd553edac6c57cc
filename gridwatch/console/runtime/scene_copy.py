"""A scene bundle copied off its node into the console's scene store, over the agent's own link, before the next step.

The agent lists the bundle (every file with its size and sha256); the files that fit ``scene_max``, smallest
first, are read in chunks (``read_scene``, a few in flight), written privately, and checked against the
node's sha256: a file that does not match is not kept, and the copy is marked failed. The records of
:mod:`gridwatch.console.runtime.scene_store` say at every moment what arrived and what did not.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from loguru import logger

from gridwatch.console.runtime.scene_store import (
    MANIFEST,
    PARTIAL,
    RECORD_NAMES,
    BadFile,
    CopyState,
    KeptFile,
    LeftOut,
    Manifest,
    Partial,
    incident_dir,
    open_private,
    private_tree,
    safe_name,
    write_record,
)
from gridwatch.wire.protocol import ActionResult
from gridwatch.wire.scenes import SCENE_CHUNK_BYTES, SceneFile, listing_of

# Chunk reads in flight per file: enough to hide the link's round trip, few enough for the agent's
# per-session limit on running requests (agent/clients.py MAX_PENDING) and its reply queue.
READ_WINDOW = 4
CHUNK_TIMEOUT_S = 10.0
# A copy stops asking for more after this long (the rest stays on the node, and PARTIAL.json says so), so that
# with a chunk's wait on top it ends inside the capture step's own 60 s: a slow link must not fail the step
# and hold back the isolation behind it.
COPY_TIME_S = 40.0

# Asks ``node``'s agent ``read_scene`` with these args, waiting at most this many seconds.
ReadScene = Callable[[str, dict[str, Any], float], Awaitable[ActionResult]]


class _CopyStopped(Exception):
    """A chunk did not come (the node or its link stopped answering, or the agent refused it); the message says why."""


def _write_hashed(out: BinaryIO, digest: Any, data: bytes) -> None:
    out.write(data)
    digest.update(data)


@dataclass(slots=True)
class SceneCopy:
    """How one bundle's copy ended: where it is on the console (None: nowhere), and what it holds."""

    node: str
    incident: str
    on_node: str
    state: CopyState
    where: Path | None = None
    files: int = 0
    size: int = 0
    left_out: list[str] = field(default_factory=list)
    why: str = ""

    def line(self) -> str:
        """The copy in one line, for the step's outcome and the audit log."""
        if self.where is None:
            return f"{self.state}: {self.why}"
        said = f"{self.state} at {self.where} ({self.files} files, {self.size / 1e6:.1f} MB"
        said += f"; left out: {', '.join(self.left_out)})" if self.left_out else ")"
        return f"{said}: {self.why}" if self.why else said


class SceneKeeper:
    """Copies scenes into ``root`` (``<db>.scenes``) through ``read``; at most ``max_bytes`` of each bundle."""

    def __init__(self, root: Path, read: ReadScene, max_bytes: int, *, window: int = READ_WINDOW,
                 chunk_timeout: float = CHUNK_TIMEOUT_S, time_limit: float = COPY_TIME_S,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.read = read
        self.max_bytes = max_bytes
        self.window = max(window, 1)
        self.chunk_timeout = chunk_timeout
        self.time_limit = time_limit
        self.clock = clock
        self.monotonic = monotonic

    async def keep(self, node: str, incident: str, on_node: str) -> SceneCopy:
        """Copy the bundle at ``on_node`` (its path on the node) of ``incident`` off ``node``.

        How it ended is in the answer (a node that died, a checksum that did not match); raises only
        OSError, when the console's own disk refuses, and CancelledError.
        """
        scene = PurePosixPath(on_node).name
        if not on_node or safe_name(scene) != scene:
            return SceneCopy(node, incident, on_node, CopyState.NOT_COPIED,
                             why="the agent named no bundle (an agent before scene copies answers a repeated "
                                 "step without one); the scene is on the node only")
        listed = await self.read(node, {"scene": scene}, self.chunk_timeout)
        dest = incident_dir(self.root, incident) / safe_name(node) / scene
        started = self.clock()
        copy = _Copy(self, node, incident, on_node, scene, dest, started)
        if not listed.ok:
            return copy.end_unlisted(f"the node did not list its bundle: {listed.message}")
        try:
            listing = listing_of(listed.data)
        except ValueError as exc:
            return copy.end_unlisted(str(exc))
        return await copy.run(listing.files, [LeftOut(name=s.name, why=s.why) for s in listing.skipped])


class _Copy:
    """One bundle's copy under way, and its records kept true as it goes."""

    def __init__(self, keeper: SceneKeeper, node: str, incident: str, on_node: str, scene: str, dest: Path,
                 started: float) -> None:
        self.keeper = keeper
        self.node, self.incident, self.on_node, self.scene = node, incident, on_node, scene
        self.dest = dest
        self.started = started
        self.deadline = keeper.monotonic() + keeper.time_limit
        self.kept: list[KeptFile] = []
        self.failed: list[BadFile] = []
        self.left_out: list[LeftOut] = []
        self.missing: list[LeftOut] = []
        self.log = logger.bind(node=node)

    def _fresh_dest(self) -> None:
        # The same bundle copied again (a plan carried on): the earlier copy is of the same bytes, redone whole.
        if self.dest.exists():
            shutil.rmtree(self.dest)
        private_tree(self.keeper.root, self.dest)

    def _partial(self, state: CopyState, why: str) -> None:
        write_record(self.dest / PARTIAL, Partial(
            incident=self.incident, node=self.node, scene=self.scene, on_node=self.on_node, state=state, why=why,
            at=self.keeper.clock(), arrived=[f.name for f in self.kept], missing=list(self.missing)))

    def end_unlisted(self, why: str) -> SceneCopy:
        self._fresh_dest()
        self._partial(CopyState.PARTIAL, why)
        self.log.warning("scene of {} not copied: {}", self.incident, why)
        return SceneCopy(self.node, self.incident, self.on_node, CopyState.PARTIAL, self.dest, why=why)

    def _choose(self, files: list[SceneFile]) -> list[SceneFile]:
        """The files that fit scene_max, smallest first (the most of the scene); the others left out, saying why."""
        chosen, total = [], 0
        for f in sorted(files, key=lambda f: (f.size, f.name)):
            if f.name in RECORD_NAMES or safe_name(f.name) != f.name or f.size < 0:
                self.left_out.append(LeftOut(name=safe_name(f.name), size=f.size,
                                             why="a name the console cannot keep as it is (or its records' own)"))
            elif total + f.size > self.keeper.max_bytes:
                self.left_out.append(LeftOut(name=f.name, size=f.size,
                                             why=f"over scene_max: {self.keeper.max_bytes} bytes per node's bundle"))
            else:
                chosen.append(f)
                total += f.size
        return chosen

    async def run(self, files: list[SceneFile], skipped: list[LeftOut]) -> SceneCopy:
        self._fresh_dest()
        self.left_out = list(skipped)
        chosen = self._choose(files)
        self.missing = [LeftOut(name=f.name, size=f.size, why="not copied yet") for f in chosen]
        self._partial(CopyState.COPYING, "the copy is under way (if this stays, the console stopped during it)")
        why = ""
        try:
            for f in chosen:
                try:
                    whole = await self._file(f)
                except _CopyStopped as exc:
                    why = f"the copy stopped before it ended: {exc}"
                    self.missing = [LeftOut(name=m.name, size=m.size, why=why) for m in self.missing]
                    break
                self.missing = [m for m in self.missing if m.name != f.name]
                if not whole:
                    self.missing.append(LeftOut(name=f.name, size=f.size, why="did not match the node's sha256"))
                self._partial(CopyState.COPYING, "the copy is under way (if this stays, the console stopped during it)")
        except asyncio.CancelledError:
            stopped = "the copy was stopped before it ended (the step ran out of time, or the console stopped)"
            self.missing = [LeftOut(name=m.name, size=m.size, why=stopped) for m in self.missing]
            self._partial(CopyState.PARTIAL, stopped)
            raise
        return self._end(why)

    def _end(self, why: str) -> SceneCopy:
        if self.failed:
            state = CopyState.FAILED
            bad = ", ".join(f.name for f in self.failed)
            why = "; ".join(w for w in (f"{bad} did not match the node's sha256 and was not kept", why) if w)
        elif self.missing:
            state = CopyState.PARTIAL
        else:
            state = CopyState.CAPPED if any(o.why.startswith("over scene_max") for o in self.left_out) \
                else CopyState.WHOLE
        write_record(self.dest / MANIFEST, Manifest(
            incident=self.incident, node=self.node, scene=self.scene, on_node=self.on_node, state=state,
            scene_max=self.keeper.max_bytes, started_at=self.started, finished_at=self.keeper.clock(),
            files=self.kept, left_out=self.left_out, failed=self.failed, why=why))
        if state in (CopyState.WHOLE, CopyState.CAPPED):
            (self.dest / PARTIAL).unlink(missing_ok=True)
        else:
            self._partial(state, why)
        copy = SceneCopy(self.node, self.incident, self.on_node, state, self.dest, files=len(self.kept),
                         size=sum(f.size for f in self.kept), left_out=[o.name for o in self.left_out], why=why)
        self.log.log("INFO" if state in (CopyState.WHOLE, CopyState.CAPPED) else "WARNING",
                     "scene of {} copied: {}", self.incident, copy.line())
        return copy

    async def _file(self, f: SceneFile) -> bool:
        """One file, its chunks a few at a time, checked against its sha256 before it takes its name (True)."""
        keeper = self.keeper
        part = self.dest / f".{f.name}.part"
        digest = hashlib.sha256()
        pending: deque[asyncio.Future[ActionResult]] = deque()
        offset = 0
        try:
            with open_private(part) as out:
                while offset < f.size or pending:
                    if offset < f.size and keeper.monotonic() > self.deadline:
                        raise _CopyStopped(f"{f.name}: it took longer than {keeper.time_limit:g} s, the rest stays "
                                           "on the node")
                    while offset < f.size and len(pending) < keeper.window:
                        length = min(SCENE_CHUNK_BYTES, f.size - offset)
                        args = {"scene": self.scene, "file": f.name, "offset": offset, "length": length}
                        pending.append(asyncio.ensure_future(keeper.read(self.node, args, keeper.chunk_timeout)))
                        offset += length
                    result = await pending.popleft()
                    if not result.ok:
                        raise _CopyStopped(f"{f.name}: {result.message}")
                    data = result.chunk or b""
                    # Off the loop: a slow disk must not stall the frames of every other node meanwhile.
                    await asyncio.to_thread(_write_hashed, out, digest, data)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        finally:
            for task in pending:
                task.cancel()
        got = digest.hexdigest()
        if got != f.sha256:
            part.unlink(missing_ok=True)
            self.failed.append(BadFile(name=f.name, size=f.size, sha256=f.sha256, got=got))
            self.log.error("scene of {}: {} arrived with sha256 {}, the node listed {}: not kept",
                           self.incident, f.name, got, f.sha256)
            return False
        part.rename(self.dest / f.name)
        self.kept.append(KeptFile(name=f.name, size=f.size, sha256=f.sha256))
        return True
