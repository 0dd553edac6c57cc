"""The agent's SSH face: public keys only, two roles, one subsystem, nothing else."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncssh
from loguru import logger

from agents import protocol as p
from agents.agent import Agent, Caller, ClientStream
from agents.framing import LineBuffer

READ_CHUNK = 65536


def load_authorized(path: str) -> list[asyncssh.SSHKey]:
    """Public keys from an authorized_keys-style file; a missing file grants nobody."""
    keys: list[asyncssh.SSHKey] = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return keys
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            keys.append(asyncssh.import_public_key(line))
        except (asyncssh.KeyImportError, ValueError) as exc:
            logger.warning("{}:{}: not a public key, ignored: {}", path, number, exc)
    return keys


class _Server(asyncssh.SSHServer):
    """Per connection: decides the role from the key, refuses everything but public keys."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.caller: Caller | None = None
        self._conn: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._conn = conn

    def begin_auth(self, username: str) -> bool:
        return True

    def password_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        cfg = self.agent.config
        # Files are re-read per attempt so adding a key needs no restart.
        for role, path in (("operator", cfg.authorized_operators), ("viewer", cfg.authorized_viewers)):
            if any(k.public_data == key.public_data for k in load_authorized(path)):
                self.caller = Caller(username=p.clean_text(username, 64), role=role, key=key.get_fingerprint())
                return True
        logger.bind(node=str(self.agent.node)).warning(
            "refused key {} for user {!r}: not in authorized_viewers or authorized_operators",
            key.get_fingerprint(),
            p.clean_text(username, 64),
        )
        return False

    def server_requested(self, listen_host: str, listen_port: int) -> bool:
        return False

    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str, orig_port: int) -> bool:
        return False


async def _session(agent: Agent, process: asyncssh.SSHServerProcess) -> None:
    server = process.get_extra_info("connection").get_owner()
    caller: Caller | None = getattr(server, "caller", None)
    if process.subsystem != p.SUBSYSTEM or caller is None:
        what = f"subsystem {process.subsystem!r}" if process.subsystem else ("a command" if process.command else "a shell")
        process.stderr.write(
            f"gridwatch agent: {what} is not served here; only the '{p.SUBSYSTEM}' subsystem "
            f"(try: ssh -s -p PORT HOST {p.SUBSYSTEM})\n".encode()
        )
        process.exit(1)
        return
    client = ClientStream(caller=caller)
    agent.clients.add(client)
    log = logger.bind(node=str(agent.node))
    log.info("client connected: {}", caller)
    process.stdout.write(agent.hello(caller.role))
    writer = asyncio.create_task(agent.write_loop(client, process.stdout.write, process.stdout.drain))
    pending: set[asyncio.Task[None]] = set()
    lines = LineBuffer()
    try:
        while True:
            data = await process.stdin.read(READ_CHUNK)
            if not data:
                break
            before = lines.oversized
            for line in lines.feed(data):
                work = agent.handle_request(client, line)
                if work is not None:
                    task = asyncio.ensure_future(work)
                    pending.add(task)
                    task.add_done_callback(pending.discard)
            if lines.oversized != before:
                client.reply(agent.reply_frame(p.Error(code=p.Text("too_large"), message=p.Text(f"request over {p.MAX_FRAME_BYTES} bytes dropped"))))
    except (asyncssh.BreakReceived, asyncssh.SignalReceived, asyncssh.TerminalSizeChanged):
        pass
    except (asyncssh.DisconnectError, ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        client.closed = True
        client.wake.set()
        agent.clients.discard(client)
        for task in pending:
            task.cancel()
        writer.cancel()
        log.info("client gone: {} ({} replies dropped)", caller, client.dropped)
        try:
            process.exit(0)
        except (OSError, asyncssh.Error):
            pass


async def serve(agent: Agent, host: str, port: int) -> asyncssh.SSHAcceptor:
    """Listen for consoles; returns the acceptor (``.close()`` to stop, ``.sockets`` for the port)."""
    try:
        host_key = asyncssh.read_private_key(agent.config.host_key)
    except (OSError, asyncssh.KeyImportError) as exc:
        raise RuntimeError(f"cannot read the agent host key {agent.config.host_key}: {exc}") from None
    return await asyncssh.create_server(
        lambda: _Server(agent),
        host,
        port,
        server_host_keys=[host_key],
        process_factory=lambda proc: _session(agent, proc),
        encoding=None,
        allow_scp=False,
        sftp_factory=None,
        agent_forwarding=False,
        x11_forwarding=False,
        line_editor=False,
        # AES-GCM costs the console less CPU per frame than the default ChaCha20.
        encryption_algs=["aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com", "aes128-ctr"],
        keepalive_interval=15,
        keepalive_count_max=3,
    )
