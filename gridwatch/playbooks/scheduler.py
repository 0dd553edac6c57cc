"""Scheduler backends for drain_node and return to service: whose drain a node is under, drain it, resume it.

A backend (:class:`Slurm`, :class:`Kubernetes`) only builds argv lists and reads
their answers; :class:`SchedulerClient` runs them and hands every command, with
its argv and outcome, to a recorder (the executor audits each one). Commands are
argv lists run without a shell; a node name that is not a plain host name is
refused, because it came from the node and could pose as an option.

Whose drain it is decides what gridwatch may undo. A Slurm drain gridwatch makes
has a reason starting ``gridwatch:``; a Kubernetes cordon it makes carries the
annotation ``gridwatch/drain-reason``. A drain someone else made (an operator's
ticket note, a health check) is left as it is and never resumed by gridwatch.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gridwatch.playbooks.model import SCHEDULERS, SchedulerKind
from gridwatch.playbooks.notify import CommandOutcome, CommandRunner
from gridwatch.wire.names import node_name_refusal
from gridwatch.wire.protocol import clean_text

# What marks a drain as gridwatch's own: in a Slurm reason, what follows the fault; a Kubernetes annotation.
REASON_MARK = " (gridwatch incident "
OLD_REASON_PREFIX = "gridwatch:"  # how earlier versions began the reason: their drains are ours still
ANNOTATION = "gridwatch/drain-reason"
# Slurm keeps the reason whole, but `sinfo -R` and `kubectl describe` show one line: keep it readable.
REASON_LIMIT = 240


class DrainRefused(ValueError):
    """The command could not be built (an odd node name, an unknown scheduler); the message says why."""


class SchedulerError(RuntimeError):
    """The scheduler answered, and said no; the message says what it said."""


class ControllerUnreachable(SchedulerError):
    """The scheduler's controller (slurmctld, the API server) did not answer: worth trying again later."""


class Hold(StrEnum):
    """Whose drain a node is under, as far as the scheduler can tell."""

    NONE = "not drained"
    OURS = "drained by gridwatch"
    FOREIGN = "drained by someone else"


@dataclass(frozen=True)
class NodeHold:
    """A node as the scheduler sees it: whose drain, the scheduler's own state words and the reason on record."""

    hold: Hold
    state: str
    reason: str = ""

    def describe(self) -> str:
        return f"{self.state}, reason {self.reason!r}" if self.reason else self.state


@dataclass(frozen=True)
class Backoff:
    """How long to wait before the next try of a drain the controller did not answer: doubling, capped."""

    first: float = 2.0
    factor: float = 2.0
    cap: float = 60.0

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` failed tries in a row (1 for the first)."""
        return min(self.cap, self.first * self.factor ** max(0, failures - 1))


def drain_reason(incident: str, playbook: str, operator: str, summary: str) -> str:
    """The reason gridwatch gives the scheduler: what is wrong first (``sinfo -R`` shows 20 characters), then
    that it is ours, which incident, which playbook and who."""
    what = " ".join(clean_text(summary, 120).split()).replace("(gridwatch", "(")
    tail = f"{REASON_MARK}{incident}, playbook {playbook}, operator {operator})"
    return " ".join(clean_text(what[:max(REASON_LIMIT - len(tail), 20)] + tail, REASON_LIMIT + 80).split())


def ours(reason: str) -> bool:
    """Whether a drain reason is one :func:`drain_reason` wrote (or an earlier version did)."""
    return REASON_MARK.strip() in reason or reason.startswith(OLD_REASON_PREFIX)


def incident_of(reason: str) -> str | None:
    """The incident id inside a reason :func:`drain_reason` wrote; None for any other reason."""
    match = re.search(r"\(gridwatch incident (\S+), playbook ", reason) or re.match(
        rf"{re.escape(OLD_REASON_PREFIX)} incident (\S+) \(", reason)
    return match.group(1) if match else None


def check_node(node: str) -> str:
    """``node`` if it is a plain host name; DrainRefused otherwise."""
    refused = node_name_refusal(node)
    if refused:
        raise DrainRefused(f"refusing to act on {node[:80]!r} in the scheduler: it is {refused}")
    return node


class Backend(Protocol):
    """One scheduler's commands and how to read its answers."""

    kind: SchedulerKind
    title: str  # how the operator calls it: "Slurm"

    def read_argv(self, node: str) -> list[str]: ...

    def parse(self, node: str, output: str) -> NodeHold: ...

    def drain_argvs(self, node: str, reason: str) -> list[list[str]]: ...

    def resume_argvs(self, node: str) -> list[list[str]]: ...

    def unreachable(self, output: str) -> bool: ...


# What scontrol prints when slurmctld does not answer (slurm_strerror): connect failures and timeouts.
_SLURM_UNREACHABLE = ("unable to contact slurm controller", "socket timed out on send/recv",
                      "zero bytes were transmitted or received", "communication connection failure")
_SLURM_STATE = re.compile(r"(?:^|\s)State=(\S+)")
# scontrol prints the reason then " [user@time]"; fields (Comment=, Extra=) may follow.
_SLURM_REASON = re.compile(r"(?:^|\s)Reason=(.*?) \[[^\]\s]*@[^\]\s]*\](?:\s|$)")
_SLURM_REASON_BARE = re.compile(r"(?:^|\s)Reason=(.*)$")


class Slurm:
    """``scontrol``: read with ``show node -o``, drain with ``State=DRAIN Reason=...``, resume with ``State=RESUME``."""

    kind = SchedulerKind.SLURM
    title = "Slurm"

    def read_argv(self, node: str) -> list[str]:
        return ["scontrol", "show", "node", "-o", check_node(node)]

    def parse(self, node: str, output: str) -> NodeHold:
        line = next((ln for ln in output.splitlines() if ln.startswith(f"NodeName={node} ")), "")
        state_match = _SLURM_STATE.search(line)
        if state_match is None:
            raise SchedulerError(f"scontrol show node {node} gave no State: {output.strip()[-200:]!r}")
        state = state_match.group(1)
        reason_match = _SLURM_REASON.search(line) or _SLURM_REASON_BARE.search(line)
        reason = reason_match.group(1).strip() if reason_match else ""
        # DRAIN, DRAINING and DRAINED all show as a DRAIN flag (IDLE+DRAIN, MIXED+DRAIN, DOWN+DRAIN).
        if "DRAIN" not in state.upper():
            return NodeHold(Hold.NONE, state, reason)
        return NodeHold(Hold.OURS if ours(reason) else Hold.FOREIGN, state, reason)

    def drain_argvs(self, node: str, reason: str) -> list[list[str]]:
        return [["scontrol", "update", f"NodeName={check_node(node)}", "State=DRAIN", f"Reason={reason}"]]

    def resume_argvs(self, node: str) -> list[list[str]]:
        return [["scontrol", "update", f"NodeName={check_node(node)}", "State=RESUME"]]

    def unreachable(self, output: str) -> bool:
        low = output.lower()
        return any(words in low for words in _SLURM_UNREACHABLE)


# What kubectl prints when the API server does not answer.
_KUBE_UNREACHABLE = ("unable to connect to the server", "connection refused", "was refused", "i/o timeout",
                     "tls handshake timeout", "the server is currently unable", "no such host",
                     "context deadline exceeded")


class Kubernetes:
    """``kubectl``: read with ``get node -o json``, annotate then ``cordon``; ``uncordon`` and drop the annotation."""

    kind = SchedulerKind.KUBERNETES
    title = "Kubernetes"

    def read_argv(self, node: str) -> list[str]:
        return ["kubectl", "get", "node", check_node(node), "-o", "json"]

    def parse(self, node: str, output: str) -> NodeHold:
        try:
            data = json.loads(output)
        except ValueError:
            raise SchedulerError(f"kubectl get node {node} did not give JSON: {output.strip()[-200:]!r}") from None
        spec = data.get("spec") if isinstance(data, dict) else None
        meta = data.get("metadata") if isinstance(data, dict) else None
        cordoned = isinstance(spec, dict) and spec.get("unschedulable") is True
        notes = meta.get("annotations") if isinstance(meta, dict) else None
        ours = notes.get(ANNOTATION) if isinstance(notes, dict) else None
        if not cordoned:
            return NodeHold(Hold.NONE, "schedulable")
        if isinstance(ours, str):
            return NodeHold(Hold.OURS, "cordoned", ours)
        return NodeHold(Hold.FOREIGN, "cordoned", "")

    def drain_argvs(self, node: str, reason: str) -> list[list[str]]:
        # The annotation first: a cordon that fails after it leaves a mark only, never a cordon nobody owns.
        node = check_node(node)
        return [["kubectl", "annotate", "--overwrite", "node", node, f"{ANNOTATION}={reason}"],
                ["kubectl", "cordon", node]]

    def resume_argvs(self, node: str) -> list[list[str]]:
        node = check_node(node)
        return [["kubectl", "uncordon", node], ["kubectl", "annotate", "node", node, f"{ANNOTATION}-"]]

    def unreachable(self, output: str) -> bool:
        low = output.lower()
        return any(words in low for words in _KUBE_UNREACHABLE)


def backend_for(name: str) -> Backend | None:
    """The backend a scheduler name selects; None for ``none``. DrainRefused for a name that is not one."""
    try:
        kind = SchedulerKind(name)
    except ValueError:
        raise DrainRefused(f"unknown scheduler {name!r}; use one of {', '.join(SCHEDULERS)}") from None
    if kind is SchedulerKind.SLURM:
        return Slurm()
    if kind is SchedulerKind.KUBERNETES:
        return Kubernetes()
    return None


# Told of every command: (argv, None) before it runs, (argv, outcome) after.
Recorder = Callable[[list[str], "str | None"], None]


class SchedulerClient:
    """Runs one backend's commands through a runner, each one reported to ``record``."""

    def __init__(self, backend: Backend, runner: CommandRunner, record: Recorder, timeout: float = 30.0) -> None:
        self.backend = backend
        self.runner = runner
        self.record = record
        self.timeout = timeout

    async def hold(self, node: str) -> NodeHold:
        """Whose drain ``node`` is under; ControllerUnreachable or SchedulerError when that cannot be read."""
        argv = self.backend.read_argv(node)
        output = await self.read(argv, record=False)
        try:
            found = self.backend.parse(node, output)
        except SchedulerError as exc:
            self.record(argv, str(exc))
            raise
        self.record(argv, f"{found.hold}: {found.describe()}")
        return found

    async def drain(self, node: str, reason: str) -> str:
        """Take ``node`` out of the pool with ``reason`` unless it is drained already; the outcome, in words."""
        found = await self.hold(node)
        if found.hold is Hold.FOREIGN:
            return f"already drained by someone else ({found.describe()}); left as it is"
        if found.hold is Hold.OURS:
            return f"already drained by gridwatch ({found.describe()}); left as it is"
        for argv in self.backend.drain_argvs(node, reason):
            await self.act(argv)
        was = f"; it was {found.describe()}" if found.reason else ""
        return f"drained in {self.backend.title} with reason {reason!r}{was}"

    async def resume(self, node: str, found: NodeHold | None = None) -> tuple[NodeHold, str]:
        """Give ``node`` back to the pool if the drain is ours: what it was under, and the outcome in words.

        ``found`` is what :meth:`hold` just said, when the caller read it already.
        """
        found = found or await self.hold(node)
        if found.hold is Hold.NONE:
            return found, f"not drained in {self.backend.title} ({found.describe()}): nothing to resume"
        if found.hold is Hold.FOREIGN:
            return found, f"drained by someone else ({found.describe()}): left drained"
        for argv in self.backend.resume_argvs(node):
            await self.act(argv)
        return found, f"resumed in {self.backend.title} (was {found.describe()})"

    async def read(self, argv: list[str], record: bool = True) -> str:
        """What a command that changes nothing printed; recorded (unless the caller records what it read)."""
        result = await self._run(argv)
        if result.returncode != 0:
            error = self._error(argv, result)
            self.record(argv, str(error))
            raise error
        if record:
            self.record(argv, f"read: {_tail(result.output) or 'nothing'}")
        return result.output

    async def act(self, argv: list[str]) -> None:
        """Run a command that changes something: recorded before it runs and after."""
        self.record(argv, None)
        result = await self._run(argv)
        if result.returncode != 0:
            error = self._error(argv, result)
            self.record(argv, str(error))
            raise error
        self.record(argv, f"exit 0{': ' + _tail(result.output) if result.output.strip() else ''}")

    async def _run(self, argv: list[str]) -> CommandOutcome:
        try:
            return await self.runner.run(argv, self.timeout)
        except FileNotFoundError:
            raise SchedulerError(f"{argv[0]} is not installed here (not on PATH): install the {self.backend.title} "
                                 f"client, or set scheduler = \"none\"") from None

    def _error(self, argv: list[str], result: CommandOutcome) -> SchedulerError:
        said = _tail(result.output)
        if self.backend.unreachable(result.output):
            return ControllerUnreachable(f"{self.backend.title} controller unreachable ({argv[0]}: {said})")
        return SchedulerError(f"{argv[0]} exited {result.returncode}: {said}")


def command_text(argv: list[str]) -> str:
    """An argv as an operator would type it (quoted where needed), for the audit log."""
    return shlex.join(argv)


def _tail(output: str) -> str:
    return " ".join(clean_text(output.strip()[-200:]).split())
