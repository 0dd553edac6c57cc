"""Node sets in the hostlist syntax operators know from Slurm: ``node[001-128]:8022``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
MAX_HOSTS = 100_000  # a typo like node[1-99999999] must fail, not eat memory


class HostlistError(ValueError):
    """A node set that cannot be read; the message says where."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One agent to connect to."""

    host: str
    port: int
    # Made once: a console keys its links, their order and its store by endpoint, several lookups and a name
    # for every frame of every node, and a dataclass's own hash builds a tuple and hashes it each time.
    _text: str = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_text", f"{self.host}:{self.port}")
        object.__setattr__(self, "_hash", hash((self.host, self.port)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return self._text


def _split_top(spec: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in spec:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in {spec!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise HostlistError(f"unbalanced '[' in {spec!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_one(pattern: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", pattern)
    if not m:
        return [pattern]
    head, body, tail = pattern[: m.start()], m.group(1), pattern[m.end() :]
    values: list[str] = []
    for item in body.split(","):
        r = _RANGE.match(item.strip())
        if not r:
            raise HostlistError(f"bad range {item!r} in {pattern!r} (expected N or N-M)")
        lo, hi = r.group(1), r.group(2) or r.group(1)
        if int(hi) < int(lo):
            raise HostlistError(f"range {item!r} in {pattern!r} runs backwards")
        # Counted before any is made: many ranges in one bracket must not add up past the cap either.
        if len(values) + int(hi) - int(lo) >= MAX_HOSTS:
            raise HostlistError(f"{pattern!r} expands to more than {MAX_HOSTS} hosts")
        width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
        values.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    out: list[str] = []
    for v in values:
        out.extend(_expand_one(head + v + tail))
        if len(out) > MAX_HOSTS:
            raise HostlistError(f"{pattern!r} expands to more than {MAX_HOSTS} hosts")
    return out


def expand(spec: str) -> list[str]:
    """``"node[01-03],gpu7"`` -> ``["node01", "node02", "node03", "gpu7"]`` (order kept, no duplicates)."""
    seen: dict[str, None] = {}
    for part in _split_top(spec):
        for name in _expand_one(part):
            seen.setdefault(name, None)
        if len(seen) > MAX_HOSTS:  # parts under the cap each, many of them together
            raise HostlistError(f"{spec[:80]!r} expands to more than {MAX_HOSTS} hosts")
    if not seen:
        raise HostlistError("empty node set")
    return list(seen)


def compress(names: list[str]) -> str:
    """The inverse of :func:`expand` for display: ``node[01-03],gpu7``."""
    groups: dict[tuple[str, str, int], list[int]] = {}
    order: list[tuple[str, str, int] | str] = []
    for name in names:
        m = re.match(r"^(.*?)(\d+)(\D*)$", name)
        if not m:
            order.append(name)
            continue
        digits = m.group(2)
        key = (m.group(1), m.group(3), len(digits) if digits.startswith("0") else 0)
        if key[2] == 0 and (m.group(1), m.group(3), len(digits)) in groups:
            key = (m.group(1), m.group(3), len(digits))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(m.group(2)))
    out: list[str] = []
    for entry in order:
        if isinstance(entry, str):
            out.append(entry)
            continue
        head, tail, width = entry
        nums = sorted(set(groups[entry]))
        if len(nums) == 1:
            out.append(f"{head}{str(nums[0]).zfill(width)}{tail}")
            continue
        ranges: list[str] = []
        start = prev = nums[0]
        closing: list[int | None] = [*nums[1:], None]  # None closes the last range
        for n in closing:
            if n is not None and n == prev + 1:
                prev = n
                continue
            a, b = str(start).zfill(width), str(prev).zfill(width)
            ranges.append(a if start == prev else f"{a}-{b}")
            if n is not None:
                start = prev = n
        out.append(f"{head}[{','.join(ranges)}]{tail}")
    return ",".join(out)


def parse_endpoints(spec: str, default_port: int = 8022) -> list[Endpoint]:
    """``"node[01-16]:8022,10.0.0.5:9000"`` -> endpoints. A port applies to its own term."""
    endpoints: list[Endpoint] = []
    seen: set[tuple[str, int]] = set()
    for term in _split_top(spec):
        ports = [default_port]
        m = re.match(r"^(.*):(\d+|\[[\d,\-]+\])$", term)
        if m:
            term = m.group(1)
            # "9000" or a bracketed range "[9000-9003]": expand with a dummy prefix.
            ports = [int(p[1:]) for p in _expand_one("p" + m.group(2))]
            for port in ports:
                if not 0 < port < 65536:
                    raise HostlistError(f"port {port} out of range in {spec!r}")
        for host in expand(term):
            for port in ports:
                if (host, port) not in seen:
                    seen.add((host, port))
                    endpoints.append(Endpoint(host, port))
    if not endpoints:
        raise HostlistError("empty node set")
    return endpoints
