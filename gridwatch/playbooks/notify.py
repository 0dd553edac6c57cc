"""Default ways to reach people and run commands: console log, webhook POST, a command argv, Alertmanager."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

from loguru import logger

from gridwatch.playbooks.clock import Clock, SystemClock
from gridwatch.playbooks.plans import Incident, PlannedStep
from gridwatch.wire.protocol import clean_text


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
    """console: a log line the console shows; webhook: JSON POST; command: an argv with {placeholders}.

    With an :class:`Alertmanager` attached, every notification also becomes (or
    updates) that incident's alert there, whatever the step's channel.
    """

    def __init__(self, runner: SubprocessRunner | None = None, alertmanager: Alertmanager | None = None) -> None:
        self.runner = runner or SubprocessRunner()
        self.alertmanager = alertmanager

    async def notify(self, step: PlannedStep, incident: Incident, text: str, escalation: bool) -> str:
        outcome = await self._channel(step, incident, text, escalation)
        if self.alertmanager is not None:
            # Queued, not awaited: an unreachable Alertmanager never holds up the plan.
            self.alertmanager.fire(incident, text, escalation)
            outcome += "; queued for Alertmanager"
        return outcome

    async def _channel(self, step: PlannedStep, incident: Incident, text: str, escalation: bool) -> str:
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


# ------------------------------------------------------------------ Alertmanager

# Prometheus re-sends firing alerts every minute (its resend_delay) and gives each an
# endsAt four of those ahead, so an alert whose sender died resolves by itself.
ALERT_RESEND_S = 60.0
ALERT_HOLD_RESENDS = 4
ALERT_RETRY_S = 5.0  # an unreachable Alertmanager is tried again this often
ALERT_QUEUE_MAX = 1000  # alerts kept for Alertmanager; past this the oldest are dropped, counted
ALERT_BATCH = 200  # alerts per POST


class AlertState(StrEnum):
    FIRING = "firing"
    RESOLVED = "resolved"


class AlertmanagerHealth(StrEnum):
    UNKNOWN = "unknown"  # nothing sent yet
    OK = "ok"
    FAILING = "failing"


@dataclass(slots=True)
class Alert:
    """One incident as Alertmanager knows it; its labels never change, so its notifications stay one alert."""

    incident: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float
    state: AlertState = AlertState.FIRING
    ends_at: float | None = None  # when it was resolved
    sent_at: float | None = None  # when Alertmanager last took it

    def postable(self, now: float) -> dict[str, Any]:
        """The v2 API's PostableAlert: a firing alert holds for a few re-sends, a resolved one ends when it did."""
        ends = self.ends_at if self.ends_at is not None else now + ALERT_RESEND_S * ALERT_HOLD_RESENDS
        return {"labels": self.labels, "annotations": self.annotations, "startsAt": _rfc3339(self.starts_at),
                "endsAt": _rfc3339(ends)}


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def check_alertmanager_url(url: str) -> str:
    """``url`` without a trailing slash; ValueError in one sentence when it is not an http(s) address."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"{url!r} is not an Alertmanager address: write it as http://HOST:9093")
    return url.strip().rstrip("/")


PostAlerts = Callable[[str, bytes, float], int]


@dataclass(slots=True)
class AlertmanagerStatus:
    """What the status line says about paging: how it goes, how much waits, how much was lost."""

    health: AlertmanagerHealth = AlertmanagerHealth.UNKNOWN
    queued: int = 0
    failures: int = 0  # POSTs that did not reach Alertmanager
    dropped: int = 0  # alerts dropped because the queue was full
    last_error: str = ""
    sent: int = 0  # alerts Alertmanager accepted (re-sends included)


@dataclass
class Alertmanager:
    """Incidents as alerts in Alertmanager's v2 API (POST /api/v2/alerts), sent from a task of its own.

    :meth:`fire` and :meth:`resolve` only queue; the sender posts what is due,
    re-sends firing alerts every ``resend_every`` seconds of ``clock`` time (so
    Alertmanager does not resolve them by itself), and keeps everything it could
    not deliver for the next try.
    """

    url: str
    clock: Clock = field(default_factory=SystemClock)
    labels: dict[str, str] = field(default_factory=dict)  # added to every alert, e.g. {"cluster": "a100-east"}
    resend_every: float = ALERT_RESEND_S
    retry_every: float = ALERT_RETRY_S
    timeout: float = 5.0
    queue_max: int = ALERT_QUEUE_MAX
    poll_s: float = 1.0  # how often the sender looks at the clock for re-sends and retries
    post: PostAlerts | None = None  # the HTTP POST (url, body, timeout) -> status; urllib unless a test swaps it
    on_trouble: Callable[[str | None], None] | None = None  # one line when delivery starts or stops failing
    background: bool = True  # a sender task of its own; False: the caller calls flush() (replay, unit tests)
    status: AlertmanagerStatus = field(default_factory=AlertmanagerStatus)

    def __post_init__(self) -> None:
        self.url = check_alertmanager_url(self.url)
        self._alerts: dict[str, Alert] = {}  # incident id -> its alert, oldest first
        self._dirty: set[str] = set()  # changed since last sent: sent at the next chance
        self._retry_at = 0.0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._sending = asyncio.Lock()  # one POST at a time, so re-sends and retries never overtake each other

    # ------------------------------------------------------------ what is told

    def fire(self, incident: Incident, text: str, escalation: bool = False) -> None:
        """The incident's alert fires (again) with ``text`` as its summary; never blocks, never raises."""
        summary = clean_text(text, 500)
        description = clean_text(f"{incident.summary or incident.kind} on {incident.node} "
                                 f"(playbook {incident.playbook}, incident {incident.id})", 1000)
        alert = self._alerts.pop(incident.id, None)
        if alert is None:
            labels = {**self.labels, "alertname": clean_text(incident.playbook or incident.kind, 200),
                      "node": clean_text(incident.node, 200), "severity": clean_text(incident.severity, 50),
                      "incident": clean_text(incident.id, 200)}
            if incident.job:
                labels["job"] = clean_text(incident.job, 200)
            alert = Alert(incident.id, labels, {}, incident.opened_at or self.clock.now())
        alert.annotations = {"summary": summary, "description": description}
        if escalation:
            alert.annotations["escalation"] = "needs a human"
        alert.state, alert.ends_at = AlertState.FIRING, None
        self._keep(alert)

    def resolve(self, incident_id: str) -> None:
        """The incident recovered or was resolved: its alert is sent once more, ended now; unknown ids are ignored."""
        alert = self._alerts.pop(incident_id, None)
        if alert is None:
            return
        alert.state, alert.ends_at = AlertState.RESOLVED, self.clock.now()
        self._keep(alert)

    def _keep(self, alert: Alert) -> None:
        self._alerts[alert.incident] = alert
        self._dirty.add(alert.incident)
        while len(self._alerts) > self.queue_max:
            oldest = next(iter(self._alerts))
            del self._alerts[oldest]
            self._dirty.discard(oldest)
            self.status.dropped += 1
            logger.warning("Alertmanager queue full ({} alerts): dropped the alert of {}", self.queue_max, oldest)
        self.status.queued = len(self._dirty)
        self._start()

    def alert(self, incident_id: str) -> Alert | None:
        return self._alerts.get(incident_id)

    # ------------------------------------------------------------ the sender

    def due(self, now: float) -> list[Alert]:
        """Alerts to post now: changed ones, and firing ones not sent for ``resend_every``; none while backing off."""
        if now < self._retry_at:
            return []
        return [a for a in self._alerts.values()
                if a.incident in self._dirty
                or (a.state is AlertState.FIRING and (a.sent_at is None or now - a.sent_at >= self.resend_every))]

    async def flush(self) -> bool:
        """Post what is due, in batches; False when Alertmanager could not be reached (all of it is kept)."""
        async with self._sending:
            return await self._flush()

    async def _flush(self) -> bool:
        now = self.clock.now()
        due = self.due(now)
        for start in range(0, len(due), ALERT_BATCH):
            batch = due[start:start + ALERT_BATCH]
            sent_as = {a.incident: a.state for a in batch}
            body = json.dumps([a.postable(now) for a in batch]).encode()
            self._dirty -= {a.incident for a in batch}
            try:
                post = self.post or _post_json
                status = await asyncio.wait_for(asyncio.to_thread(post, self.url + "/api/v2/alerts", body,
                                                                  self.timeout), self.timeout + 1.0)
                if status >= 300:
                    raise OSError(f"HTTP {status}")
            except (OSError, TimeoutError, ValueError) as exc:
                self._dirty |= {a.incident for a in batch if a.incident in self._alerts}
                self._failed(now, exc)
                return False
            for alert in batch:
                alert.sent_at = now
                # Sent as ended and not fired again meanwhile: Alertmanager has all it needs.
                if (sent_as[alert.incident] is AlertState.RESOLVED and alert.state is AlertState.RESOLVED
                        and alert.incident not in self._dirty and self._alerts.get(alert.incident) is alert):
                    del self._alerts[alert.incident]
            self.status.sent += len(batch)
            self._delivered()
        self.status.queued = len(self._dirty)
        return True

    def _failed(self, now: float, exc: BaseException) -> None:
        self._retry_at = now + self.retry_every
        self.status.failures += 1
        self.status.queued = len(self._dirty)
        self.status.last_error = f"{type(exc).__name__}: {exc}"[:200]
        if self.status.health is not AlertmanagerHealth.FAILING:
            self.status.health = AlertmanagerHealth.FAILING
            line = (f"Alertmanager at {self.url} cannot be reached ({self.status.last_error}); "
                    f"{self.status.queued} alerts kept, retried every {self.retry_every:g} s")
            logger.warning(line)
            if self.on_trouble is not None:
                self.on_trouble(line)

    def _delivered(self) -> None:
        if self.status.health is AlertmanagerHealth.FAILING:
            logger.info("Alertmanager at {} reached again after {} failed tries", self.url, self.status.failures)
            if self.on_trouble is not None:
                self.on_trouble(None)
        self.status.health = AlertmanagerHealth.OK
        self._retry_at = 0.0

    def _start(self) -> None:
        if not self.background:
            return
        if self._task is not None and not self._task.done():
            assert self._wake is not None
            self._wake.set()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop yet: the next fire() or close() sends it
        self._wake = asyncio.Event()
        self._wake.set()
        self._task = loop.create_task(self._run())

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.flush()
            except Exception:  # noqa: BLE001 - the sender keeps going; the log says why
                logger.exception("sending alerts to Alertmanager failed")

    async def close(self, wait: float = 2.0) -> None:
        """One last try (at most ``wait`` seconds) for what is queued, then stop the sender."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._dirty:
            self._retry_at = 0.0
            try:
                await asyncio.wait_for(self.flush(), wait)
            except TimeoutError:
                pass
        if self._dirty:
            logger.warning("{} alerts could not be sent to Alertmanager at {} before stopping", len(self._dirty),
                           self.url)


def _post_json(url: str, body: bytes, timeout: float) -> int:
    """POST to Alertmanager's API; its status. Alertmanager takes alerts with an empty (or JSON) body: a 2xx
    with anything else is a proxy or another server at that address, and the alerts were not delivered."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - the operator's own URL
            status, answer = int(response.status), response.read(4096).strip()
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    if answer:
        try:
            json.loads(answer)
        except ValueError:
            raise ValueError(f"answered HTTP {status} with {answer[:60]!r}, not as Alertmanager does") from None
    return status
