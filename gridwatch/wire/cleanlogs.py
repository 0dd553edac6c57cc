"""Log lines a process writes, cleaned of escapes: a log message may quote what a peer said."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loguru import Record


def clean_logs() -> None:
    """Every log line this process writes is cleaned of escapes: log messages may quote what a peer said."""
    from loguru import logger

    from gridwatch.wire.protocol import clean_text

    def patch(record: Record) -> None:
        record["message"] = clean_text(record["message"])

    logger.configure(patcher=patch)
