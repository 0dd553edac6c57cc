"""The console's side of a supervised loop in tests: the agent's trainer link to its socket, and waits on what it reads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gridwatch.agent.trainer_link import TrainerLink
from gridwatch.wire.protocol import Event, TrainerStatus
from tests.conftest import wait_until

WAIT_S = 20.0  # generous for 2 busy cores; every wait ends as soon as its condition holds


class Agent:
    """What a node's agent does with a trainer's socket: polls its status, relays its events, sends controls."""

    def __init__(self, path: str) -> None:
        self.link = TrainerLink(path, interval=0.05, timeout=5.0, grace=60.0)
        self.events: list[Event] = []

    def start(self) -> None:
        self.link.start()

    async def stop(self) -> None:
        await self.link.stop()

    async def send(self, command: str, **args: Any) -> dict[str, Any]:
        reply = await self.link.control(command, args)
        assert reply["ok"], reply
        return reply

    async def status(self, cond: Callable[[TrainerStatus], object], what: str) -> TrainerStatus:
        """The first status the agent reads for which ``cond`` holds."""
        def ready() -> TrainerStatus | None:
            self.events += self.link.take_events()
            status = self.link.status
            return status if status is not None and cond(status) else None

        found = await wait_until(ready, WAIT_S, what)
        assert isinstance(found, TrainerStatus)
        return found

    async def event(self, kind: str, words: str) -> Event:
        """The first relayed event of ``kind`` whose message says ``words``."""
        def seen() -> Event | None:
            self.events += self.link.take_events()
            return next((e for e in self.events if e.kind == kind and words in e.message), None)

        found = await wait_until(seen, WAIT_S, f"a {kind} event saying {words!r}")
        assert isinstance(found, Event)
        return found
