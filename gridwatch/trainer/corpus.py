"""The training text: a byte-level corpus built at run time from the Python standard library's sources."""

from __future__ import annotations

import sysconfig
from pathlib import Path

VOCAB_SIZE = 256  # bytes


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def build_corpus(max_bytes: int = 4 << 20, root: Path | None = None) -> bytes:
    """The first ``max_bytes`` of the stdlib's ``*.py`` files in sorted path order.

    Sorted order makes the corpus identical on every node of one installation,
    which the sampler relies on; nothing is downloaded.
    """
    root = root or stdlib_dir()
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no Python sources under {root} to build the training corpus from")
    chunks: list[bytes] = []
    total = 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]
