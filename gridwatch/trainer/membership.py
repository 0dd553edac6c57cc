"""Who trains in which generation: decided in one place, beside the store, on no training node.

torchrun supervises each node's worker (it restarts one that dies); which
workers form the job is decided here, as TorchFT's lighthouse does it. A
change of members is a new *generation*: the survivors keep their processes,
their model in memory and their data loader, and only build a new process
group. That takes a fraction of a second where re-forming through torchrun
(every worker killed, torch imported again, the state read back from disk)
takes ten, and it lets a repaired node join a running job.

Keys in the store (the coordinator writes ``gw/gen*``, workers the rest):

- ``gw/reg/<i>`` (``gw/nreg`` counts them): node names, one per worker start.
- ``gw/hb/<node>``: ``"<incarnation> <counter> <state>"``, rewritten every
  ``HEARTBEAT_S`` (the incarnation is new in every process);
  state is ``join``, ``member G``, ``failed G`` (a collective of generation G
  failed), ``leave G`` (asked to leave at an agreed step) or ``done``.
- ``gw/gen``: the newest generation number; ``gw/gen/<G>``: its members and how
  they line up their state (``restore`` the newest checkpoint, ``share`` rank
  0's memory, or ``none``: every member is already at the same step).

This module does not import torch: the store is anything with ``add``,
``set``, ``get`` and ``check`` (a ``torch.distributed.TCPStore`` is).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
from loguru import logger

HEARTBEAT_S = 0.25
GEN_KEY = "gw/gen"
STORE_ENV = "GRIDWATCH_STORE"  # HOST:PORT of the job's store, for the workers


class KV(Protocol):
    """The four calls of a c10d Store that the coordinator and heartbeats use."""

    def add(self, key: str, value: int) -> int: ...
    def set(self, key: str, value: str) -> None: ...  # str, as torch's Store.set declares
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...


class Generation(msgspec.Struct, frozen=True):
    gen: int
    members: list[str]
    sync: str  # "restore" | "share" | "none"

    def rank_of(self, node: str) -> int | None:
        return self.members.index(node) if node in self.members else None


def read_gen(store: KV, gen: int) -> Generation | None:
    key = f"{GEN_KEY}/{gen}"
    if gen <= 0 or not store.check([key]):
        return None
    return msgspec.json.decode(store.get(key), type=Generation)


def newest_gen(store: KV) -> int:
    return store.add(GEN_KEY, 0)  # add 0: reads the counter without blocking, creating it at 0


def parse_state(value: str) -> tuple[str, int]:
    """``"member 3"`` -> ("member", 3); ``"join"`` -> ("join", 0); anything else is "unknown"."""
    parts = value.split()
    if not parts or parts[0] not in ("join", "member", "failed", "leave", "done"):
        return "unknown", 0
    try:
        return parts[0], int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return "unknown", 0


@dataclass
class _Seen:
    value: str = ""
    at: float = 0.0
    kind: str = "unknown"
    gen: int = 0
    incarnation: str = ""


@dataclass
class Coordinator:
    """Call :meth:`tick` a few times a second; it publishes a new generation when membership must change.

    - The first generation waits for ``min_nodes`` workers, then up to
      ``first_window`` s more for the rest (or until ``max_nodes``).
    - A member whose heartbeat stopped for ``dead_after`` s, whose process
      restarted, or that left, is dropped; when a member reports a
      failed collective, one that has not beaten for ``quiet_after`` s is too.
    - Workers waiting to join are added after ``join_window`` s (to take several
      in one change).
    - When no member's process lived through a failure, the restore waits up to
      ``rejoin_wait`` s for the other members' restarted processes, as
      TorchElastic's rendezvous waits for its last call: the restore picks the
      newest checkpoint any member holds, and a member left out of it is brought
      in later by ``share``, which throws away its own newer checkpoints (two
      workers killed by one fault: the first back restored tier 2's step 1000
      alone, the second's tier 0 held 1755). A member that lived through it holds
      the job's newest steps itself: its restore does not wait.
    """

    store: KV
    clock: Callable[[], float]
    min_nodes: int = 1
    max_nodes: int = 1 << 16
    dead_after: float = 2.0
    quiet_after: float = 0.8
    join_window: float = 1.0
    first_window: float = 10.0
    failed_wait: float = 5.0
    rejoin_wait: float = 3.0
    current: Generation | None = None
    seen: dict[str, _Seen] = field(default_factory=dict)
    _incarnations: dict[str, str] = field(default_factory=dict)  # of each member when it was admitted
    _dropped: dict[str, float] = field(default_factory=dict)  # when a node was last dropped as gone
    # Members of the current generation found gone, and since when (a restore waits for them to come back).
    _gone_since: dict[str, float] = field(default_factory=dict)
    _registered: int = 0
    _joiners_since: float | None = None
    _failed_since: float | None = None

    # ------------------------------------------------------------------ input

    def _scan(self) -> None:
        count = self.store.add("gw/nreg", 0)
        for i in range(self._registered + 1, count + 1):
            key = f"gw/reg/{i}"
            if not self.store.check([key]):
                break  # counted but not written yet: read it on the next tick
            self.seen.setdefault(self.store.get(key).decode(errors="replace"), _Seen())
            self._registered = i
        now = self.clock()
        for node, s in self.seen.items():
            key = f"gw/hb/{node}"
            if not self.store.check([key]):
                continue
            value = self.store.get(key).decode(errors="replace")
            if value != s.value:
                incarnation, _, rest = value.partition(" ")
                s.value, s.at, s.incarnation = value, now, incarnation
                s.kind, s.gen = parse_state(rest.partition(" ")[2])

    def _alive(self, node: str) -> bool:
        s = self.seen.get(node)
        return s is not None and s.at > 0 and self.clock() - s.at < self.dead_after and s.kind not in ("done", "unknown")

    # ---------------------------------------------------------------- decide

    def tick(self) -> Generation | None:
        """Look at every worker once; publish and return a new generation, or None."""
        self._scan()
        now = self.clock()
        cur = self.current
        members = cur.members if cur else []
        g = cur.gen if cur else 0
        # A joiner beats now, and has beaten since it was last dropped (a dead node's
        # last heartbeat is not a request to join).
        joiners = [n for n, s in sorted(self.seen.items())
                   if self._alive(n) and s.kind in ("join", "failed", "member")
                   and now - s.at < self.quiet_after
                   and s.at > max(self._dropped.get(n, float("-inf")), self._gone_since.get(n, float("-inf")))
                   and (n not in members or s.incarnation != self._incarnations.get(n))]
        if not members:
            if len(joiners) < self.min_nodes:
                self._joiners_since = None
                return None
            self._joiners_since = self._joiners_since or now
            if len(joiners) >= self.max_nodes or now - self._joiners_since >= self.first_window:
                return self._publish(joiners[: self.max_nodes], "restore")
            return None
        state = {m: self.seen.get(m, _Seen()) for m in members}
        # A member with a new incarnation was restarted: the process we admitted is gone.
        gone = [m for m in members if not self._alive(m) or state[m].incarnation != self._incarnations.get(m)]
        leaving = [m for m in members if state[m].kind == "leave" and state[m].gen == g]
        failed = [m for m in members if state[m].kind == "failed" and state[m].gen == g]
        if failed:
            self._failed_since = self._failed_since or now
            if not gone:
                # A collective failed and a member has gone quiet: it is the one that died.
                gone = [m for m in members if m not in failed and m not in leaving
                        and now - state[m].at >= self.quiet_after]
            if not gone and len(failed) + len(leaving) < len(members) and now - self._failed_since < self.failed_wait:
                return None  # the others may be about to fail too
        else:
            self._failed_since = None
        if any(state[m].kind == "done" for m in members):
            return None  # the run is finishing: members stop one by one
        # Since when each member now gone has been (one that came back, same process, is forgotten here).
        self._gone_since = {m: self._gone_since.get(m, now) for m in gone}
        if gone or failed or leaving:
            keep = [m for m in members if m not in gone and m not in leaving]
            new = keep + [n for n in joiners if n not in keep]
            planned = not gone and not failed
            sync = "none" if planned and new == keep else ("share" if planned else "restore")
            away = [m for m in gone if m not in new]  # dropped, and no new process of theirs asks in yet
            if (sync == "restore" and not keep and away
                    and now - min(self._gone_since.values()) < self.rejoin_wait):
                return None  # no process lived through it: the newest checkpoint may be an absent one's
            if len(new) < self.min_nodes:
                return None  # too few to train: wait for joiners
            return self._publish(new[: self.max_nodes], sync)
        if joiners and len(members) < self.max_nodes:
            self._joiners_since = self._joiners_since or now
            if now - self._joiners_since >= self.join_window:
                return self._publish((members + joiners)[: self.max_nodes], "share")
        else:
            self._joiners_since = None
        return None

    def _publish(self, members: list[str], sync: str) -> Generation:
        gen = Generation(gen=(self.current.gen if self.current else 0) + 1, members=members, sync=sync)
        self.store.set(f"{GEN_KEY}/{gen.gen}", msgspec.json.encode(gen).decode())  # the store keeps it as UTF-8
        self.store.add(GEN_KEY, 1)  # after the description: a reader that sees the number finds it
        logger.info("generation {}: {} ({})", gen.gen, ", ".join(members), sync)
        self.current = gen
        self._incarnations = {m: self.seen[m].incarnation for m in members if m in self.seen}
        self._joiners_since = self._failed_since = None
        for m, since in self._gone_since.items():
            if m not in members:
                self._dropped[m] = since  # its heartbeats from before then are not a request to join
        self._gone_since = {}
        return gen

    def run(self, stop: threading.Event, interval: float = 0.1) -> None:
        while not stop.wait(interval):
            try:
                self.tick()
            except Exception as exc:  # one bad read must not end the job's membership
                logger.warning("membership tick failed: {}", exc)


class Heartbeat:
    """A worker's presence: registers its node, then rewrites ``gw/hb/<node>`` from a daemon thread."""

    def __init__(self, store: KV, node: str, interval: float = HEARTBEAT_S,
                 on_beat: Callable[[int], None] | None = None) -> None:
        """``on_beat`` gets the newest generation number after each beat (from the heartbeat thread)."""
        import secrets

        self.incarnation = secrets.token_hex(4)
        self.store = store
        self.node = node
        self.interval = interval
        self.state = "join"
        self._count = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.on_beat = on_beat

    def set(self, state: str) -> None:
        with self._lock:
            self.state = state
        self.beat()

    def beat(self) -> None:
        with self._lock:
            self._count += 1
            self.store.set(f"gw/hb/{self.node}", f"{self.incarnation} {self._count} {self.state}")

    def register(self) -> None:
        """Make the node known to the coordinator (asking to join)."""
        index = self.store.add("gw/nreg", 1)
        self.store.set(f"gw/reg/{index}", self.node)
        self.beat()

    def start(self) -> threading.Thread:
        """Register the node and beat from a daemon thread until :meth:`stop`."""
        self.register()

        def loop() -> None:
            while not self._stop.wait(self.interval):
                try:
                    self.beat()
                    if self.on_beat is not None:
                        with self._lock:  # the store client is shared with set() from the loop's thread
                            newest = newest_gen(self.store)
                        self.on_beat(newest)
                except Exception as exc:  # the store is gone: the coordinator will drop us
                    logger.bind(node=self.node).warning("heartbeat failed: {}", exc)

        thread = threading.Thread(target=loop, name="membership-heartbeat", daemon=True)
        thread.start()
        return thread

    def stop(self, final: str = "done") -> None:
        self._stop.set()
        try:
            self.set(final)
        except Exception:
            pass


def wait_for_gen(store: KV, after: int, node: str, timeout: float, clock: Callable[[], float],
                 sleep: Callable[[float], None], want_member: bool = True) -> Generation | None:
    """The first generation newer than ``after`` (that names ``node`` if ``want_member``); None after ``timeout``."""
    deadline = clock() + timeout
    while clock() < deadline:
        newest = newest_gen(store)
        if newest > after:
            gen = read_gen(store, newest)
            if gen is not None and (not want_member or node in gen.members):
                return gen
            if gen is not None:
                after = newest  # a generation without us: wait for one that takes us
        sleep(0.05)
    return None
