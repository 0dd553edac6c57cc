"""A trainer's recent events, as its control socket's status carries them: bounded, numbered, thread-safe (no torch)."""

from __future__ import annotations

import threading
import time
from collections import deque

from gridwatch.wire.protocol import Event, Text

MAX_EVENTS = 64


class EventLog:
    """The newest ``limit`` events of one trainer, oldest first.

    ``seq`` starts at the wall clock in milliseconds so that it grows across restarts of the node's
    trainer: the agent relays an event once, by its seq, whichever process wrote it.
    """

    def __init__(self, node: str, limit: int = MAX_EVENTS) -> None:
        self.node = node
        self._events: deque[Event] = deque(maxlen=limit)
        self._seq = int(time.time() * 1000)
        self._lock = threading.Lock()  # written by the loop, read by the control thread

    def add(self, kind: str, message: str, severity: str = "warning", **details: object) -> Event:
        with self._lock:
            self._seq += 1
            event = Event(
                kind=Text(kind), severity=Text(severity), message=Text(message), source=Text("trainer"),
                seq=self._seq, ts=time.time(), node=Text(self.node),
                details={Text(k): Text(str(v)) for k, v in details.items()},
            )
            self._events.append(event)
        return event

    def recent(self) -> list[Event]:
        with self._lock:
            return list(self._events)
