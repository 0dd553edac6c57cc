"""Stand-ins for what the playbook executor acts through: the agents' action sink, the command runner, the notifier."""

from __future__ import annotations

import asyncio
from typing import Any

from gridwatch.playbooks.notify import CommandOutcome
from gridwatch.wire.protocol import ActionResult


class FakeSink:
    """Records what would have been sent to agents; can fail or hang for chosen actions."""

    def __init__(self, fail: set[str] | None = None, hang: set[str] | None = None) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.fail = fail or set()
        self.hang = hang or set()

    async def act(self, node: str, action: str, args: dict[str, Any], reason: str) -> ActionResult:
        self.calls.append((node, action, args))
        if action in self.hang:
            await asyncio.Event().wait()
        return ActionResult(node=node, id="x", action=action, ok=action not in self.fail,
                            message="refused" if action in self.fail else "done")


class FakeRunner:
    """Answers ``scontrol show node`` with an idle node and records every other command (the scheduler's
    own behaviour is tested against a real Slurm in test_scheduler_slurm.py)."""

    def __init__(self) -> None:
        self.argvs: list[list[str]] = []

    async def run(self, argv: list[str], timeout: float) -> CommandOutcome:
        if argv[:3] == ["scontrol", "show", "node"]:
            return CommandOutcome(0, f"NodeName={argv[-1]} Arch=x86_64 State=IDLE ThreadsPerCore=1\n")
        self.argvs.append(argv)
        return CommandOutcome(0, "")


class FakeNotifier:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bool]] = []

    async def notify(self, step: Any, incident: Any, text: str, escalation: bool) -> str:
        self.sent.append((text, escalation))
        return "sent"
