"""Private paths for the trainer: directories 0700 and files 0600 whatever the umask, never reached through a link, refused when another user could have written them.

A checkpoint's DCP metadata is a pickle: whoever can write a checkpoint the
trainer loads can run code as the trainer's user. So everything the trainer
reads back must be this user's and closed to group and others, and a path
someone else got to first is refused rather than put into shape.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotPrivate(OSError):
    """A path the trainer must not use; the message says why in one line."""


def refusal(st: os.stat_result, want_dir: bool, closed: int = 0o077) -> str:
    """Why a path with this ``lstat`` result is not this user's private directory (or file); '' when it is.

    ``closed``: the mode bits that must be clear (by default all of group's and
    others'; 0o022 for a path others may read but never change).
    """
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if want_dir and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not want_dir and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & closed:
        what = "writable by" if not closed & 0o055 else "open to"
        return f"is {what} group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def path_refusal(path: Path, want_dir: bool = True) -> str:
    """:func:`refusal` for ``path`` itself (a link is not followed); '' for a private one, 'is missing' when absent."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "is missing"
    return refusal(st, want_dir)


def _open_dir(path: Path) -> int:
    try:
        return os.open(path, _OPEN_DIR)
    except FileNotFoundError:
        raise
    except OSError as exc:
        why = path_refusal(path) or (exc.strerror or str(exc))
        raise NotPrivate(f"{path} {why}") from None


def _check(fd: int, path: Path) -> None:
    why = refusal(os.fstat(fd), want_dir=True)
    if why:
        raise NotPrivate(f"{path} {why}")


def open_private_dir(path: Path) -> int:
    """A file descriptor on ``path``, checked to be this user's private directory; raises :class:`NotPrivate`.

    Opened without following a link at ``path``, so what was checked is what
    the descriptor reads, whatever is renamed over ``path`` afterwards.
    """
    fd = _open_dir(path)
    try:
        _check(fd, path)
    except NotPrivate:
        os.close(fd)
        raise
    return fd


def make_private_dir(path: Path, parents: bool = False) -> Path:
    """Create ``path`` mode 0700, or accept it if it already is this user's private directory.

    Anything else at ``path`` (another user's directory, a link, a directory
    open to others) raises :class:`NotPrivate`; it is never changed. With
    ``parents``, missing parents are made first, with the usual modes.
    """
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, DIR_MODE)
        created = True
    except FileExistsError:
        created = False
    fd = _open_dir(path)
    try:
        st = os.fstat(fd)
        if created and st.st_uid == os.geteuid() and stat.S_ISDIR(st.st_mode):
            # mkdir applied the umask; only the directory made just now is put to 0700.
            os.fchmod(fd, DIR_MODE)
        _check(fd, path)
    finally:
        os.close(fd)
    return path


def make_private(path: Path) -> None:
    """Set mode 0600 on a file this process just wrote inside a private directory."""
    os.chmod(path, FILE_MODE)


def open_private_file(path: Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_EXCL) -> int:
    """Open (by default: create) ``path`` mode 0600 whatever the umask, never through a link."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return fd


def remove_private_dir(path: Path) -> str:
    """Remove ``path`` and all under it if it is this user's private directory; else leave it and say why ('' when done)."""
    why = path_refusal(path)
    if why == "is missing":
        return ""
    if why:
        return f"{path} {why}"
    shutil.rmtree(path, ignore_errors=True)
    return ""


def remove_if_empty(path: Path) -> None:
    """Remove this user's private directory ``path`` if nothing is left in it."""
    if path_refusal(path):
        return
    try:
        os.rmdir(path)
    except OSError:
        pass  # another node's tier is still in it, or it is gone already
