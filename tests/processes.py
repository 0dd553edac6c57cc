"""Which processes of a group are still alive, read from /proc (tests that check a command was killed)."""

from __future__ import annotations

from pathlib import Path


def live_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` still alive; a killed one whose parent is gone may linger as a zombie."""
    members = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited while we looked
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat_file.parent.name))
    return members
