"""A scene bundle as it travels back to the console: the list of its files with their checksums, read in chunks.

The agent answers ``read_scene`` without ``file`` with a :class:`SceneListing` (in the result's ``data``,
under ``listing``), and with ``file``, ``offset`` and ``length`` with those bytes in ``ActionResult.chunk``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gridwatch.wire.text import as_builtins

# The most one read answers with: its base64 (4/3 as long) and the frame around it stay under MAX_FRAME_BYTES.
SCENE_CHUNK_BYTES = 512 * 1024


class SceneFile(msgspec.Struct, kw_only=True, gc=False):
    """One file of a bundle: its name inside the bundle, its size and its sha256 (hex), as the node read it."""

    name: str
    size: int
    sha256: str


class SceneSkipped(msgspec.Struct, kw_only=True, gc=False):
    """An entry of a bundle the agent does not serve (a symbolic link, a folder), and why."""

    name: str
    why: str


class SceneListing(msgspec.Struct, kw_only=True, gc=False):
    """What one bundle holds, as the agent lists it for a copy."""

    scene: str
    files: list[SceneFile] = []
    skipped: list[SceneSkipped] = []


def listing_data(listing: SceneListing) -> dict[str, Any]:
    """``listing`` as an ActionResult's ``data``."""
    return {"listing": msgspec.to_builtins(listing)}


def listing_of(data: dict[str, Any]) -> SceneListing:
    """The listing in an ActionResult's ``data``; ValueError in one line when there is none or it is malformed."""
    try:
        return msgspec.convert(as_builtins(data.get("listing")), SceneListing)
    except msgspec.ValidationError as exc:
        raise ValueError(f"the agent's scene listing is malformed: {exc}") from None
