"""Default ways to reach people and run commands: console log, webhook POST, a command argv."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from dataclasses import dataclass
from typing import Protocol

from loguru import logger

from playbooks.plans import Incident, PlannedStep


@dataclass(frozen=True)
class CommandOutcome:
    returncode: int
    output: str


class CommandRunner(Protocol):
    """Runs an argv (no shell) within ``timeout`` seconds and says how it went."""

    async def run(self, argv: list[str], timeout: float) -> CommandOutcome: ...


class SubprocessRunner:
    """Runs an argv list with a timeout, never through a shell.

    The command runs in a process group of its own. However the wait ends (its
    timeout, or the caller's: a step's deadline cancels this coroutine), the
    whole group is killed and reaped before this returns, so nothing it started
    acts after the audit says the step is over.
    """

    async def run(self, argv: list[str], timeout: float) -> CommandOutcome:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except BaseException:
            _kill_group(proc.pid)
            await asyncio.shield(proc.wait())
            raise
        return CommandOutcome(proc.returncode or 0, out.decode("utf-8", "replace")[-2000:])


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def fill(template: str, incident: Incident, step: PlannedStep, text: str) -> str:
    """Put incident facts into one argv element; each element stays one argument whatever it holds."""
    return (template.replace("{incident}", incident.id).replace("{playbook}", incident.playbook)
            .replace("{node}", incident.node).replace("{severity}", incident.severity)
            .replace("{message}", text).replace("{step}", step.step))


class DefaultNotifier:
    """console: a log line the console shows; webhook: JSON POST; command: an argv with {placeholders}."""

    def __init__(self, runner: SubprocessRunner | None = None) -> None:
        self.runner = runner or SubprocessRunner()

    async def notify(self, step: PlannedStep, incident: Incident, text: str, escalation: bool) -> str:
        if step.channel == "webhook" and step.url:
            body = json.dumps({"incident": incident.id, "playbook": incident.playbook, "node": incident.node,
                               "severity": incident.severity, "escalation": escalation, "message": text}).encode()
            status = await asyncio.to_thread(_post, step.url, body, step.timeout)
            return f"webhook answered {status}"
        if step.channel == "command" and step.command:
            argv = [fill(a, incident, step, text) for a in step.command]
            result = await self.runner.run(argv, step.timeout)
            if result.returncode != 0:
                raise RuntimeError(f"{argv[0]} exited {result.returncode}: {result.output.strip()[-200:]}")
            return f"{argv[0]} exited 0"
        logger.bind(node=incident.node).warning("{}{}", "ESCALATION: " if escalation else "", text)
        return "shown on the console"


def _post(url: str, body: bytes, timeout: float) -> int:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - the operator's own URL
        return int(response.status)
