"""A worker's side of the membership: its heartbeat, the generations it joins, and their process groups.

The coordinator (:mod:`gridwatch.trainer.membership`) names the members of each
generation; this module turns one into a ``torch.distributed`` process group
on a fresh prefix of the job's store, so a new generation never reads an old
one's keys. Every member computes its rank from the generation's member list,
so forming a group needs no further rendezvous.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import psutil
import torch.distributed as dist
from loguru import logger

from gridwatch.trainer.membership import STORE_ENV, Generation, Heartbeat, newest_gen, read_gen, wait_for_gen


def close_peer_connections(keep_port: int) -> int:
    """Shut down this process's TCP connections except those to ``keep_port`` (the store); returns how many.

    A gloo collective waiting on a peer that is frozen, or that gave up on the
    collective, waits out the whole collective timeout: aborting the process
    group does not wake it. A shut-down socket does, at once, with an error.
    """
    closed = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.status != psutil.CONN_ESTABLISHED or not conn.raddr or conn.raddr.port == keep_port or conn.fd < 0:
            continue
        try:
            sock = socket.socket(fileno=os.dup(conn.fd))
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError:
            pass
        finally:
            sock.close()
    return closed


def parse_endpoint(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{STORE_ENV}={value!r}: expected HOST:PORT")
    return host, int(port)


class Membership:
    """Connects to the job's store, beats, and forms the process group of each generation it is in."""

    def __init__(self, endpoint: str, node: str, connect_timeout: float = 60.0) -> None:
        host, port = parse_endpoint(endpoint)
        timeout = timedelta(seconds=connect_timeout)
        # One client for the loop, one for the heartbeat (used under its lock): a client is not thread-safe.
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        self.node = node
        self.port = port
        self.heartbeat = Heartbeat(dist.TCPStore(host, port, is_master=False, timeout=timeout,
                                                 wait_for_workers=False), node, on_beat=self._watch)
        self.gen: Generation | None = None
        self.abort_after = 1.0  # seconds without a step boundary, once a newer generation is out, before breaking the collective
        self._boundary = time.monotonic()  # when the loop last passed a step boundary
        self._newer_since: float | None = None
        self._lock = threading.Lock()

    def at_boundary(self, step_s: float = 0.0) -> None:
        """The loop passed a step boundary (it will see a new generation there by itself)."""
        with self._lock:
            self._boundary = time.monotonic()
            self.abort_after = max(1.0, 3 * step_s)

    def _watch(self, newest: int) -> None:
        """Heartbeat thread: a newer generation that the loop has not reached in time means the loop
        is stuck in a collective with a peer that is gone; break that collective."""
        now = time.monotonic()
        with self._lock:
            if self.gen is None or newest <= self.gen.gen:
                self._newer_since = None
                return
            self._newer_since = self._newer_since or now
            # Stuck: no step boundary for abort_after, and the new generation has had a beat to be seen.
            stuck = now - self._newer_since >= 0.2 and now - self._boundary >= self.abort_after
            if stuck:
                self._boundary = now  # once per abort_after at most
        if stuck:
            closed = close_peer_connections(self.port)
            logger.bind(node=self.node).warning(
                "generation {} is out while this worker is stuck in generation {}'s collective: closed {} peer connections",
                newest, self.gen.gen, closed)

    def start(self) -> None:
        """Ask to join: from now on the coordinator may name this node in a generation."""
        self.heartbeat.start()

    @property
    def number(self) -> int:
        return self.gen.gen if self.gen else 0

    def newest(self) -> int:
        return newest_gen(self.store)

    def wait(self, timeout: float, want_member: bool = True) -> Generation | None:
        """The next generation after ours (one that takes this node, if ``want_member``); None after ``timeout``."""
        return wait_for_gen(self.store, self.number, self.node, timeout, time.monotonic, time.sleep, want_member)

    def read(self, number: int) -> Generation | None:
        """Generation ``number``, whatever its members (None if it is not published)."""
        return read_gen(self.store, number)

    def form(self, gen: Generation, backend: str, timeout: timedelta) -> None:
        """Leave the current process group (if any) and join ``gen``'s; raises if the group does not form."""
        rank = gen.rank_of(self.node)
        assert rank is not None, f"{self.node} is not a member of generation {gen.gen}"
        if dist.is_initialized():
            dist.destroy_process_group()  # also restarts torch's count of groups made
        else:
            # A group that failed to form still counted itself; the count names the group's
            # keys in the store, so every member must start it from 0 alike.
            dist.distributed_c10d._world.group_count = 0
        self.gen = gen
        store = dist.PrefixStore(f"gw/pg/{gen.gen}/", self.store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=len(gen.members), timeout=timeout)
        self.heartbeat.set(f"member {gen.gen}")
        logger.bind(node=self.node).info("generation {}: rank {} of {} ({})", gen.gen, rank, len(gen.members), gen.sync)

    def failed(self) -> None:
        self.heartbeat.set(f"failed {self.number}")

    def leave(self) -> None:
        self.heartbeat.set(f"leave {self.number}")

    def close(self, final: str = "done") -> None:
        self.heartbeat.stop(final)
