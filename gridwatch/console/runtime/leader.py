"""Which of several consoles acts: an etcd lease on one key, its fencing token, and the step outcomes it publishes.

Consoles campaign on ``/gridwatch/<cluster>/leader`` with a lease (``ttl``
seconds, renewed every ``ttl/3``); the one whose put created the key leads, and
its fencing token is the key's ``mod_revision`` (the revision its put made; a
later leader's is always higher, so agents can refuse an older one). The leader publishes each step's
state under ``/gridwatch/<cluster>/steps/<incident>/<index>``; observers read
that prefix to show the leader's outcomes, and a console that takes over starts
from it (an agent answers a repeated step key with its first outcome, so a step
that was under way when the leader died is not done twice).

A leader whose lease cannot be renewed steps down when the lease would have
lapsed: it never acts on a lease it cannot prove. Talks to etcd's v3 JSON
gateway (``POST /v3/...``, keys base64) with the standard library only.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from loguru import logger

if TYPE_CHECKING:
    from gridwatch.console.runtime.core import ConsoleRuntime
    from gridwatch.console.runtime.wiring import RuntimeOptions

# Lease length; renewed every third of it, so one missed renewal does not cost the lead.
DEFAULT_TTL = 5.0
# One HTTP call to etcd may take this long before it counts as unreachable.
REQUEST_TIMEOUT = 2.0
# A leader key on a lease granted longer than this (and than 3 TTLs) was not put there by a console.
SUSPECT_LEASE_S = 60


class EtcdError(RuntimeError):
    """etcd did not answer or refused; the message says which endpoint and why."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode(errors="replace")


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that makes a range cover every key starting with ``prefix`` (etcd's rule)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


@dataclass(slots=True)
class KeyValue:
    key: str
    value: str
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class EtcdAccess:
    """How a console proves itself to etcd: a user and password (etcd's auth), client TLS, or both."""

    user: str = ""
    password: str = ""
    ca: str | None = None  # the CA that signed etcd's server certificate (https URLs)
    cert: str | None = None  # this console's client certificate and its key (etcd's --client-cert-auth)
    key: str | None = None

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for https endpoints; None when nothing but the system's CAs is needed."""
        if self.ca is None and self.cert is None:
            return None
        context = ssl.create_default_context(cafile=self.ca)
        if self.cert is not None:
            context.load_cert_chain(self.cert, self.key)
        return context


# etcd's answer when a request carries no token, or one it no longer knows (a restart, a TTL): log in again.
_AUTH_EXPIRED = ("invalid auth token", "user name is empty", "permission denied", "auth: revision")


class EtcdClient:
    """The few calls of etcd's v3 JSON gateway an election needs; each blocks, so callers run it in a thread."""

    def __init__(self, endpoints: list[str], timeout: float = REQUEST_TIMEOUT, access: EtcdAccess | None = None) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout = timeout
        self.access = access or EtcdAccess()
        self._context = self.access.ssl_context()
        self._token = ""  # etcd's auth token, from /v3/auth/authenticate when a user is configured
        self._good = 0  # the endpoint that answered last is asked first

    def _authenticate(self, endpoint: str) -> None:
        data = self._post(endpoint, "auth/authenticate", {"name": self.access.user, "password": self.access.password},
                          authorized=False)
        token = data.get("token")
        if not isinstance(token, str) or not token:
            raise EtcdError(f"etcd at {endpoint} gave no auth token for user {self.access.user!r}")
        self._token = token

    def _post(self, endpoint: str, path: str, body: dict[str, Any], authorized: bool = True) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if authorized and self._token:
            headers["Authorization"] = self._token
        request = urllib.request.Request(f"{endpoint}/v3/{path}", data=json.dumps(body).encode(), headers=headers,
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout,  # noqa: S310 - http(s) only
                                        context=self._context) as reply:
                data = json.loads(reply.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace")
            raise EtcdError(f"etcd at {endpoint} refused {path}: HTTP {exc.code} {detail}") from None
        if isinstance(data, dict) and "error" in data and "result" not in data:
            raise EtcdError(f"etcd at {endpoint} refused {path}: {data.get('message') or data['error']}")
        return data if isinstance(data, dict) else {}

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first endpoint that answers; EtcdError when none does."""
        errors = []
        order = self.endpoints[self._good:] + self.endpoints[:self._good]
        for endpoint in order:
            try:
                if self.access.user and not self._token:
                    self._authenticate(endpoint)
                try:
                    data = self._post(endpoint, path, body)
                except EtcdError as exc:
                    if not self.access.user or not any(m in str(exc) for m in _AUTH_EXPIRED):
                        raise
                    self._authenticate(endpoint)  # the token lapsed: once more, logged in again
                    data = self._post(endpoint, path, body)
            except (OSError, ValueError) as exc:
                errors.append(f"{endpoint}: {getattr(exc, 'reason', None) or exc}")
                continue
            self._good = self.endpoints.index(endpoint)
            return data
        raise EtcdError(f"etcd unreachable ({'; '.join(errors)})")

    def grant(self, ttl: float) -> int:
        """A new lease of ``ttl`` seconds (rounded up); its id."""
        return int(self.call("lease/grant", {"TTL": max(int(ttl + 0.999), 1)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; the seconds it has left (0: it lapsed, etcd forgot it)."""
        data = self.call("lease/keepalive", {"ID": lease})
        return int(data.get("result", data).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        self.call("lease/revoke", {"ID": lease})

    def create(self, key: str, value: str, lease: int) -> tuple[bool, int]:
        """Put ``key`` only if it does not exist; (created, the revision of the store then)."""
        data = self.call("kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease}}],
        })
        return bool(data.get("succeeded")), int(data.get("header", {}).get("revision", 0))

    def replace(self, key: str, mod_revision: int, value: str, lease: int) -> tuple[bool, int]:
        """Put ``key`` (on ``lease``) only if it is still as it was at ``mod_revision`` (a takeover); as ``create``.

        One put, not a delete and a put: etcd refuses a transaction that names a key twice.
        """
        data = self.call("kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": mod_revision}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease}}],
        })
        return bool(data.get("succeeded")), int(data.get("header", {}).get("revision", 0))

    def put_if(self, guard: str, mod_revision: int, key: str, value: str) -> bool:
        """Put ``key`` only while ``guard`` is still as it was at ``mod_revision`` (the leader key as this
        console won it); whether it was put."""
        data = self.call("kv/txn", {
            "compare": [{"key": _b64(guard), "result": "EQUAL", "target": "MOD", "mod_revision": mod_revision}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
        })
        return bool(data.get("succeeded"))

    def lease_granted(self, lease: int) -> int:
        """The TTL ``lease`` was granted with, in seconds (-1: etcd no longer knows it)."""
        data = self.call("lease/timetolive", {"ID": lease})
        if int(data.get("TTL", -1)) < 0:
            return -1
        return int(data.get("grantedTTL", 0))

    def put(self, key: str, value: str, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        self.call("kv/put", body)

    def get(self, key: str, prefix: bool = False) -> list[KeyValue]:
        body: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            body["range_end"] = prefix_end(key)
        kvs = self.call("kv/range", body).get("kvs", [])
        return [KeyValue(key=_unb64(kv["key"]), value=_unb64(kv.get("value", "")),
                         create_revision=int(kv.get("create_revision", 0)), mod_revision=int(kv.get("mod_revision", 0)),
                         lease=int(kv.get("lease", 0))) for kv in kvs]


class Role(StrEnum):
    """Where this console stands."""

    LEADER = "leader"  # holds the lease: its executor acts, with its fencing token
    OBSERVER = "observer"  # another console leads (or none can be known): the engine runs, nothing acts
    ALONE = "alone"  # no etcd configured: its own leader, as one console always was


@dataclass(slots=True)
class Standing:
    """What the election last found; ``line`` is what a headless console prints when it changes."""

    role: Role
    token: int | None = None  # the fencing token while leading
    leader: str = ""  # who leads, when known
    reason: str = ""  # why no one acts, when that is so
    suspect: bool = False  # the leader key is not one a gridwatch console wrote (no lease, or one never renewed)

    @property
    def line(self) -> str:
        if self.role is Role.LEADER:
            return f"leader (token {self.token})"
        if self.role is Role.ALONE:
            return "leader (no etcd: this console is the only one)"
        if self.suspect:
            return f"observer; no console acts: {self.reason}"
        if self.leader:
            return f"observer; {self.leader} leads"
        return f"observer; no console acts: {self.reason or 'no leader yet'}"


@dataclass(slots=True)
class StepOutcome:
    """One step as the leader published it."""

    incident: str
    index: int
    state: str
    outcome: str


class Election:
    """Campaign for (or watch) the lead of one cluster; ``run`` until cancelled.

    ``campaign=False``: watch only, until :meth:`take_over` (an interactive
    console joining a cluster that a service runs). ``on_change`` hears each
    new :class:`Standing`; ``on_lead`` is awaited each time this console becomes leader.
    """

    def __init__(self, client: EtcdClient, cluster: str, name: str, *, ttl: float = DEFAULT_TTL,
                 campaign: bool = True, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.cluster = cluster
        self.name = name
        self.ttl = ttl
        self.campaign = campaign
        self.monotonic = monotonic
        self.key = f"/gridwatch/{cluster}/leader"
        self.steps_prefix = f"/gridwatch/{cluster}/steps/"
        self.standing = Standing(Role.OBSERVER, reason="not yet asked etcd")
        self.on_change: list[Callable[[Standing], None]] = []
        self.on_lead: list[Callable[[], Any]] = []
        self._lease = 0
        self._deadline = 0.0  # monotonic time the lease lapses unless renewed
        self._seen: KeyValue | None = None  # the leader key as last read
        self._wake = asyncio.Event()
        # One step of the election at a time: a round's read of the key, taken before an operator's take-over
        # and answered after it, would otherwise set this console back to observing the leader it replaced.
        self._turn = asyncio.Lock()
        self._publishing: set[asyncio.Task[None]] = set()
        self._held: int | None = None
        # Fencing tokens of leaders this console saw hold the key with a lease of a console's length: a
        # published step outcome counts only when it carries one of them (anyone else's is ignored).
        self.tokens: deque[int] = deque(maxlen=64)
        self._judged: tuple[int, str] = (0, "")  # (the leader key's mod_revision, why it is suspect) last judged
        self._ignored_keys: set[str] = set()  # step outcome keys already warned about

    # ----------------------------------------------------------------- queries

    @property
    def leading(self) -> bool:
        """True while this console holds an unexpired lease: only then may its executor start a step."""
        return self.standing.role is Role.LEADER and self.monotonic() < self._deadline

    @property
    def token(self) -> int | None:
        return self.standing.token if self.standing.role is Role.LEADER else None

    @property
    def fence(self) -> int | None:
        """The newest token this console has held: what its requests carry, even after it stepped down."""
        return self._held

    # ----------------------------------------------------------------- running

    async def run(self) -> None:
        try:
            while True:
                async with self._turn:
                    await self._round()
                self._wake.clear()
                wait = self.ttl / 3
                if self.standing.role is Role.LEADER:
                    wait = min(wait, max(self._deadline - self.monotonic(), 0.01))  # step down on time
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except TimeoutError:
                    pass
        finally:
            await self._resign()

    async def take_over(self) -> None:
        """The operator takes the lead from whoever holds it (the confirmation and the audit are the caller's)."""
        self.campaign = True
        async with self._turn:
            current = self._seen
            if self.standing.role is Role.LEADER:
                return
            lease = await self._ensure_lease()
            if current is None:
                won, revision = await asyncio.to_thread(self.client.create, self.key, self.name, lease)
            else:
                won, revision = await asyncio.to_thread(self.client.replace, self.key, current.mod_revision,
                                                        self.name, lease)
            if won:
                await self._lead(revision)
        self._wake.set()

    async def _ensure_lease(self) -> int:
        if not self._lease:
            asked = self.monotonic()
            self._lease = await asyncio.to_thread(self.client.grant, self.ttl)
            self._deadline = asked + self.ttl
        return self._lease

    async def _round(self) -> None:
        now = self.monotonic()
        if self.standing.role is Role.LEADER and now >= self._deadline:
            # Checked before asking etcd: a console paused past its lease must not act on it.
            self._lease = 0
            self._set(Standing(Role.OBSERVER, reason="this console's lease lapsed"))
        try:
            if self.standing.role is Role.LEADER:
                await self._renew()
            elif self.campaign:
                await self._try_lead()
            else:
                await self._look()
        except EtcdError as exc:
            if self.standing.role is Role.LEADER and self.monotonic() < self._deadline:
                logger.warning("cannot renew the lead ({}); stepping down in {:.1f} s unless etcd answers",
                               exc, self._deadline - self.monotonic())
                return
            self._lease = 0
            self._set(Standing(Role.OBSERVER, reason=str(exc)))

    async def _renew(self) -> None:
        asked = self.monotonic()
        left = await asyncio.to_thread(self.client.keepalive, self._lease)
        mine = await asyncio.to_thread(self.client.get, self.key)
        # The key as this console put it: a takeover's put moves its mod_revision past our token.
        if left <= 0 or not mine or mine[0].mod_revision != self.standing.token:
            self._lease = 0
            self._seen = mine[0] if mine else None
            who = mine[0].value if mine else ""
            self._set(Standing(Role.OBSERVER, leader=who, reason="this console's lease lapsed"))
            return
        self._deadline = asked + min(left, self.ttl)

    async def _try_lead(self) -> None:
        lease = await self._ensure_lease()
        if self.monotonic() >= self._deadline:
            self._lease = 0  # an old lease, unrenewed: etcd may have dropped it
            lease = await self._ensure_lease()
        won, revision = await asyncio.to_thread(self.client.create, self.key, self.name, lease)
        if won:
            await self._lead(revision)
            return
        # Not ours: keep the lease alive for the next try, and say who leads.
        asked = self.monotonic()
        left = await asyncio.to_thread(self.client.keepalive, lease)
        if left > 0:
            self._deadline = asked + min(left, self.ttl)
        else:
            self._lease = 0
        await self._look()

    async def _look(self) -> None:
        found = await asyncio.to_thread(self.client.get, self.key)
        self._seen = found[0] if found else None
        if self._seen is None:
            why = "no console leads" + ("" if self.campaign else "; take over to act from this one")
            self._set(Standing(Role.OBSERVER, reason=why))
            return
        why = await self._suspect(self._seen)
        if why:
            self._set(Standing(Role.OBSERVER, leader=self._seen.value, reason=why, suspect=True))
        else:
            if self._seen.mod_revision not in self.tokens:
                self.tokens.append(self._seen.mod_revision)
            self._set(Standing(Role.OBSERVER, leader=self._seen.value))

    async def _suspect(self, seen: KeyValue) -> str:
        """Why the leader key is not a console's lead ("" when it is one): a console always puts it on a
        lease of its ``ttl``, renewed; a key with no lease, or one granted for far longer, stops every
        console from acting for as long as it stays, so it is said, not obeyed in silence."""
        if self._judged[0] == seen.mod_revision:
            return self._judged[1]
        why = ""
        fix = f"delete it (etcdctl del {self.key}) or take over"
        if seen.lease == 0:
            why = f"the leader key {self.key} ({seen.value!r}) has no lease: no gridwatch console wrote it; {fix}"
        else:
            granted = await asyncio.to_thread(self.client.lease_granted, seen.lease)
            if granted > max(3 * self.ttl, SUSPECT_LEASE_S):
                why = (f"the leader key {self.key} ({seen.value!r}) is on a lease of {granted} s, longer than a "
                       f"console takes: it may never be renewed; {fix}")
        if why:
            logger.error("etcd: {}", why)
        self._judged = (seen.mod_revision, why)
        return why

    async def _lead(self, revision: int) -> None:
        self._seen = KeyValue(self.key, self.name, revision, revision, self._lease)
        self._held = revision
        self.tokens.append(revision)
        self._set(Standing(Role.LEADER, token=revision, leader=self.name))
        for call in self.on_lead:
            result = call()
            if asyncio.iscoroutine(result):
                await result

    async def _resign(self) -> None:
        """Stopping: give the lead up at once so a standby need not wait for the lease to lapse."""
        if self.standing.role is Role.LEADER:
            self._set(Standing(Role.OBSERVER, reason="this console stopped"))
        if self._lease:
            lease, self._lease = self._lease, 0
            try:
                await asyncio.wait_for(asyncio.to_thread(self.client.revoke, lease), self.client.timeout)
            except (EtcdError, TimeoutError):
                pass  # it lapses on its own

    def _set(self, standing: Standing) -> None:
        if standing == self.standing:
            return
        self.standing = standing
        logger.info("etcd {}: {}", self.key, standing.line)
        for call in self.on_change:
            call(standing)

    # -------------------------------------------------------------- step outcomes

    def publish_step(self, incident: str, index: int, state: str, outcome: str) -> None:
        """The leader tells observers (and its successor) how a step went; sent in the background."""
        if self.standing.role is not Role.LEADER:
            return
        key = f"{self.steps_prefix}{incident}/{index}"
        token = self.standing.token
        value = json.dumps({"state": state, "outcome": outcome[:500], "token": token, "leader": self.name})
        task = asyncio.get_running_loop().create_task(self._put(key, value, token or 0))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _put(self, key: str, value: str, token: int) -> None:
        try:
            # Only while the leader key is still the one this console won: a deposed leader publishes nothing.
            if not await asyncio.to_thread(self.client.put_if, self.key, token, key, value):
                logger.warning("step outcome {} not published: this console no longer holds the lead", key)
        except EtcdError as exc:
            logger.warning("step outcome not published to etcd: {}", exc)

    async def flush(self) -> None:
        """Wait for the outcomes being published (before a takeover reads them back, or at a stop)."""
        if self._publishing:
            await asyncio.gather(*self._publishing, return_exceptions=True)

    async def step_outcomes(self) -> list[StepOutcome]:
        """Every step outcome the leaders published for this cluster; EtcdError when etcd cannot be read."""
        found = await asyncio.to_thread(self.client.get, self.steps_prefix, True)
        out = []
        for kv in found:
            incident, _, index = kv.key[len(self.steps_prefix):].rpartition("/")
            try:
                data = json.loads(kv.value)
                token = data.get("token")
                # A leader's own outcome: its token is one this console saw lead, and it was written after that
                # leader won the key. Anything else (a third party with write access to etcd) is not believed.
                if not isinstance(token, int) or token not in self.tokens or kv.mod_revision < token:
                    self._ignored(kv.key, f"token {token!r} is no leader's this console saw")
                    continue
                out.append(StepOutcome(incident, int(index), str(data["state"]), str(data.get("outcome", ""))))
            except (ValueError, KeyError, TypeError):
                self._ignored(kv.key, "not a step outcome")
        return out

    def _ignored(self, key: str, why: str) -> None:
        if key not in self._ignored_keys:
            self._ignored_keys.add(key)
            logger.warning("ignored a step outcome in etcd: {} ({})", key, why)


def raise_revision(client: EtcdClient, cluster: str, past: int,
                   progress: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Write ``/gridwatch/<cluster>/epoch`` until etcd's revision passes ``past``: (revision before, after).

    A fencing token is the revision of the leader key's put; etcd rebuilt empty starts again from 1, below
    the newest token the agents keep, so they refuse every new leader. Each put raises the revision by one
    (one request each: a transaction may not name a key twice), so this takes ``past`` requests at most.
    A live etcd's revision is past every token it ever gave, so there this writes nothing.
    """
    key = f"/gridwatch/{cluster}/epoch"
    before = after = int(client.call("kv/range", {"key": _b64(key)}).get("header", {}).get("revision", 0))
    while after <= past:
        data = client.call("kv/put", {"key": _b64(key), "value": _b64(str(after))})
        after = int(data.get("header", {}).get("revision", after + 1))
        if progress is not None and (after % 1000 == 0 or after > past):
            progress(after)
    return before, after


# ------------------------------------------------------------------ the runtime's side


def cluster_name(endpoints: list[Any]) -> str:
    """A name the consoles of one node list agree on without being told one."""
    text = ",".join(sorted(str(e) for e in endpoints))
    return "nodes-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def attach_election(runtime: ConsoleRuntime, options: RuntimeOptions) -> Election:
    """``runtime`` campaigns for (or watches) its cluster's lead in etcd; its executor starts steps only while leading."""
    client = EtcdClient(options.etcd, access=options.etcd_access)
    name = f"{options.operator}@{socket.gethostname()}:{os.getpid()}"
    # Named by every node it watches, direct or through a relay: consoles of one cluster share one name.
    nodes = [*options.endpoints, *(n for carried in options.relays.values() for n in carried)]
    election = Election(client, options.cluster or cluster_name(nodes), name, ttl=options.lease_ttl,
                        campaign=options.campaign and not options.read_only)
    runtime.election = election
    from gridwatch.playbooks.executor import Executor

    executor = runtime.executor
    if isinstance(executor, Executor):
        executor.gate = lambda: None if election.leading else f"this console does not lead ({election.standing.line})"
        executor.on_step.append(lambda step, state, outcome: election.publish_step(
            step.incident, step.index, state, outcome))
    said: list[str] = []

    def changed(standing: Standing) -> None:
        # Observers say why no one acts; the alert is cleared only if it is still the one raised here.
        line = (f"no console acts: {standing.reason}"
                if standing.role is Role.OBSERVER and (standing.suspect or not standing.leader) else None)
        if line is not None or (said and runtime.alert == said[-1]):
            runtime.set_alert(line)
        said[:] = [line] if line else []

    election.on_change.append(changed)
    election.on_lead.append(lambda: take_lead(runtime, election))
    return election


async def sync_steps(runtime: ConsoleRuntime, election: Election) -> int:
    """Copy the leader's step outcomes into this console's incident store; how many steps changed."""
    store = runtime.plan_store
    if store is None:
        return 0
    changed = 0
    for found in await election.step_outcomes():
        step_id = f"{found.incident}/{found.index}"
        record = store.step(step_id)
        # "running" stays planned here: whoever leads next sends it again under its key, and the agent
        # answers with the first outcome if it was done.
        if record is None or found.state == "running" or (record.state, record.outcome) == (found.state, found.outcome):
            continue
        store.set_step(step_id, found.state, found.outcome)
        if runtime.engine is not None:  # the leader's outcome counts here too: a removal done, failed or skipped
            runtime.engine.step_finished(record.planned, found.state, found.outcome)
        runtime.settle(found.incident)
        changed += 1
    return changed


def observer_refusal(election: Election | None) -> str | None:
    """Why this console may not act on a node now (one line), or None when it leads or is alone.

    An observer acts on nothing, an operator's own node actions included, until it
    takes over: a request it sent with an older token would be refused by the agents anyway.
    """
    if election is None or election.leading:
        return None
    standing = election.standing
    if standing.role is Role.LEADER:  # lapsed, and the election has not run since (a paused process)
        return "observer: this console's lease lapsed; take over to act"
    if standing.leader and standing.leader != election.name:
        return f"observer: {standing.leader} leads; take over to act"
    return f"observer: no console acts ({standing.reason or 'no leader yet'}); take over to act"


async def take_over(runtime: ConsoleRuntime, why: str, who: str | None = None) -> str:
    """The operator takes the lead for this console, audited before and after; the outcome in one line.

    The audit says who, why, whom the lead was taken from and the new fencing token.
    """
    election = runtime.election
    if election is None:
        return "nothing to take over: this console has no etcd and leads alone"
    if election.leading:
        return f"this console leads already ({election.standing.line})"
    who = who or runtime.operator
    old = election.standing.leader or "no console"
    what = f"take over the lead of {election.cluster} from {old}"
    runtime.audit(who, what, why, "before", "")
    try:
        await election.take_over()
    except EtcdError as exc:
        outcome = f"failed: {exc}"
    else:
        if election.leading:
            outcome = f"done: leader (token {election.token}), taken from {old}"
        else:
            outcome = f"failed: {election.standing.leader or 'another console'} took the lead first"
    runtime.audit(who, what, why, "after", outcome)
    logger.info("{} by {}: {} ({})", what, who, outcome, why)
    return f"take over: {outcome}"


async def take_lead(runtime: ConsoleRuntime, election: Election) -> None:
    """Just won the lead: start from what the last leader published, then finish every open plan."""
    try:
        await sync_steps(runtime, election)
    except EtcdError as exc:
        logger.warning("taking the lead without the last leader's step outcomes: {}", exc)
    runtime.resume_plans()


async def follow(runtime: ConsoleRuntime, election: Election) -> None:
    """The runtime's election, and while observing, the leader's outcomes copied in every ``ttl/3``."""
    runner = asyncio.get_running_loop().create_task(election.run())
    try:
        while not runner.done():
            if not election.leading:
                try:
                    await sync_steps(runtime, election)
                except EtcdError:
                    pass  # the standing says etcd is unreachable
            await asyncio.wait({runner}, timeout=election.ttl / 3)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await election.flush()
