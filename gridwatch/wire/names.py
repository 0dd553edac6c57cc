"""Node names: the one rule every end applies to the name a node goes by (an agent's, a Prometheus label's,
the one a scheduler is told), so no name one end accepts is refused, or misread, by another."""

from __future__ import annotations

import re

# Plain ASCII, as host names are: no hostlist brackets or commas, no leading '-', no whitespace or newline.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
# Words a scheduler reads as more than one node (``scontrol update NodeName=ALL`` is every node).
RESERVED = frozenset({"all"})


def node_name_refusal(name: str) -> str:
    """Why ``name`` cannot name a node ('' when it can), in words that follow "it is"."""
    if not NODE_NAME.fullmatch(name):
        return f"{name[:80]!r}, which is not a plain node name (letters, digits, '.', '_', '-'; 253 at most)"
    if name.lower() in RESERVED:
        return f"{name!r}, which a scheduler reads as every node"
    return ""
