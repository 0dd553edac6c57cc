"""The log tailer as a source: new lines and the events detectors found in them."""

from __future__ import annotations

from gridwatch.agent.logs import LogTailer
from gridwatch.agent.sources import Reading


class LogsSource:
    """:class:`gridwatch.agent.logs.LogTailer` behind the source interface."""

    name = "logs"
    blocking = True  # a log on a network filesystem can block a read

    def __init__(self, tailer: LogTailer) -> None:
        self.tailer = tailer

    def read(self) -> Reading:
        lines, events = self.tailer.poll()
        return Reading(lines=lines, events=events)

    def close(self) -> None:
        self.tailer.close()
