"""Load playbook files and directories as one set, all or nothing, keeping the last good set."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from gridwatch.playbooks.model import Playbook
from gridwatch.playbooks.schema import PlaybookError, check_text

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"


@dataclass(frozen=True)
class LoadResult:
    """What reading a set of files gave: playbooks, errors, and files that could not be read."""

    playbooks: tuple[Playbook, ...] = ()
    errors: tuple[PlaybookError, ...] = ()
    unreadable: tuple[str, ...] = ()  # one line each: "path: why"

    @property
    def ok(self) -> bool:
        return not self.errors and not self.unreadable


def playbook_files(paths: Iterable[str | Path]) -> list[Path]:
    """Files named, and the ``*.yaml``/``*.yml`` files inside directories named, in a stable order."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found.extend(sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file()))
        else:
            found.append(path)
    return found


def load(paths: Iterable[str | Path]) -> LoadResult:
    """Read and validate every playbook under ``paths``; names must be unique across the set."""
    playbooks: list[Playbook] = []
    errors: list[PlaybookError] = []
    unreadable: list[str] = []
    seen: dict[str, Playbook] = {}
    for path in playbook_files(paths):
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            unreadable.append(f"{path}: no such file")
            continue
        except (OSError, UnicodeDecodeError) as exc:
            unreadable.append(f"{path}: cannot read it ({exc.__class__.__name__}: {exc})")
            continue
        found, problems = check_text(text, str(path))
        errors.extend(problems)
        for playbook in found:
            first = seen.get(playbook.name)
            if first is not None:
                errors.append(PlaybookError(str(path), playbook.line, 1,
                                            f"playbook name {playbook.name!r} is already used at {first.source}:{first.line}"))
                continue
            seen[playbook.name] = playbook
            playbooks.append(playbook)
    return LoadResult(tuple(playbooks), tuple(errors), tuple(unreadable))


def load_builtin() -> tuple[Playbook, ...]:
    """The playbooks gridwatch ships; they are tested, so an error here is a bug."""
    result = load([BUILTIN_DIR])
    if not result.ok:
        raise RuntimeError("builtin playbooks are invalid: " + "; ".join(map(str, result.errors)))
    return result.playbooks


def shadowing_errors(playbooks: Iterable[Playbook], shipped: dict[str, Playbook]) -> list[PlaybookError]:
    """A user playbook that takes a shipped one's name without ``replaces:`` it, or replaces one that is not
    shipped (a shipped playbook's own file is not a user's)."""
    errors = []
    for pb in playbooks:
        own = shipped.get(pb.name)
        if own is not None and Path(own.source).resolve() == Path(pb.source).resolve():
            continue
        if pb.replaces is not None and pb.replaces not in shipped:
            errors.append(PlaybookError(pb.source, pb.line, 1, f"playbook {pb.name!r} replaces {pb.replaces!r}, "
                                        "which is not a shipped playbook"))
        elif own is not None and pb.replaces != pb.name:
            errors.append(PlaybookError(pb.source, pb.line, 1, f"playbook name {pb.name!r} is a shipped playbook's; "
                                        f"add 'replaces: {pb.name}' to use yours instead, or rename it"))
    return errors


def load_with_builtin(paths: Iterable[str | Path], skip: Iterable[str] = ()) -> LoadResult:
    """The shipped playbooks (less those named in ``skip``) plus the user's under ``paths``, checked as one set.

    A user playbook may not take a shipped playbook's name unless it says so
    with ``replaces: NAME``; then it is used instead of that one. ``replaces``
    must name a shipped playbook. Naming an unknown one in ``skip`` is an error.
    """
    shipped = {pb.name: pb for pb in load_builtin()}
    unknown = sorted(set(skip) - set(shipped))
    if unknown:
        return LoadResult(unreadable=(f"no shipped playbook named {', '.join(unknown)} to leave out "
                                      f"(shipped: {', '.join(sorted(shipped))})",))
    user = load(list(paths)) if paths else LoadResult()
    errors = [*user.errors, *shadowing_errors(user.playbooks, shipped)]
    replaced = {pb.replaces for pb in user.playbooks if pb.replaces is not None and pb.replaces in shipped}
    kept = tuple(pb for name, pb in shipped.items() if name not in replaced and name not in set(skip))
    return LoadResult(kept + user.playbooks, tuple(errors), user.unreadable)


@dataclass
class PlaybookLibrary:
    """The playbook set the console runs. A reload that finds any error changes nothing."""

    paths: tuple[str, ...]
    playbooks: tuple[Playbook, ...] = ()
    last_errors: tuple[str, ...] = field(default_factory=tuple)

    def reload(self) -> LoadResult:
        result = load(self.paths)
        if result.ok:
            self.playbooks = result.playbooks
            self.last_errors = ()
            logger.info("loaded {} playbooks", len(result.playbooks))
        else:
            self.last_errors = tuple([*map(str, result.errors), *result.unreadable])
            logger.warning("playbooks not reloaded, keeping the {} loaded before: {}",
                           len(self.playbooks), self.last_errors[0])
        return result
