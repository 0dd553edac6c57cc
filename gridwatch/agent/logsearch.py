"""Log search for clients: a vetted regular expression, run in a child process with a deadline.

A client's pattern never runs on the agent's event loop. It is parsed first and
refused when it can backtrack without bound (a repetition inside a repetition,
an alternation inside a repetition, a back-reference) or for a time polynomial
in the line's length with a high power (more than three open repetitions in a
row, like ``\\s*\\s*\\s*\\s*x``); what is left runs in a
child process that is killed at its deadline, so a pattern that is merely slow
costs one worker, never the agent's samples. ``python -m gridwatch.agent.logsearch`` is
that worker: a request on stdin, the matching line numbers on stdout.
"""

from __future__ import annotations

import re
import resource
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from gridwatch.agent.workers import ChildTimeout, run_child
from gridwatch.wire.protocol import clean_text

try:  # the parser's home since Python 3.11
    # attr-defined: the stubs know these private modules only by their deprecated sre_* names.
    from re import _constants as _c  # type: ignore[attr-defined]
    from re import _parser as _sre  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants as _c
    import sre_parse as _sre

# A parsed pattern is a sequence of (op, argument) nodes whose argument's shape depends
# on the op; the parser is private and gives them no type.
_Parsed = Any

MAX_PATTERN_CHARS = 500
# Each open repetition can take any share of a line, so k of them try about
# len(line)**k splits before failing: twelve on 30 spaces ran for minutes.
MAX_OPEN_REPEATS = 3
_OPEN_RANGE = 16  # a bounded repetition this wide counts as open too ({0,100} is as bad as *)
DEFAULT_TIMEOUT_S = 5.0
_WORKER_MEMORY = 2 << 30  # bytes: the buffer it is sent is at most a few tens of MB

LogEntry = tuple[str, str, float]  # (source, line, ts), as gridwatch.agent.logs keeps them

_REPEATS = {_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", _c.MAX_REPEAT)}
_BACKREFS = {_c.GROUPREF, _c.GROUPREF_EXISTS}


class SearchRefused(ValueError):
    """A pattern the agent will not run; the message says why in one sentence."""


class SearchTimeout(ValueError):
    """The worker ran past its deadline and was killed."""


class _Request(msgspec.Struct, array_like=True):
    pattern: str
    limit: int
    lines: list[str]


def _children(op: object, av: _Parsed) -> list[_Parsed]:
    """The sub-patterns under one parsed node."""
    if op in _REPEATS:
        return [av[2]]
    if op is _c.SUBPATTERN:
        return [av[-1]]
    if op is _c.BRANCH:
        return list(av[1])
    if op in (_c.ASSERT, _c.ASSERT_NOT):
        return [av[1]]
    if op is getattr(_c, "ATOMIC_GROUP", None):
        return [av]
    return []


def _open_repeats(items: _Parsed) -> int:
    """How many repetitions in the parsed pattern have no upper bound, or a wide one."""
    count = 0
    for op, av in items:
        if op in _REPEATS and (av[1] == _c.MAXREPEAT or av[1] - av[0] > _OPEN_RANGE):
            count += 1
        for child in _children(op, av):
            count += _open_repeats(child)
    return count


def _walk(items: _Parsed, inside_repeat: bool) -> None:
    for op, av in items:
        if op in _BACKREFS:
            raise SearchRefused("back-references are not allowed in a log search")
        variable = op in _REPEATS and av[1] != av[0]
        if inside_repeat and variable:
            raise SearchRefused("a repetition inside a repetition (like (a+)+) is not allowed in a log search")
        # A fixed count repeats too: (a?){30} backtracks as badly as (a?)+.
        repeats = op in _REPEATS and av[1] > 1
        if inside_repeat and op is _c.BRANCH:
            raise SearchRefused("an alternation inside a repetition (like (a|b)+) is not allowed in a log search; use a character class")
        for child in _children(op, av):
            _walk(child, inside_repeat or repeats)


def vet_pattern(pattern: str) -> re.Pattern[str]:
    """Compile a client's pattern, or raise ValueError (SearchRefused for a dangerous one) in one line."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise SearchRefused(f"a search pattern is at most {MAX_PATTERN_CHARS} characters, this one has {len(pattern)}")
    try:
        parsed = _sre.parse(pattern)
        regex = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from None
    _walk(parsed, False)
    opened = _open_repeats(parsed)
    if opened > MAX_OPEN_REPEATS:
        raise SearchRefused(f"a log search may have at most {MAX_OPEN_REPEATS} open repetitions (like * or +), "
                            f"this one has {opened}; anchor it on literal text instead")
    return regex


def match_lines(regex: re.Pattern[str], lines: Sequence[str], limit: int) -> list[int]:
    """Indices of the last ``limit`` lines that match, oldest first."""
    found = [i for i, line in enumerate(lines) if regex.search(line)]
    return found[-limit:] if limit > 0 else []


def encode_request(pattern: str, limit: int, lines: list[str]) -> bytes:
    return msgspec.msgpack.encode(_Request(pattern, limit, lines))


async def search_entries(entries: list[LogEntry], pattern: str, limit: int, timeout: float = DEFAULT_TIMEOUT_S) -> list[LogEntry]:
    """The newest ``limit`` entries whose line matches ``pattern``, oldest first, found in a worker.

    Raises SearchRefused or ValueError for a pattern the agent will not run, and
    SearchTimeout when the worker had to be killed at ``timeout``.
    """
    vet_pattern(pattern)  # a refused pattern costs no process
    if not entries or limit <= 0:
        return []
    argv = [sys.executable, "-P", "-m", "gridwatch.agent.logsearch", f"{timeout:g}"]
    try:
        res = await run_child(argv, encode_request(pattern, limit, [e[1] for e in entries]), timeout)
    except ChildTimeout:
        raise SearchTimeout(
            f"the search ran past its {timeout:g} s deadline and was stopped; narrow the pattern or the time range"
        ) from None
    if res.returncode != 0:
        tail = res.stderr.decode(errors="replace").strip().splitlines()
        raise ValueError(clean_text(tail[-1], 300) if tail else f"the search worker failed (exit status {res.returncode})")
    try:
        found = msgspec.msgpack.decode(res.stdout, type=list[int])
    except msgspec.DecodeError:
        raise ValueError("the search worker gave an unreadable answer") from None
    return [entries[i] for i in found if 0 <= i < len(entries)]


def _main() -> int:
    timeout = float(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_TIMEOUT_S
    # A second deadline the kernel keeps, should the agent be gone before it can kill us.
    cpu = int(timeout) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY, _WORKER_MEMORY))
    req = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=_Request)
    try:
        regex = vet_pattern(req.pattern)
    except ValueError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    sys.stdout.buffer.write(msgspec.msgpack.encode(match_lines(regex, req.lines, req.limit)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
