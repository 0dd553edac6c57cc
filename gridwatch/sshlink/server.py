"""gridwatch's SSH face, the agent's and the relay's: public keys only, two roles, one subsystem, nothing else."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any

import asyncssh
from loguru import logger

from gridwatch.sshlink.policy import quiet_ignores, server_options, weak_key_reason
from gridwatch.sshlink.ratelimit import LogLimiter
from gridwatch.wire import protocol as p

READ_CHUNK = 65536

# path -> the problem last logged for it: a bad file is named once, not on every login attempt.
_file_problems: dict[str, str] = {}


def authorized_file_problem(path: str, st: os.stat_result) -> str | None:
    """Why an authorized file must not be trusted (others can write it), as sshd's StrictModes judges; or None."""
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid not in (0, os.geteuid()):
        return f"{path} is owned by uid {st.st_uid}, not by root or the agent's user; chown it"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "group and others" if st.st_mode & stat.S_IWGRP and st.st_mode & stat.S_IWOTH else ("its group" if st.st_mode & stat.S_IWGRP else "others")
        return f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}); run: chmod go-w {path}"
    return None


def load_authorized(path: str) -> list[asyncssh.SSHKey]:
    """Public keys from an authorized_keys-style file; a missing file, or one others can write, grants nobody."""
    keys: list[asyncssh.SSHKey] = []
    try:
        with open(path, "rb") as f:
            problem = authorized_file_problem(path, os.fstat(f.fileno()))
            text = "" if problem else f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return keys
    except OSError as exc:
        problem = f"{path} cannot be read: {exc.strerror or exc}"
    if problem:
        if _file_problems.get(path) != problem:
            logger.error("{}: ignored, it grants nobody", problem)
            _file_problems[path] = problem
        return keys
    _file_problems.pop(path, None)
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            keys.append(asyncssh.import_public_key(line))
        except (asyncssh.KeyImportError, ValueError) as exc:
            logger.warning("{}:{}: not a public key, ignored: {}", path, number, exc)
    return keys


@dataclass(frozen=True)
class Caller:
    """Who is on the other end of a session: the key the server accepted."""

    username: str
    role: str  # viewer | operator
    key: str  # SHA256 fingerprint of the client key

    def __str__(self) -> str:
        return f"{self.username} ({self.role}, {self.key})"

    def behind(self, key: str, role: str) -> Caller:
        """This caller (a relay) forwarding for console ``key`` with ``role`` there: the lesser role of the
        two, and a key of its own, so each console behind a relay has its own request budget."""
        return Caller(username=f"{self.username} for {key}", role=weaker_role(self.role, role),
                      key=f"{self.key}>{key}"[:200])


ROLES = ("viewer", "operator")  # weakest first


def weaker_role(a: str, b: str | None) -> str:
    """The role that may do less of the two ("viewer" when either is unknown)."""
    if a not in ROLES or b not in ROLES:
        return "viewer"
    return ROLES[min(ROLES.index(a), ROLES.index(b))]


@dataclass
class Gate:
    """Connections still authenticating, capped as sshd's MaxStartups caps them; and refusals, logged sparingly."""

    limit: int
    waiting: int = 0
    crowded_log: LogLimiter = field(default_factory=LogLimiter)
    refused_log: LogLimiter = field(default_factory=LogLimiter)


class RoleKeyServer(asyncssh.SSHServer):
    """gridwatch's SSH face, per connection (the agent's and the relay's): public keys only, the role by
    the list the key is in (read at each attempt, so adding a key needs no restart), connections still
    authenticating capped, no forwarding of any kind. Subclasses say where the lists are and what a
    session is."""

    def __init__(self, gate: Gate, node: str) -> None:
        self.gate = gate
        self.node = node  # whose log lines these are
        self.caller: Caller | None = None
        self._conn: asyncssh.SSHServerConnection | None = None
        self._counted = False  # holds one of the gate's places until it authenticates or leaves
        self._peer = "?"

    def authorized(self) -> tuple[str, str]:
        """The authorized_operators and authorized_viewers files."""
        raise NotImplementedError

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._conn = conn
        quiet_ignores(conn)
        peer = conn.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"
        if self.gate.waiting >= self.gate.limit:
            held = self.gate.crowded_log.allow()
            if held is not None:
                more = f" ({held} more since the last such line)" if held else ""
                logger.bind(node=self.node).warning(
                    "refused a connection from {}: {} connections are still authenticating{}", self._peer, self.gate.limit, more
                )
            conn.close()
            return
        self.gate.waiting += 1
        self._counted = True

    def _release(self) -> None:
        if self._counted:
            self._counted = False
            self.gate.waiting -= 1

    def auth_completed(self) -> None:
        self._release()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()

    def begin_auth(self, username: str) -> bool:
        return True

    def password_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        user = p.clean_text(username, 64)
        weak = weak_key_reason(key)
        if weak is not None:
            logger.bind(node=self.node).warning("refused key {} for user {!r}: {}", key.get_fingerprint(), user, weak)
            return False
        operators, viewers = self.authorized()
        for role, path in (("operator", operators), ("viewer", viewers)):
            if any(k.public_data == key.public_data for k in load_authorized(path)):
                self.caller = Caller(username=user, role=role, key=key.get_fingerprint())
                return True
        logger.bind(node=self.node).warning(
            "refused key {} for user {!r}: not in authorized_viewers or authorized_operators", key.get_fingerprint(), user)
        return False

    def _who(self) -> str:
        return str(self.caller) if self.caller is not None else self._peer

    def refused(self, what: str) -> bool:
        """Say (sparingly) that ``what`` was asked and refused; False, the answer to give."""
        held = self.gate.refused_log.allow()
        if held is not None:
            more = f" ({held} more refused requests since the last such line)" if held else ""
            logger.bind(node=self.node).warning("refused {} from {}: only the '{}' subsystem is served{}",
                                                what, self._who(), p.SUBSYSTEM, more)
        return False

    def server_requested(self, listen_host: str, listen_port: int) -> bool:
        return self.refused("remote port forwarding")

    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str, orig_port: int) -> bool:
        return self.refused("port forwarding")

    def unix_server_requested(self, listen_path: str) -> bool:
        return self.refused("socket forwarding")

    def unix_connection_requested(self, dest_path: str) -> bool:
        return self.refused("socket forwarding")


class SubsystemSession(asyncssh.SSHServerProcess):
    """A session channel; SFTP is refused (and logged) before it starts, like everything but the subsystem."""

    def __init__(self, process_factory: asyncssh.SSHServerProcessFactory, server: RoleKeyServer) -> None:
        super().__init__(process_factory, None, asyncssh.sftp.MIN_SFTP_VERSION, False)
        self._server = server

    def subsystem_requested(self, subsystem: str) -> bool:
        if subsystem == "sftp":
            return self._server.refused("SFTP")
        return super().subsystem_requested(subsystem)


def admitted(process: asyncssh.SSHServerProcess, program: str) -> Caller | None:
    """Who this session is, if it asked for the gridwatch subsystem; else it is refused, said and ended (None)."""
    server = process.get_extra_info("connection").get_owner()
    caller: Caller | None = getattr(server, "caller", None)
    if process.subsystem == p.SUBSYSTEM and caller is not None:
        return caller
    what = f"subsystem {process.subsystem!r}" if process.subsystem else ("a command" if process.command else "a shell")
    if isinstance(server, RoleKeyServer):
        server.refused(p.clean_text(what, 100))
    process.stderr.write(
        f"gridwatch {program}: {what} is not served here; only the '{p.SUBSYSTEM}' subsystem "
        f"(try: ssh -s -p PORT HOST {p.SUBSYSTEM})\n".encode()
    )
    process.exit(1)
    return None


def subsystem_server_options(login_timeout: float) -> dict[str, Any]:
    """asyncssh.create_server's settings for gridwatch's SSH face (the agent's and the relay's)."""
    return dict(
        # Sessions are made by the server's session_requested (SubsystemSession), which refuses SFTP out loud.
        encoding=None,
        allow_scp=False,
        sftp_factory=None,
        agent_forwarding=False,
        x11_forwarding=False,
        line_editor=False,
        # A console that vanished is let go after 3 unanswered keepalives. Each one costs the console a
        # request to answer: 2,500 nodes at 15 s were 170 a second; at 60 s, 42.
        keepalive_interval=60,
        keepalive_count_max=3,
        login_timeout=login_timeout,
        **server_options(),
    )
