"""The log store's WHERE clause for the Logs view's pattern: which rows the trigram index narrows to, and the exact check.

A pattern is a case-insensitive regular expression searched in a line and its source. A plain
string (three characters or more, no regular-expression character) is looked up in the trigram
index as all of its trigrams, then checked in the row; a regular expression is run over the rows,
after the index has narrowed them to those holding the literal text every match must contain
(``step 1`` in ``rank\\d+\\]: step 1``), when it has three characters or more of it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

FTS_MIN = 3  # the trigram index finds substrings of three characters or more
FTS_GRAMS = 12  # trigrams of a long string asked of the index at most
REGEX_CHARS = frozenset(".^$*+?{}[]\\|()")

# The standard library's own parser of regular expressions: the literal runs are read from the parse,
# never guessed from the text. Private in 3.11 (the public sre_parse name warns), hence the lookup.
_parser: Any = importlib.import_module("re._parser")


class PatternError(ValueError):
    """The pattern is not a regular expression; the message says why in one line."""


def pattern_clause(pattern: str, narrow_regex: bool = True) -> tuple[str, list[str]]:
    """The WHERE clause for ``pattern`` (``{f}``: the partition's index) and its parameters; PatternError when bad.

    ``narrow_regex``: let the index narrow a regular expression too. The index answers for a whole day at once,
    so within a short window reading the window's rows in time order costs less: the store asks it then only
    for a query over whole days.
    """
    if len(pattern) >= FTS_MIN and not REGEX_CHARS.intersection(pattern):
        # Each trigram one FTS5 string, its quotes doubled: whatever the operator typed, the engine reads text.
        # An index without positions cannot say the trigrams are side by side: the string is checked in the row.
        narrow = "AND id IN (SELECT rowid FROM {f} WHERE {f} MATCH ?) "
        if pattern.isascii():
            # SQLite's lower() folds ASCII only, which is all an ASCII string needs; built in, no call into Python.
            folded = pattern.lower()
            return narrow + "AND (instr(lower(line), ?) OR instr(lower(source), ?))", [trigram_query(pattern), folded,
                                                                                        folded]
        return narrow + "AND gw_search(?, line, source)", [trigram_query(pattern), re.escape(pattern)]
    try:
        re.compile(pattern, re.IGNORECASE)
        parsed = _parser.parse(pattern, re.IGNORECASE)
    except re.error as exc:
        raise PatternError(f"bad regular expression: {exc}") from None
    runs = [run for run in _literal_runs(parsed) if len(run) >= FTS_MIN] if narrow_regex else []
    if not runs:
        return "AND gw_search(?, line, source)", [pattern]
    # Every match holds these runs of text: only rows whose trigrams include theirs can match.
    query = " AND ".join(trigram_query(run) for run in sorted(runs, key=len, reverse=True)[:2])
    return "AND id IN (SELECT rowid FROM {f} WHERE {f} MATCH ?) AND gw_search(?, line, source)", [query, pattern]


def trigram_query(text: str) -> str:
    """An FTS5 query for the rows holding every trigram of ``text`` (at most FTS_GRAMS, spread over it)."""
    grams = list(dict.fromkeys(text[i:i + FTS_MIN].lower() for i in range(len(text) - FTS_MIN + 1)))
    if len(grams) > FTS_GRAMS:  # which are rarest is not known; evenly spread ones narrow as well, and the check is exact
        grams = [grams[round(i * (len(grams) - 1) / (FTS_GRAMS - 1))] for i in range(FTS_GRAMS)]
    return " AND ".join('"' + g.replace('"', '""') + '"' for g in grams)


def _literal_runs(parsed: Any) -> list[str]:
    """The runs of literal characters at the pattern's top level: text that every match contains, in that order.

    Anything else (a class, a group, a repeat, an alternative, an anchor) ends a run; a pattern that is one
    alternative at its top (``a|b``) has none.
    """
    runs, run = [], []
    for op, arg in parsed:
        if op is _parser.LITERAL:
            run.append(chr(arg))
            continue
        runs.append("".join(run))
        run = []
    runs.append("".join(run))
    return [r for r in runs if r]


def searcher() -> Callable[[str, str, str], bool]:
    """The ``gw_search(pattern, line, source)`` SQL function: the pattern, case-insensitive, in the line or the source."""
    compiled: dict[str, re.Pattern[str]] = {}

    def search(pattern: str, line: str, source: str) -> bool:
        regex = compiled.get(pattern)
        if regex is None:
            regex = compiled[pattern] = re.compile(pattern, re.IGNORECASE)
        return bool(regex.search(line) or regex.search(source))

    return search
